"""Blocks that land in a NIXL destination buffer part by part, verified as they arrive (pure: no I/O).

The daemon notifies each part of a NIXL_GET as it is written: ``(item, offset, length)``
ranges of the items' blocks. Each block's payload CRC runs over its bytes in order as
soon as they are in (ranges may arrive in any order: a range past the checked prefix waits
for the gap), so once the reply comes only the bytes of the last part are left to check.
A block is handed out only after :meth:`ArrivingBlocks.finish` has checked all of it the
way :func:`~kvtier.common.blockformat.verify_block` does: header (magic, version, CRC),
its length, key, sequence and payload CRC. A payload byte is checked as it was when its part
was notified: only that part's transfer writes there::

    block     [hdr|..... payload .....................................]
    arrived   [=========== r0 ===========][==== r1 ====]      [== r3 ==]
    checked   ^ crc over r0, r1 as they came      ^ prefix      r3 waits for r2
"""
from __future__ import annotations

import crc32c

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, decode_header


class _Item:
    __slots__ = ("checked", "crc", "waiting")

    def __init__(self):
        self.checked = 0  # bytes of the block [0, checked) are in and folded into the CRC
        self.crc = 0  # CRC32C of the payload bytes in [HEADER_SIZE, checked)
        self.waiting: dict[int, int] = {}  # offset -> length of ranges in past the checked prefix


class ArrivingBlocks:
    """Blocks of one NIXL_GET landing in ``buffer``: item i's block starts at ``starts[i]`` and has
    room for ``capacities[i]`` bytes."""

    def __init__(self, buffer: memoryview, starts: list[int], capacities: list[int]):
        self._buffer = buffer
        self._starts = starts
        self._capacities = capacities
        self._items: dict[int, _Item] = {}

    def arrived(self, item: int, offset: int, length: int) -> None:
        """The daemon says block ``item``'s bytes ``[offset, offset + length)`` are in. A range
        outside the item's room is ignored (the block then fails at :meth:`finish`)."""
        if not 0 <= item < len(self._starts) or offset < 0 or length <= 0 or \
                offset + length > self._capacities[item]:
            return
        state = self._items.setdefault(item, _Item())
        if offset > state.checked:
            state.waiting[offset] = max(length, state.waiting.get(offset, 0))
            return
        self._fold(item, state, offset + length)
        while state.checked in state.waiting:
            self._fold(item, state, state.checked + state.waiting.pop(state.checked))

    def covered(self, item: int, length: int) -> bool:
        """Whether the first ``length`` bytes of block ``item`` have all been said to be in."""
        state = self._items.get(item)
        return state is not None and state.checked >= length

    def finish(self, item: int, length: int, key: bytes, seq: int) -> memoryview:
        """The block, read-only, once all ``length`` bytes of it check out (BlockFormatError names
        the first problem). Bytes no notification covered are folded in now."""
        state = self._items.setdefault(item, _Item())
        if length > self._capacities[item]:
            raise BlockFormatError(f"block of {length} bytes is larger than its {self._capacities[item]}-byte slot")
        if state.checked < length:
            self._fold(item, state, length)
        view = self._buffer[self._starts[item]:self._starts[item] + length]
        header = decode_header(view)
        if header.block_size != length:
            raise BlockFormatError(f"block is {length} bytes, header says {header.block_size}")
        if header.key != bytes(key):
            raise BlockFormatError(f"block key {header.key.hex()} is not the expected {bytes(key).hex()}")
        if header.seq != seq:
            raise BlockFormatError(f"block sequence {header.seq} is not the expected {seq}")
        crc = state.crc if state.checked == length else crc32c.crc32c(view[HEADER_SIZE:])
        if crc != header.payload_crc:
            raise BlockFormatError(f"payload CRC mismatch for key {header.key.hex()}")
        return view.toreadonly()

    def _fold(self, item: int, state: _Item, end: int) -> None:
        """Fold the block's bytes [checked, end) into its payload CRC."""
        if end <= state.checked:
            return
        start = self._starts[item]
        lo = max(state.checked, HEADER_SIZE)
        if end > lo:
            state.crc = crc32c.crc32c(self._buffer[start + lo:start + end], state.crc)
        state.checked = end
