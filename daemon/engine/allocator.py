"""The allocator: one open region that takes every append, a spare image, and the sealer.

::

    append ──> open image (DRAM) ──full: seal──> sealer thread writes the image ──reaped──> SEALED
                   ^                                                               │
                   └──────────────── the written image is the next spare <─────────┘

At most one seal is in flight. A region opened while it is in flight has its header write
queued behind it on the sealer thread. A failed seal or header write is retried in the
thread that reaps it, and raised if it fails again. When no region is free, the region
manager reclaims one (:attr:`Allocator.reclaim`). Callers hold the engine lock, except
for :meth:`Allocator.await_seal_for`.

A PUT received in place holds a reservation of the open image (:attr:`Allocator.reservation`,
at most one, see :mod:`.put_reservations`); until it is committed or aborted the open image
takes no other append and is not sealed: every other writer first waits for it
(:meth:`Allocator.wait_unreserved`, which lets go of the lock while it waits).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Callable

from kvtier.common.aligned import aligned_buffer

from . import regionfmt as fmt
from .blockmap import BlockMap
from .durability import write_and_sync
from .errors import DeviceError
from .index import PINNED_BIT, SEQ_DELTA_MAX
from .openregion import OpenRegion
from .raid0 import StripedArray
from .recovery import seq_span_max
from .seqs import SeqCounter
from .statistics import EngineCounters


class Allocator:
    def __init__(self, array: StripedArray, blocks: BlockMap, seqs: SeqCounter, counters: EngineCounters,
                 lock: threading.RLock, region_size_bytes: int, generation: int):
        self._array = array
        self._index, self._table = blocks.index, blocks.table
        self._seqs = seqs
        self._counters = counters
        self._lock = lock
        self._region_size = region_size_bytes
        self.generation = generation  # written into every region header
        self.open = OpenRegion(aligned_buffer(region_size_bytes, populate=True, huge=True))
        # a full region is written by the sealer thread from its image while appends fill the spare
        self._spare: OpenRegion | None = OpenRegion(aligned_buffer(region_size_bytes, populate=True, huge=True))
        self.sealing: tuple[OpenRegion, list, Future | None] | None = None
        self._header_write: tuple[list, Future] | None = None  # a region header queued behind the seal
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-seal")
        self.active = False  # whether self.open holds a region
        self.unsynced_writes = 0  # seals and region headers written since the devices were last synced
        # the region manager's reclaim, wired by the engine: called when no region is free
        self.reclaim: Callable[[], None] | None = None
        self.reservation = None  # the PUT being received into the open image (put_reservations.Reservation)
        self._unreserved = threading.Condition(lock)  # notified when the reservation is committed or aborted

    def wait_unreserved(self, timeout_s: float | None = None) -> bool:
        """Return (holding the engine lock, which the caller holds) once no reservation is in flight,
        True; False if one still is after ``timeout_s``. The lock is let go while waiting, so a
        writer calls this before it decides anything."""
        return self._unreserved.wait_for(lambda: self.reservation is None, timeout_s)

    def reservation_resolved(self) -> None:
        """The reservation was committed or aborted (called under the lock)."""
        self.reservation = None
        self._unreserved.notify_all()

    @property
    def capacity_bytes(self) -> int:
        """Room for blocks in an empty region."""
        return self.open.capacity_bytes

    def ensure_room(self, block_bytes: int, entries: int = 1) -> None:
        if self.active and self.open.room_for(block_bytes, entries):
            return
        self.next_region()
        if not self.open.room_for(block_bytes, entries):
            self.next_region()  # blocks moved out of a reclaimed region took the room: one more region
        assert self.open.room_for(block_bytes, entries), (block_bytes, self.open.data_end)

    def seal(self, wait: bool) -> None:
        """Seal the open region: its image goes to the sealer thread (one seal in flight at most)
        and the spare image becomes the open one. The seal writes but does not fdatasync (see
        :mod:`.durability`)."""
        assert self.active
        assert self.reservation is None, "sealed a region whose reservation is still being filled"
        self.reap_seal(wait=True)
        image = self.open
        # recovery drops (silently) a sealed region's entries past its span: never write one
        assert image.last_seq - image.base_seq <= seq_span_max(self._region_size), \
            f"region {image.region}: seq span {image.last_seq - image.base_seq} exceeds its entry slots"
        base = image.region * self._region_size
        writes = [(base + start, image.buffer[start:end]) for start, end in image.seal_ranges()]
        self.sealing = (image, writes, self._sealer.submit(self._array.write_ranges, writes))
        self._table.seal_started(image.region)
        self.unsynced_writes += 1
        self.open, self._spare = self._spare, None
        self.active = False
        if wait:
            self.reap_seal(wait=True)

    def reap_seal(self, wait: bool) -> None:
        """Finish the in-flight seal (waiting for it if ``wait``): the region becomes SEALED.
        A failed seal write is retried here, in the caller's thread, and raises if it fails again.
        So is the header write of the region opened since (queued behind the seal)."""
        self._reap_seal_write(wait)
        if self.sealing is None and self._header_write is not None:
            ranges, fut = self._header_write
            if not wait and not fut.done():
                return
            self._header_write = None
            try:
                fut.result()
            except DeviceError:
                self._counters.device_errors += 1
                write_and_sync(self._array, ranges, self._counters)

    def _reap_seal_write(self, wait: bool) -> None:
        if self.sealing is None:
            return
        image, writes, fut = self.sealing
        if fut is not None:
            if not wait and not fut.done():
                return
            try:
                fut.result()
            except DeviceError:
                self._counters.device_errors += 1
                self.sealing = (image, writes, None)
                fut = None
        if fut is None:
            if not wait:
                return  # retried by the next caller that must wait (seal, flush, durable put, close)
            write_and_sync(self._array, writes, self._counters)
        self._table.seal(image.region, image.last_seq, image.data_end)
        self.sealing = None
        self._spare = image

    def image_of(self, region: int) -> OpenRegion | None:
        """The DRAM image holding ``region`` (open, or still being sealed), if any."""
        if self.active and region == self.open.region:
            return self.open
        if self.sealing is not None and region == self.sealing[0].region:
            return self.sealing[0]
        return None

    def image_regions(self) -> list[int]:
        """The regions held in a DRAM image: the open one, the one being sealed."""
        regions = [self.open.region] if self.active else []
        if self.sealing is not None:
            regions.append(self.sealing[0].region)
        return regions

    def next_region(self) -> None:
        """Seal the open region (if any) and open a free one, or have the region manager reclaim one."""
        region = self._table.take_free()
        if region is None:
            assert self.reclaim is not None, "no region manager wired to the allocator"
            self.reclaim()
            return
        if self.active:
            self.seal(wait=False)
        self.start_region(region)

    def start_region(self, region: int) -> None:
        assert not self.active
        if self._header_write is not None:  # the image may be the one whose header is queued (staging)
            self.reap_seal(wait=True)
        base_seq = self._seqs.take()
        header = self.open.reset(region, base_seq, self.generation)
        self._table.open(region, base_seq, time.time())
        self.active = True
        # invalidate what the region held before by its new header page alone. The old trailer then
        # no longer matches (its base_seq is the old header's; base_seqs are never reused), so the
        # region is scanned as open from the new base_seq, and every old block and summary entry
        # is older than that: the walk and the entry scan stop at once. The old trailer is not
        # zeroed: written in parallel with the header, a crash could land the zeroed page alone --
        # the old header with a dead trailer, scanned as open from the OLD base_seq, which brings
        # back the old blocks whose tombstones were in that summary.
        # Not synced here (buffered puts never fdatasync), so until the next sync the old header
        # may still be the one on flash while this use's later writes land. Each is safe:
        # * a block prefix: the old region's entries there fail verification (misses);
        # * summary entries made durable before the seal: Durability.make_durable syncs every
        #   pending write (this header) before it writes them;
        # * the seal's summary and trailer: recovery takes a valid trailer newer than the header
        #   as the region's (recovery._classify).
        # Nothing that must outlive the old region is still only there (see RegionManager.reclaim).
        # While a seal is in flight the header write queues behind it on the sealer thread (the
        # seal goes to flash first, as it was issued first); reap_seal finishes both.
        ranges = [(region * self._region_size, self.open.buffer[:fmt.REGION_HEADER_BYTES])]
        if self.sealing is not None:
            self._header_write = (ranges, self._sealer.submit(self._array.write_ranges, ranges))
        else:
            self._array.write_ranges(ranges)
        self.unsynced_writes += 1
        self.open.durable_end = fmt.REGION_HEADER_BYTES
        assert bytes(self.open.buffer[:len(header)]) == header

    def append(self, view: memoryview, header, pinned: bool) -> int:
        """Append one verified block (opening a region if needed) and index it; returns its seq."""
        self.ensure_room(view.nbytes)
        k0, k1 = fmt.key_to_halves(header.key)
        seq = self._seqs.take()
        region = self.open.region
        offset = self.open.append_block(view, seq, k0, k1, header.ns_id, fmt.FLAG_PINNED if pinned else 0)
        self._table.last_seq[region] = seq
        self._table.add_block(region, view.nbytes, pinned)
        delta = seq - self.open.base_seq
        assert delta <= SEQ_DELTA_MAX, delta
        self._index.insert(k0, k1, region * self._region_size + offset, view.nbytes,
                           delta | (PINNED_BIT if pinned else 0))
        return seq

    def await_seal_for(self, nbytes: int, entries: int) -> None:
        """A batch that will not fit the open region needs the spare image, which is free only
        once the seal in flight is written: wait for that write here, without the lock, so GETs,
        LOOKUPs and puts that fit go on meanwhile (under the lock, the seal is then reaped at
        once). Only waits; every decision is taken again under the lock."""
        with self._lock:
            if self.active and self.open.room_for(nbytes, entries):
                return
            sealing = self.sealing
        if sealing is not None and sealing[2] is not None:
            wait_futures([sealing[2]])

    def close(self) -> None:
        """Stop the sealer thread (after the seal in flight, if any, is written)."""
        self._sealer.shutdown(wait=True)
