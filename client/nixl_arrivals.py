"""Blocks that land in NIXL destinations part by part, verified as they arrive (pure: no I/O).

The daemon notifies each part of a NIXL_GET as it is written: ``(item, offset, length)``
ranges of the items' blocks. Each block's payload CRC runs over its bytes in order as
soon as they are in (ranges may arrive in any order: a range past the checked prefix waits
for the gap), so once the reply comes only the bytes of the last part are left to check.
A block is handed out only after :meth:`ArrivingBlocks.finish` has checked all of it the
way :func:`~kvtier.common.blockformat.verify_block` does: header (magic, version, CRC),
its length, key, sequence and payload CRC. A payload byte is checked as it was when its part
was notified: only that part's transfer writes there.

An item lands in one slot of a destination buffer, or across extents (scattered: a head slot
for the block and codec headers, then the rows of the engine's KV the payload belongs in)::

    block     [hdr|..... payload .....................................]
    arrived   [=========== r0 ===========][==== r1 ====]      [== r3 ==]
    checked   ^ crc over r0, r1 as they came      ^ prefix      r3 waits for r2
"""
from __future__ import annotations

import crc32c

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, check_header, decode_header

from .scatter_plan import LandedBlock


class _Item:
    __slots__ = ("views", "ends", "checked", "crc", "waiting")

    def __init__(self, views: list[memoryview]):
        self.views = views  # where the block's bytes land, in order
        self.ends, end = [], 0
        for view in views:
            end += view.nbytes
            self.ends.append(end)
        self.checked = 0  # bytes of the block [0, checked) are in and folded into the CRC
        self.crc = 0  # CRC32C of the payload bytes in [HEADER_SIZE, checked)
        self.waiting: dict[int, int] = {}  # offset -> length of ranges in past the checked prefix

    @property
    def room(self) -> int:
        return self.ends[-1] if self.ends else 0


class ArrivingBlocks:
    """Blocks of one NIXL_GET landing in ``destinations[i]``: item i's views, in block order (one
    slot of a buffer, or a scatter list)."""

    def __init__(self, destinations: list[list[memoryview]]):
        self._items = [_Item([memoryview(v).cast("B") for v in views]) for views in destinations]
        self.transfer_open = False  # a NIXL_GET into these destinations went out and its reply has not come
        self.unsettled = False  # a scatter NIXL_GET into them ended without the daemon ending its WRITEs

    def arrived(self, item: int, offset: int, length: int) -> None:
        """The daemon says block ``item``'s bytes ``[offset, offset + length)`` are in. A range
        outside the item's room is ignored (the block then fails at :meth:`finish`)."""
        if not 0 <= item < len(self._items) or offset < 0 or length <= 0 or \
                offset + length > self._items[item].room:
            return
        state = self._items[item]
        if offset > state.checked:
            state.waiting[offset] = max(length, state.waiting.get(offset, 0))
            return
        self._fold(state, offset + length)
        while state.checked in state.waiting:
            self._fold(state, state.checked + state.waiting.pop(state.checked))

    def covered(self, item: int, length: int) -> bool:
        """Whether the first ``length`` bytes of block ``item`` have all been said to be in."""
        return self._items[item].checked >= length

    def finish(self, item: int, length: int, key: bytes, seq: int) -> memoryview | LandedBlock:
        """The block once all ``length`` bytes of it check out (BlockFormatError names the first
        problem): a read-only view of its slot, or, scattered, a :class:`LandedBlock` (its head
        slot; the payload lies in the item's other views). Bytes no notification covered are folded
        in now."""
        state = self._items[item]
        scattered = len(state.views) > 1
        if length > state.room or (scattered and length != state.room):
            raise BlockFormatError(f"block of {length} bytes does not fill its {state.room}-byte destination")
        if state.checked < length:
            self._fold(state, length)
        head = state.views[0]
        header = decode_header(head)
        check_header(header, length, key, seq)
        crc = state.crc if state.checked == length else self._crc(state, length)
        if crc != header.payload_crc:
            raise BlockFormatError(f"payload CRC mismatch for key {header.key.hex()}")
        if scattered:
            return LandedBlock(head.toreadonly(), length)
        return head[:length].toreadonly()

    def _fold(self, state: _Item, end: int) -> None:
        """Fold the block's bytes [checked, end) into its payload CRC."""
        if end <= state.checked:
            return
        state.crc = self._crc(state, end, state.checked, state.crc)
        state.checked = end

    @staticmethod
    def _crc(state: _Item, end: int, start: int = 0, crc: int = 0) -> int:
        """``crc`` extended over the payload bytes of [start, end) of the block, across its views."""
        start = max(start, HEADER_SIZE)
        view_start = 0
        for view, view_end in zip(state.views, state.ends):
            lo, hi = max(start, view_start), min(end, view_end)
            if lo < hi:
                crc = crc32c.crc32c(view[lo - view_start:hi - view_start], crc)
            view_start = view_end
            if view_start >= end:
                break
        return crc
