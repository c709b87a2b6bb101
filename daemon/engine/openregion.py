"""The open region's DRAM image (pure, no I/O).

Appends go here: blocks from the front (after the header page), summary
entries from the back (see :mod:`.regionfmt`). The engine writes parts of
this image to flash -- the filled prefix for a durable put, everything at
seal -- so the image is always exactly what the region will hold::

    0        4K                      data_end      summary_start      end
    | header | block | block | ...   |    free      | entries (rev) | trailer |
    |<- durable_end: prefix already on flash ->|

A PUT received in place (:mod:`.puts`) holds ``pending_bytes`` from
``data_end`` (and room for ``pending_entries`` summary entries) while its payload
arrives: not data yet, so nothing written to flash or sealed covers it until it is
placed (:meth:`OpenRegion.place_block`).
"""
from __future__ import annotations

import threading

import numpy as np

from kvtier.common.blockformat import HEADER_SIZE, stamp_sequence

from . import regionfmt as fmt
from .buffers import copy_bytes
from kvtier.common.aligned import align_down, align_up, aligned_buffer


class OpenRegion:
    def __init__(self, buffer: memoryview):
        self.buffer = buffer
        self.size_bytes = buffer.nbytes
        self.region = -1
        self.base_seq = 0
        self.last_seq = 0
        self.generation = 0
        self.data_end = fmt.REGION_HEADER_BYTES
        self.entry_count = 0
        self.durable_end = 0  # bytes of the prefix known to be on flash and synced
        self.written_end = 0  # bytes of the prefix a commit has written, synced or not (a seal skips them)
        self.durable_entries = 0  # summary entries known to be on flash and synced
        # entries up to the last one that flags its block (a moved pinned block): until they are durable,
        # no commit may write those blocks without them (Durability._snapshot)
        self.flagged_entries = 0
        self.pending_bytes = 0  # reserved from data_end for a PUT being received in place
        self.pending_entries = 0  # summary entries reserved for it
        self.io_pins = 0  # commits writing from this image outside the engine lock (see Durability.commit)
        self._io_idle = threading.Condition(threading.Lock())

    # -- commits writing from this image without the engine lock -------------------
    def pin_io(self) -> None:
        with self._io_idle:
            self.io_pins += 1

    def unpin_io(self) -> None:
        with self._io_idle:
            self.io_pins -= 1
            self._io_idle.notify_all()

    def wait_io_idle(self) -> None:
        """Until no commit writes from this image: a seal, a reset or a write under the engine lock
        then never lands before an older copy of the same pages that a commit still has in flight."""
        with self._io_idle:
            self._io_idle.wait_for(lambda: self.io_pins == 0)

    @property
    def capacity_bytes(self) -> int:
        """Room for blocks in an empty region (one summary entry each)."""
        return fmt.data_room_bytes(self.size_bytes)

    def reset(self, region: int, base_seq: int, generation: int) -> bytes:
        """Start a new region; returns its header page (also placed in the image)."""
        self.region, self.base_seq, self.last_seq, self.generation = region, base_seq, base_seq, generation
        self.data_end = fmt.REGION_HEADER_BYTES
        self.entry_count = 0
        self.durable_end = 0
        self.written_end = 0
        self.durable_entries = 0
        self.flagged_entries = 0
        assert not self.pending_bytes and not self.pending_entries, "a region reset under a reservation"
        header = fmt.encode_region_header(fmt.RegionHeader(generation, region, base_seq))
        self.buffer[:fmt.REGION_HEADER_BYTES] = header
        self.buffer[-fmt.TRAILER_BYTES:] = bytes(fmt.TRAILER_BYTES)
        return header

    def room_for(self, block_bytes: int, entries: int = 1) -> bool:
        return (self.data_end + self.pending_bytes + block_bytes
                + fmt.summary_bytes(self.entry_count + self.pending_entries + entries) <= self.size_bytes)

    def append_block(self, block: memoryview, seq: int, k0: int, k1: int, ns: bytes, flags: int) -> int:
        """Copy a verified block in, stamp its seq; returns its offset in the region."""
        offset = self.data_end
        length = block.nbytes
        assert self.room_for(length), (offset, length, self.entry_count)
        copy_bytes(self.buffer[offset:offset + length], block)
        self.place_block(offset, length, seq, k0, k1, ns, flags)
        return offset

    def place_block(self, offset: int, length: int, seq: int, k0: int, k1: int, ns: bytes, flags: int) -> None:
        """The verified block at ``data_end`` (``offset``) becomes data: its seq stamped, its entry added."""
        assert offset == self.data_end, (offset, self.data_end)
        stamp_sequence(self.buffer[offset:offset + HEADER_SIZE], seq)
        self.data_end += length
        self._entry(k0, k1, ns, seq, seq, offset, length, fmt.KIND_BLOCK, flags)

    def append_meta(self, kind: int, k0: int, k1: int, ns: bytes, seq: int, target_seq: int) -> None:
        assert self.room_for(0), self.entry_count
        self._entry(k0, k1, ns, seq, target_seq, 0, 0, kind, 0)

    def _entry(self, k0, k1, ns, seq, target_seq, offset, length, kind, flags) -> None:
        assert seq > self.last_seq or (seq == self.base_seq and self.entry_count == 0), (seq, self.last_seq)
        fmt.pack_entry(self.buffer, fmt.entry_position(self.size_bytes, self.entry_count),
                       k0, k1, ns, seq, target_seq, offset, length, kind, flags)
        self.entry_count += 1
        if flags:
            self.flagged_entries = self.entry_count
        self.last_seq = seq

    def block(self, offset: int, length: int) -> memoryview:
        return self.buffer[offset:offset + length]

    def entries(self) -> np.ndarray:
        """The summary entries so far, in append order (a copy)."""
        start = fmt.entry_position(self.size_bytes, self.entry_count - 1) if self.entry_count else 0
        raw = self.buffer[start:self.size_bytes - fmt.TRAILER_BYTES] if self.entry_count else b""
        return np.frombuffer(raw, dtype=fmt.SUMMARY_DTYPE)[::-1].copy()

    # -- what to write -------------------------------------------------------
    def unsynced_prefix(self) -> tuple[int, int]:
        """Aligned [start, end) of the prefix not yet durable (start == end: nothing)."""
        start = align_down(self.durable_end)
        end = align_up(self.data_end)
        return (start, end) if self.data_end > self.durable_end else (end, end)

    @property
    def summary_start(self) -> int:
        """Where the summary entries (or, with none yet, the trailer) begin: free room ends here."""
        if self.entry_count:
            return fmt.entry_position(self.size_bytes, self.entry_count - 1)
        return self.size_bytes - fmt.TRAILER_BYTES

    def flash_copy(self, start: int, end: int) -> memoryview:
        """A copy of ``[start, end)`` to write to flash, its free room (past ``data_end``, before the
        summary entries) zeroed: a PUT being received there (:mod:`.puts`) never
        reaches flash before its commit, by the page a prefix ends in or the one entries begin in."""
        page = aligned_buffer(end - start)
        page[:] = self.buffer[start:end]
        free_start, free_end = max(start, self.data_end), min(end, self.summary_start)
        if free_end > free_start:
            np.frombuffer(page, np.uint8)[free_start - start:free_end - start] = 0
        return page

    def unsynced_tail(self) -> tuple[int, int]:
        """Aligned [start, end) of the summary entries not yet durable (start == end: nothing).
        Recovery of an open region reads them back (see recovery.scan_open_image): that is how
        pins, tombstones and the pinned flag of reinserted blocks outlive a crash before the seal."""
        if self.entry_count == self.durable_entries:
            return (0, 0)
        start = align_down(fmt.entry_position(self.size_bytes, self.entry_count - 1))
        end = align_up(fmt.entry_position(self.size_bytes, self.durable_entries) + fmt.ENTRY_BYTES)
        return (start, end)

    def seal_ranges(self) -> list[tuple[int, int]]:
        """Write the trailer into the image; returns aligned [start, end) ranges still to write."""
        first = fmt.entry_position(self.size_bytes, self.entry_count - 1) if self.entry_count else (
            self.size_bytes - fmt.TRAILER_BYTES)
        raw = self.buffer[first:self.size_bytes - fmt.TRAILER_BYTES]
        trailer = fmt.make_trailer(raw, self.generation, self.region, self.entry_count, self.base_seq,
                                   self.last_seq, self.data_end)
        self.buffer[-fmt.TRAILER_BYTES:] = fmt.encode_trailer(trailer)
        prefix_start, prefix_end = self.unsynced_prefix()
        tail_start = align_down(first)
        if prefix_end >= tail_start:
            return [(min(prefix_start, tail_start), self.size_bytes)]
        ranges = [(tail_start, self.size_bytes)]
        if prefix_end > prefix_start:
            ranges.insert(0, (prefix_start, prefix_end))
        return ranges

    def take_back(self, data_end: int, entry_count: int, last_seq: int) -> list[tuple[int, int]]:
        """Forget every block past ``data_end`` and every summary entry past the first
        ``entry_count`` -- what a request that failed appended, none of it durable yet -- and zero
        them in the image, so that no later write carries them and no recovery walk finds them.
        ``last_seq``: the image's last seq before them. Returns the aligned [start, end) ranges
        zeroed (a caller may write them to cover what a failed write left on flash)."""
        assert self.durable_end <= data_end <= self.data_end, (self.durable_end, data_end, self.data_end)
        assert self.durable_entries <= entry_count <= self.entry_count, (self.durable_entries, entry_count)
        assert not self.pending_bytes, "taken back under a reservation"
        ranges = []
        if data_end < self.data_end:
            self.buffer[data_end:self.data_end] = bytes(self.data_end - data_end)
            ranges.append((align_down(data_end), align_up(self.data_end)))
        if entry_count < self.entry_count:
            start = fmt.entry_position(self.size_bytes, self.entry_count - 1)
            end = fmt.entry_position(self.size_bytes, entry_count) + fmt.ENTRY_BYTES
            self.buffer[start:end] = bytes(end - start)
            ranges.append((align_down(start), align_up(end)))
        self.data_end, self.entry_count, self.last_seq = data_end, entry_count, last_seq
        self.written_end = min(self.written_end, data_end)  # blocks placed there next are written anew
        self.flagged_entries = min(self.flagged_entries, entry_count)
        return ranges
