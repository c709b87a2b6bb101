"""The allocator: one open region that takes every append, a spare image, and the sealer.

::

    append ──> open image (DRAM) ──full: seal──> sealer thread writes the image ──reaped──> SEALED
                   ^                                                               │
                   └──────────────── the written image is the next spare <─────────┘

At most one seal is in flight. A new region's header write goes to the sealer thread too
(behind the seal in flight, if any), so no device write happens under the engine lock. A
failed seal or header write is retried in the thread that reaps it, and raised if it fails
again. A new region comes from the region manager's clean-region pool
(:attr:`Allocator.take_clean`), which a background worker keeps filled; a writer waits there
only when the pool is empty. Callers hold the engine lock, except for
:meth:`Allocator.await_seal_for`.

``writes_issued`` counts seals and region headers handed to the sealer; ``writes_synced`` is
the count the devices were last synced after (see :mod:`.durability`). An image that a
durability write is reading from outside the lock is pinned (``OpenRegion.io_pins``) and is
not reset until that write is done.

A PUT received in place holds a reservation of the open image (:attr:`Allocator.reservation`,
at most one, see :mod:`.puts`); until it is committed or aborted the open image
takes no other append and is not sealed: every other writer first waits for it
(:meth:`Allocator.wait_unreserved`, which lets go of the lock while it waits).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Callable

from kvtier.common.aligned import ALIGNMENT_BYTES, align_down, aligned_buffer

from . import regionfmt as fmt
from .blockmap import BlockMap
from .durability import write_and_sync
from .errors import DeviceError, WaitTimeoutError
from .index import SEQ_DELTA_MAX
from .openregion import OpenRegion
from .raid0 import StripedArray
from .recovery import seq_span_max
from .seqs import SeqCounter
from .statistics import EngineCounters

log = logging.getLogger("kvtier.daemon.engine")

DEVICE_WAIT_S_MAX = 60.0  # a seal or region header write that takes longer is a device that does not answer
RESERVATION_WAIT_S_MAX = 120.0  # a PUT received in place holds the open image at most this long for others


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
        self._covers: list[Future] = []  # zeroed pages of requests taken back, queued (take_back)
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-seal")
        self.active = False  # whether self.open holds a region
        self.writes_issued = 0  # seals and region headers handed to the sealer thread so far
        self.writes_synced = 0  # of those, how many the devices were last synced after
        # the region manager's clean-region pool, wired by the engine: take_clean(satisfied) returns a
        # clean region, waiting (the lock let go) while the pool is down to its reserve, or raises NoSpaceError
        self.take_clean: Callable[..., int | None] | None = None
        # a region the reclaim worker opened to compact into: it takes records and the worker's moved
        # blocks, no writer's blocks, until the worker has reclaimed a region back into the pool (RegionManager)
        self.held_region: int | None = None
        self.give_back_clean: Callable[[int], None] | None = None
        self.reservation = None  # the PUT being received into the open image (puts.Reservation)
        self._unreserved = threading.Condition(lock)  # notified when the reservation is committed or aborted
        self._rolling: dict[tuple[int, int], int] = {}  # (region, base_seq) -> writers waiting to roll over from it

    def wait_unreserved(self, timeout_s: float | None = None) -> bool:
        """Return (holding the engine lock, which the caller holds) once no reservation is in flight:
        True; with ``timeout_s``, False if one still is then. Without it, WaitTimeoutError naming
        the reservation after RESERVATION_WAIT_S_MAX. The lock is let go while waiting, so a writer
        calls this before it decides anything."""
        if self._unreserved.wait_for(lambda: self.reservation is None,
                                     RESERVATION_WAIT_S_MAX if timeout_s is None else timeout_s):
            return True
        if timeout_s is not None:
            return False
        held = self.reservation
        raise WaitTimeoutError(f"waited {RESERVATION_WAIT_S_MAX:g} s for the PUT being received in place "
                               f"({sum(held.lengths)} bytes into region {held.region}) to be committed or aborted")

    def reservation_resolved(self) -> None:
        """The reservation was committed or aborted (called under the lock)."""
        self.reservation = None
        self._unreserved.notify_all()

    @property
    def capacity_bytes(self) -> int:
        """Room for blocks in an empty region."""
        return self.open.capacity_bytes

    @property
    def unsynced_writes(self) -> int:
        """Seals and region headers issued since the devices were last synced."""
        return self.writes_issued - self.writes_synced

    def mark_synced(self, issued: int) -> None:
        """The devices were synced after the first ``issued`` seals and headers had completed."""
        self.writes_synced = max(self.writes_synced, issued)

    def ensure_room(self, block_bytes: int, entries: int = 1) -> None:
        """Make the open region one with room for a block of ``block_bytes`` and ``entries`` summary
        entries, sealing it and opening a clean region if needed. Waiting for a clean region (or for
        a reservation in flight) lets go of the lock: callers decide again on return. Metadata
        records (``block_bytes`` 0) go where blocks go, but into a held region too
        (:attr:`held_region`); neither takes the region the pool keeps for reclaim's compaction."""
        while not (self.reservation is None and self.appendable(block_bytes, entries)):
            if self.reservation is not None:
                self.wait_unreserved()
                continue
            assert self.take_clean is not None, "no region manager wired to the allocator"
            # while this waits for a clean region (the lock let go), nobody appends to the open image;
            # a commit may still sync it, so a caller with appends to take back seals them first. A
            # held region stays open to records and moved blocks: this writer has no appends there
            rolling = None if self._held_from(block_bytes) else self._roll_from()
            try:
                region = self.take_clean(lambda: self.appendable(block_bytes, entries))
            finally:
                if rolling is not None:
                    self._rolling[rolling] -= 1
                    if not self._rolling[rolling]:
                        del self._rolling[rolling]
            if region is None:
                continue  # room was made meanwhile
            if self.reservation is not None or self.appendable(block_bytes, entries):
                self.give_back_clean(region)
                continue
            self.open_region(region)
        assert self.open.room_for(block_bytes, entries), (block_bytes, self.open.data_end)

    def appendable(self, block_bytes: int, entries: int = 1, compacting: bool = False) -> bool:
        """Whether the open region takes an append of this size now: it has room, no writer is
        waiting to roll over from it (see :meth:`ensure_room`), and it is not held for the reclaim
        worker's moved blocks (``compacting``: the worker asks) while these are a writer's blocks."""
        if not compacting and self._held_from(block_bytes):
            return False
        return self.active and (self.open.region, self.open.base_seq) not in self._rolling and \
            self.open.room_for(block_bytes, entries)

    def _held_from(self, block_bytes: int) -> bool:
        """Whether a writer's block of this size is kept out of the open region: it is held for the
        reclaim worker (:attr:`held_region`; records are not kept out)."""
        return bool(block_bytes) and self.active and self.open.region == self.held_region

    def _roll_from(self) -> tuple[int, int]:
        key = (self.open.region, self.open.base_seq) if self.active else (-1, -1)
        self._rolling[key] = self._rolling.get(key, 0) + 1
        return key

    def open_region(self, region: int) -> None:
        """Seal the open region (if any) and open ``region``, a clean one (given back to the pool if
        another writer opened one while this waited for the image to be free)."""
        if self.active:
            self.seal(wait=False)
        if not self.start_region(region):
            self.give_back_clean(region)

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
        entries_first = []
        if image.flagged_entries > image.durable_entries:
            # entries that flag blocks in the prefix (moved pinned blocks) land before the prefix, and
            # without the trailer (copied before seal_ranges writes it): a seal cut short then leaves
            # an open region whose walk finds the flags
            start, end = image.unsynced_tail()
            copy = aligned_buffer(end - start)
            copy[:] = image.buffer[start:end]
            entries_first = [(base + start, copy)]
        writes = [(base + start, image.buffer[start:end]) for start, end in image.seal_ranges()]
        self.sealing = (image, writes, self._sealer.submit(self._seal_write, image, writes, entries_first))
        self._table.seal_started(image.region)
        self.writes_issued += 1
        self.open, self._spare = self._spare, None
        self.active = False
        if wait:
            self.reap_seal(wait=True)

    def _seal_write(self, image: OpenRegion, writes: list, entries_first: list) -> set[int]:
        """On the sealer thread: after any commit still writing older copies of these pages (and
        ``entries_first`` before the rest), without the prefix those commits wrote; the trailer's
        page last, once every other write of the seal is done, so that a process killed mid-seal
        leaves a region whose trailer says sealed only with its blocks all written."""
        image.wait_io_idle()
        touched = self._array.write_ranges(entries_first) if entries_first else set()
        base = image.region * self._region_size
        body = _after(writes, base + align_down(image.written_end))
        last_page = base + self._region_size - ALIGNMENT_BYTES
        touched |= self._array.write_ranges(_before(body, last_page))
        return touched | self._array.write_ranges(_after(body, last_page))

    def reap_seal(self, wait: bool) -> None:
        """Finish the in-flight seal (waiting for it if ``wait``): the region becomes SEALED. So is
        the header write of the region opened since (queued behind the seal). A failed write is
        written again by the sealer thread, never under the lock: a caller that must wait waits for
        that retry and raises DeviceError if it fails too (still owed: the next one retries)."""
        image, writes, fut = self.sealing or (None, None, None)
        if image is not None:
            done, fut = self._reaped(fut, writes, wait, f"the seal of region {image.region}")
            if not done:
                self.sealing = (image, writes, fut)
                return
            self._table.seal(image.region, image.last_seq, image.data_end)
            self.sealing = None
            self._spare = image
        if self._header_write is not None:
            ranges, fut = self._header_write
            done, fut = self._reaped(fut, ranges, wait, "a region header")
            self._header_write = None if done else (ranges, fut)

    def _reaped(self, fut: Future | None, ranges: list, wait: bool, what: str) -> tuple[bool, Future | None]:
        """(True, _) once ``fut`` (or its retry) has written ``ranges``; else (False, the write still
        in flight, or None: it failed and is owed). Raises its DeviceError if ``wait``."""
        retried = False
        while True:
            if fut is None:
                if not wait:
                    return False, None  # retried by the next caller that must wait (seal, flush, durable put, close)
                fut, retried = self._sealer.submit(write_and_sync, self._array, ranges, self._counters), True
            if not wait and not fut.done():
                return False, fut
            error = wait_bounded(fut, what)
            if error is None:
                return True, fut
            if retried:
                raise error
            self._counters.device_errors += 1  # (write_and_sync counts its own, the retry's)
            fut = None
            if not wait:
                return False, None

    def write_failed(self) -> bool:
        """Whether a seal or header write failed and is still owed."""
        return (self.sealing is not None and self.sealing[2] is None) or \
            (self._header_write is not None and self._header_write[1] is None)

    def image_of(self, region: int) -> OpenRegion | None:
        """The DRAM image holding ``region`` (open, or still being sealed), if any."""
        if self.active and region == self.open.region:
            return self.open
        if self.sealing is not None and region == self.sealing[0].region:
            return self.sealing[0]
        return None

    def image_durable_ends(self) -> list[int]:
        """For each of :meth:`image_regions`: the bytes of its image already written in place and
        synced (a block that ends there can be read from flash)."""
        ends = [self.open.durable_end] if self.active else []
        if self.sealing is not None:
            ends.append(self.sealing[0].durable_end)
        return ends

    def image_regions(self) -> list[int]:
        """The regions held in a DRAM image: the open one, the one being sealed."""
        regions = [self.open.region] if self.active else []
        if self.sealing is not None:
            regions.append(self.sealing[0].region)
        return regions

    def start_region(self, region: int) -> bool:
        """Open ``region``; False if another writer opened one meanwhile (the lock was let go)."""
        assert not self.active
        if self._header_write is not None:
            self.reap_seal(wait=True)
        # a durability write may still read this image (it was the open one two regions ago): rare
        self.open.wait_io_idle()
        if self.active:
            return False
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
        # The header write goes to the sealer thread, behind the seal in flight if any (the seal
        # goes to flash first, as it was issued first); reap_seal finishes both.
        ranges = [(region * self._region_size, self.open.buffer[:fmt.REGION_HEADER_BYTES])]
        self._header_write = (ranges, self._sealer.submit(self._array.write_ranges, ranges))
        self.writes_issued += 1
        self.open.durable_end = fmt.REGION_HEADER_BYTES
        assert bytes(self.open.buffer[:len(header)]) == header
        return True

    def invalidate_region(self, region: int, base_seq: int) -> None:
        """Queue a fresh header page for a region a reclaim freed (behind the seal in flight, not
        synced here): once it lands, a restart finds the region free instead of serving again what
        was evicted from it. Either state on flash is safe (see RegionManager)."""
        page = aligned_buffer(fmt.REGION_HEADER_BYTES)
        page[:] = fmt.encode_region_header(fmt.RegionHeader(self.generation, region, base_seq))
        self._sealer.submit(self._array.write_ranges, [(region * self._region_size, page)]).add_done_callback(
            lambda fut: fut.exception() and log.warning("event=region_invalidate_failed region=%d reason=%r",
                                                        region, str(fut.exception())))

    def append_moved(self, view: memoryview, header, pinned: bool) -> tuple[int, int]:
        """Append a copy of a verified block being moved by a reclaim (the open region has room);
        returns (logical address, seq). The index is the caller's to update."""
        assert self.active and self.reservation is None
        k0, k1 = fmt.key_to_halves(header.key)
        seq = self._seqs.take()
        region = self.open.region
        offset = self.open.append_block(view, seq, k0, k1, header.ns_id, fmt.FLAG_PINNED if pinned else 0)
        self._table.last_seq[region] = seq
        self._table.add_block(region, view.nbytes, pinned)
        assert seq - self.open.base_seq <= SEQ_DELTA_MAX, seq - self.open.base_seq
        return region * self._region_size + offset, seq

    def queue_cover(self, ranges: list) -> None:
        """Write (offset, buffer) ranges -- zeroed pages a request taken back had written -- on the
        sealer thread, best effort (a failure is counted; the request's own error is what its caller
        got). They are pending writes: a commit waits for them before it writes the same pages."""
        self._covers = [fut for fut in self._covers if not fut.done()]
        self._covers.append(self._sealer.submit(_best_effort, write_and_sync, self._array, ranges, self._counters))

    def wait_covers(self) -> None:
        """Wait (bounded, without the lock) for the cover writes queued so far."""
        for fut in list(self._covers):
            wait_futures([fut], DEVICE_WAIT_S_MAX)

    def pending_writes(self) -> list[Future]:
        """The seal, header and cover writes in flight (a durability promise waits for them, without the lock)."""
        futures = [self.sealing[2]] if self.sealing is not None and self.sealing[2] is not None else []
        return futures + ([self._header_write[1]] if self._header_write is not None and
                          self._header_write[1] is not None else []) + [f for f in self._covers if not f.done()]

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


def _best_effort(write, *args) -> None:
    try:
        write(*args)
    except DeviceError:
        pass  # counted by the write


def wait_bounded(fut: Future, what: str) -> DeviceError | None:
    """Wait for a device write on the sealer thread at most DEVICE_WAIT_S_MAX; its DeviceError, or
    one naming ``what`` if it did not complete, or None."""
    done, _ = wait_futures([fut], DEVICE_WAIT_S_MAX)
    if not done:
        return DeviceError(f"{what} was not written within {DEVICE_WAIT_S_MAX:g} s (the device does not answer)")
    error = fut.exception()
    if error is not None and not isinstance(error, DeviceError):
        raise error  # a bug in the write path
    return error


def _before(writes: list, end: int) -> list:
    """``(offset, view)`` writes without their bytes from ``end`` on."""
    out = []
    for offset, view in writes:
        keep = min(max(0, end - offset), view.nbytes)
        if keep:
            out.append((offset, view[:keep]))
    return out


def _after(writes: list, start: int) -> list:
    """``(offset, view)`` writes without their bytes before ``start`` (page aligned)."""
    out = []
    for offset, view in writes:
        skip = min(max(0, start - offset), view.nbytes)
        if skip < view.nbytes:
            out.append((offset + skip, view[skip:]))
    return out
