"""A NIXL_GET's WRITE cut into parts, each with its own notification (pure, no I/O).

The client verifies a block's CRC as its bytes arrive, part by part, so only the last part's
bytes are left to check once the transfer is done::

    items      [ block 0 (32 MiB)                      ][ b1 ][ b2 ]...
    pieces      device memory or arena runs, any sizes
    extents     where the client wants them: one descriptor, or the rows of its KV (scatter)
    parts      [ part 0  ][ part 1  ][ part 2  ][ part 3  ][ part 4  ]   about PART_BYTES each
    notified   (item 0, 0, 8 MiB) ... (item 0, 24 MiB, 8 MiB), (item 1, 0, n), (item 2, 0, n) ...
"""
from __future__ import annotations

from dataclasses import dataclass, field

PART_BYTES = 8 << 20  # a part ends once it holds this many bytes (at the end of a piece, or cut inside one)


@dataclass
class Part:
    local: list[tuple[int, int]] = field(default_factory=list)  # (address, length) in the daemon's memory
    remote: list[tuple[int, int]] = field(default_factory=list)  # (address, length) in the client's buffer
    ranges: list[tuple[int, int, int]] = field(default_factory=list)  # (item, offset in its block, length)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.local)


def plan_parts(items, part_bytes: int = PART_BYTES, ranges_max: int = 4096) -> list[Part]:
    """``items``: ``(item index, [(local address, length), ...], [(remote address, length), ...])``
    each: its block's bytes, in order, in the daemon's memory and where they go in the client's
    (the remote extents hold at least the local bytes). Parts cover them in order."""
    if part_bytes <= 0:
        raise ValueError(f"part size must be positive, got {part_bytes}")
    parts: list[Part] = []
    part = Part()
    for item, pieces, extents in items:
        offset = 0
        remote = iter(extents)
        at, room = 0, 0
        for address, length in pieces:
            while length:
                if not room:
                    at, room = next(remote)
                take = min(length, room, part_bytes - part.nbytes)
                part.local.append((address, take))
                part.remote.append((at, take))
                if part.ranges and part.ranges[-1][0] == item and sum(part.ranges[-1][1:]) == offset:
                    part.ranges[-1] = (item, part.ranges[-1][1], part.ranges[-1][2] + take)
                else:
                    part.ranges.append((item, offset, take))
                address, length, offset = address + take, length - take, offset + take
                at, room = at + take, room - take
                if part.nbytes >= part_bytes or len(part.ranges) >= ranges_max:
                    parts.append(part)
                    part = Part()
    if part.local:
        parts.append(part)
    return parts
