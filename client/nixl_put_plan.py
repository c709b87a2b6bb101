"""The frames of a NIXL_PUT and where the daemon reads each block's bytes (pure, no I/O).

A block is a run of pieces (its header, then views of the engine's KV, or one send buffer).
The daemon READs a piece where it lies when it is inside memory this process registered
(a lent KV tensor, a registered buffer); any other piece (the few bytes of a header) is
copied into a staging buffer first, and read there::

    block      [ head ][ row 0 ][ row 1 ] ... [ row n ]
    registered          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^    lent KV: read in place
    extents    [stage+0, 80] [row 0] [row 1] ... [row n]   adjacent extents joined
    staging    [ head | next block's head | ... ]

Frames are cut by bytes, items, extents and meta size, as the daemon's limits allow.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from kvtier.wire import events as m

FRAME_BYTES_TARGET = 32 << 20  # a NIXL_PUT carries about this much (a larger block alone in its frame)
STAGED_ALIGN_BYTES = 64  # each staged piece starts on a cache line of the staging buffer
META_FIXED_BYTES = m.KEY_SIZE + 2 + m.NIXL_AGENT_NAME_BYTES_MAX  # namespace id, agent name
ITEM_META_BYTES = m.KEY_SIZE + 4  # key, extent count
EXTENT_META_BYTES = 12


@dataclass
class PutFrame:
    """One NIXL_PUT: per item its extents as ``(address, length, staged)``; a staged extent's
    address is its offset in the staging buffer, filled from ``staged`` (offset, piece)."""

    indexes: list[int] = field(default_factory=list)  # the items of the call this frame carries
    extents: list[list[tuple[int, int, bool]]] = field(default_factory=list)
    staged: list[tuple[int, memoryview]] = field(default_factory=list)
    staged_bytes: int = 0
    nbytes: int = 0
    extent_count: int = 0

    def resolved(self, staging_address: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Each item's extents as absolute ``(address, length)``, staged ones inside the staging buffer."""
        return tuple(tuple((staging_address + a if staged else a, n) for a, n, staged in extents)
                     for extents in self.extents)


class RegisteredMemory:
    """The ``(address, length)`` ranges the daemon may read in place, sorted (they may touch)."""

    def __init__(self, ranges: Sequence[tuple[int, int]]):
        self._ranges = sorted((int(a), int(n)) for a, n in ranges if n > 0)
        self._starts = [a for a, _ in self._ranges]

    def holds(self, address: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address + length <= self._ranges[i][0] + self._ranges[i][1]

    def touches(self, address: int, length: int) -> bool:
        """Whether any byte of ``[address, address + length)`` is in a range."""
        i = bisect.bisect_right(self._starts, address + length - 1) - 1
        return i >= 0 and self._ranges[i][0] + self._ranges[i][1] > address


def plan_put(blocks: Sequence[Sequence], addresses: Sequence[Sequence[int]], registered: RegisteredMemory,
             payload_bytes_max: int, batch_count_max: int, meta_bytes_max: int,
             frame_bytes: int = FRAME_BYTES_TARGET) -> list[PutFrame]:
    """Frames for blocks given as their pieces (``blocks[i]``: flat byte views, in order) at
    ``addresses[i]`` (each piece's first byte). ValueError: a block larger than one frame may carry."""
    frame_bytes = min(frame_bytes, payload_bytes_max)
    extents_max = min(m.NIXL_EXTENTS_MAX, (meta_bytes_max - META_FIXED_BYTES) // EXTENT_META_BYTES)
    frames: list[PutFrame] = []
    frame = PutFrame()
    for index, (pieces, where) in enumerate(zip(blocks, addresses)):
        nbytes = sum(piece.nbytes for piece in pieces)
        if nbytes > payload_bytes_max:
            raise ValueError(f"a block of {nbytes} bytes is over the frame payload limit {payload_bytes_max}")
        extents: list[tuple[int, int, bool]] = []  # staged ones at offsets from this block's first staged byte
        staged: list[tuple[int, memoryview]] = []
        staged_at = 0
        for piece, address in zip(pieces, where):
            n = piece.nbytes
            if not n:
                continue
            if registered.holds(address, n):
                extent = (address, n, False)
            else:
                staged.append((staged_at, piece))
                extent = (staged_at, n, True)
                staged_at += -(-n // STAGED_ALIGN_BYTES) * STAGED_ALIGN_BYTES
            last = extents[-1] if extents else None
            if last is not None and last[2] == extent[2] and last[0] + last[1] == extent[0]:
                extents[-1] = (last[0], last[1] + n, last[2])
            else:
                extents.append(extent)
        if len(extents) > extents_max:
            raise ValueError(f"a block of {len(extents)} pieces is over the {extents_max} one NIXL_PUT may name")
        meta = META_FIXED_BYTES + ITEM_META_BYTES * (len(frame.indexes) + 1) + \
            EXTENT_META_BYTES * (frame.extent_count + len(extents))
        if frame.indexes and (frame.nbytes + nbytes > frame_bytes or len(frame.indexes) == batch_count_max
                              or frame.extent_count + len(extents) > extents_max or meta > meta_bytes_max):
            frames.append(frame)
            frame = PutFrame()
        base = frame.staged_bytes
        frame.indexes.append(index)
        frame.extents.append([(a + base, n, True) if is_staged else (a, n, False) for a, n, is_staged in extents])
        frame.staged += [(at + base, piece) for at, piece in staged]
        frame.staged_bytes = base + staged_at
        frame.nbytes += nbytes
        frame.extent_count += len(extents)
    if frame.indexes:
        frames.append(frame)
    return frames


def joined_ranges(ranges) -> list[tuple[int, int]]:
    """``(address, length)`` ranges with those that overlap or touch joined, sorted."""
    out: list[list[int]] = []
    for address, length in sorted((int(a), int(n)) for a, n in ranges if n > 0):
        if out and address <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], address + length - out[-1][0])
        else:
            out.append([address, length])
    return [(a, n) for a, n in out]
