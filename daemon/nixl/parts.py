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
    nbytes: int = 0  # of ``local``'s lengths, kept as pieces are added

    def add(self, item: int, offset: int, address: int, at: int, length: int) -> None:
        """``length`` bytes of ``item``'s block from ``offset``: at ``address`` here, ``at`` there."""
        self.local.append((address, length))
        self.remote.append((at, length))
        last = self.ranges[-1] if self.ranges else None
        if last is not None and last[0] == item and last[1] + last[2] == offset:
            self.ranges[-1] = (item, last[1], last[2] + length)
        else:
            self.ranges.append((item, offset, length))
        self.nbytes += length


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
                part.add(item, offset, address, at, take)
                address, length, offset = address + take, length - take, offset + take
                at, room = at + take, room - take
                if part.nbytes >= part_bytes or len(part.ranges) >= ranges_max:
                    parts.append(part)
                    part = Part()
    if part.local:
        parts.append(part)
    return parts
