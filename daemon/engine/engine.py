"""The engine facade: a log-structured, content-addressed block cache on a
striped array of devices (after CacheLib Navy's block cache).

::

    put ──verify──> open region image (DRAM) ──seal: one striped write + fdatasync──> sealed region
                       │ durable put: write the filled prefix + fdatasync
    get ──index──> open image (copy)  |  flash read outside the lock ──verify key, seq, CRCs──> bytes
    get_into ──index──> flash read straight into the caller's aligned buffer ──verify──> size
    full? ──> seal, take a free region, or reclaim the policy's victim (pinned blocks, and hot
              ones the reinsertion policy picks, are moved to the new region)

Batch calls resolve their keys in one vectorized pass over the index (NumPy);
``lookup_buffer`` / ``locate_buffer`` take the keys as one N x 16-byte buffer.

One lock guards the index, the region table and the open image; flash reads
of sealed regions run outside it (a read racing a reclaim fails its key/seq
check and is retried once, then counted as a miss). A full region is written
by a sealer thread from its image while puts fill a second image (at most one
seal in flight; a failed seal write is retried, then raised).

Durability: ``put(durable=True)`` returns after the block's bytes are on flash
and synced. Deletes, pins and unpins are durable when they return (their
summary records are written and synced). A buffered put is durable at the
next seal (region full, ``flush``, ``close``).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Iterable, Sequence

import numpy as np

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, decode_header, verify_block
from kvtier.common.stripe import StripeGeometry

from . import regionfmt as fmt
from .config import LOCATION_DTYPE, BlockLocation, EngineConfig, EngineStatistics
from .buffers import copy_bytes
from .devices import Device
from kvtier.common.aligned import aligned_buffer, align_down, align_up
from .errors import BlockTooLargeError, DeviceError, EngineError, GeometryError, NoSpaceError
from .index import PINNED_BIT, SEQ_DELTA_MAX, BlockIndex
from .openregion import OpenRegion
from .raid0 import StripedArray
from .reader import BlockReader, ReadFailure
from .recovery import (LiveSet, RegionScan, read_region_entries, scan_regions, select_live, seq_span_max,
                       write_summary)
from .regions import RegionState, RegionTable
from .reinsertion import HOT_REINSERT_FRACTION_MAX, make_reinsertion
from .store import StoreLayout, format_store, open_devices, read_superblocks, validate_store, write_generation

SEQ_RESTART_GAP = 1 << 20  # seqs skipped at restart, so no seq of an unacknowledged, torn write is ever reused
READ_RETRIES = 1  # a flash read that fails verification is retried once (it may have raced a reclaim)
ZERO_NS = bytes(16)


class Engine:
    """See the module doc; construct with :meth:`open`."""

    # -- construction ------------------------------------------------------
    @staticmethod
    def format(cfg: EngineConfig, force: bool = False, devices: Sequence[Device] | None = None) -> None:
        """Write fresh superblocks (erases the store). A device that already
        holds a kvtier store needs ``force=True``."""
        owned = devices is None
        devs = open_devices(cfg, create=True) if owned else list(devices)
        try:
            format_store(cfg, devs, force)
        finally:
            if owned:
                for device in devs:
                    device.close()

    @classmethod
    def open(cls, cfg: EngineConfig, create_if_missing: bool = False,
             devices: Sequence[Device] | None = None) -> "Engine":
        """Validate the superblocks, recover the index. ``create_if_missing``
        formats only when no device holds a store yet. ``devices`` replaces the
        files of ``cfg.device_paths`` (memory or fault-injecting devices in tests)."""
        devs = open_devices(cfg, create=create_if_missing) if devices is None else list(devices)
        if devices is not None and len(devs) != len(cfg.device_paths):
            raise GeometryError(f"{len(devs)} devices given for {len(cfg.device_paths)} configured paths")
        try:
            if create_if_missing and not any(not isinstance(sb, Exception) for sb in read_superblocks(devs)):
                format_store(cfg, devs, force=False)
            layout = validate_store(cfg, devs)
            return cls(cfg, devs, layout)
        except BaseException:
            for device in devs:
                device.close()
            raise

    def __init__(self, cfg: EngineConfig, devices: Sequence[Device], layout: StoreLayout):
        self.config = cfg
        self._devices = list(devices)
        self._layout = layout
        self._generation = layout.generation
        self._seq_floor = layout.seq_floor  # seqs <= this are of an erased generation (superblock)
        self._region_size = cfg.region_size_bytes
        self._pool = ThreadPoolExecutor(max_workers=len(devices) * cfg.io_threads_per_device,
                                        thread_name_prefix="kvtier-io")
        self._array = StripedArray(self._devices, layout.geometry, self._pool)
        self._reader = BlockReader(self._array, self._pool)
        self._lock = threading.RLock()
        self._index = BlockIndex(track_hits=cfg.reinsertion_hits_min > 0)
        self._open = OpenRegion(aligned_buffer(self._region_size, populate=True, huge=True))
        # a full region is written by the sealer thread from its image while puts fill the spare
        self._spare: OpenRegion | None = OpenRegion(aligned_buffer(self._region_size, populate=True, huge=True))
        self._sealing: tuple[OpenRegion, list, Future | None] | None = None
        self._header_write: tuple[list, Future] | None = None  # a region header queued behind the seal
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-seal")
        self._table = RegionTable(layout.region_count, self._open.capacity_bytes, cfg.eviction)
        self._reinsertion = make_reinsertion(cfg.reinsertion_hits_min)
        self._active = False  # whether self._open holds a region
        self._unsynced_writes = 0  # seals and region headers written since the devices were last synced
        self._next_seq = 1
        self._closed = False
        self._stats = dict.fromkeys(("hits", "misses", "puts", "put_bytes", "get_bytes", "evicted_blocks",
                                     "evicted_regions", "reinsertions", "device_errors", "alloc_failures",
                                     "corrupt_reads", "recovered_blocks"), 0)
        self._recovery_seconds = 0.0
        try:
            self._recover()
        except BaseException:
            self._sealer.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            raise

    @property
    def geometry(self) -> StripeGeometry:
        return self._layout.geometry

    @property
    def region_size_bytes(self) -> int:
        return self._region_size

    @property
    def block_size_max_bytes(self) -> int:
        """The largest block a region can take (its room less one summary entry)."""
        return self._open.capacity_bytes - fmt.ENTRY_BYTES

    # -- recovery ----------------------------------------------------------
    def _recover(self) -> None:
        t0 = time.monotonic()
        scans = scan_regions(self._array, self._table.region_count, self._region_size, self._generation,
                             self._seq_floor)
        live = select_live(scans)
        now = time.time()
        for scan in sorted((s for s in scans if s.kind != "free"), key=lambda s: s.base_seq):
            if scan.kind == "open":
                self._seal_recovered(scan)
            self._table.restore_sealed(scan.region, scan.base_seq, scan.last_seq, scan.data_end, now)
        self._load_live(live)
        # above every seq that may still be on flash -- this generation's, an erased one's (the
        # floor), and any region header's span, of any generation: a reused region's new blocks
        # then always outrank, and its recovery walk stops at, whatever the region held before
        on_flash_max = max([self._seq_floor, live.max_seq] + [scan.seq_bound for scan in scans])
        self._next_seq = on_flash_max + SEQ_RESTART_GAP
        self._stats["recovered_blocks"] = len(live.k0)
        self._recovery_seconds = time.monotonic() - t0

    def _seal_recovered(self, scan: RegionScan) -> None:
        """A region that was open at the crash: write the summary it never got."""
        write_summary(self._array, scan.image, scan.region, self._generation, scan.entries, scan.base_seq,
                      scan.data_end)
        scan.image = None

    def _load_live(self, live: LiveSet) -> None:
        base = self._table.base_seq[live.region]
        delta = live.seq - base
        assert np.all(delta <= SEQ_DELTA_MAX), "a region's seq span exceeds the index's delta field"
        meta = delta.astype(np.uint32) | np.where(live.pinned, np.uint32(PINNED_BIT), np.uint32(0))
        addr = live.region.astype(np.uint64) * np.uint64(self._region_size) + live.offset.astype(np.uint64)
        self._index = BlockIndex(capacity=int(len(live.k0) / 0.75) + 1, track_hits=self._index.track_hits)
        self._index.insert_many(live.k0, live.k1, addr, live.length.astype(np.uint32), meta)
        np.add.at(self._table.live_blocks, live.region, 1)
        np.add.at(self._table.live_bytes, live.region, live.length)
        np.add.at(self._table.pinned_bytes, live.region, np.where(live.pinned, live.length, 0))
        for region, records in live.meta_records.items():
            self._table.meta_records[region] = list(records)

    # -- region lifecycle (callers hold the lock) ---------------------------
    def _ensure_room(self, block_bytes: int, entries: int = 1) -> None:
        if self._active and self._open.room_for(block_bytes, entries):
            return
        self._next_region()
        if not self._open.room_for(block_bytes, entries):
            self._next_region()  # blocks moved out of a reclaimed region took the room: one more region
        assert self._open.room_for(block_bytes, entries), (block_bytes, self._open.data_end)

    def _seal(self, wait: bool) -> None:
        """Seal the open region: its image goes to the sealer thread (one seal in flight at most)
        and the spare image becomes the open one. The seal writes but does not fdatasync: a
        buffered block is a cache entry, and a sealed region whose bytes did not all reach flash
        only yields misses (every read verifies). Whoever promises durability -- flush, close, a
        durable put, a delete or pin -- syncs (``_make_durable``)."""
        assert self._active
        self._reap_seal(wait=True)
        image = self._open
        # recovery drops (silently) a sealed region's entries past its span: never write one
        assert image.last_seq - image.base_seq <= seq_span_max(self._region_size), \
            f"region {image.region}: seq span {image.last_seq - image.base_seq} exceeds its entry slots"
        base = image.region * self._region_size
        writes = [(base + start, image.buffer[start:end]) for start, end in image.seal_ranges()]
        self._sealing = (image, writes, self._sealer.submit(self._array.write_ranges, writes))
        self._table.seal_started(image.region)
        self._unsynced_writes += 1
        self._open, self._spare = self._spare, None
        self._active = False
        if wait:
            self._reap_seal(wait=True)

    def _reap_seal(self, wait: bool) -> None:
        """Finish the in-flight seal (waiting for it if ``wait``): the region becomes SEALED.
        A failed seal write is retried here, in the caller's thread, and raises if it fails again.
        So is the header write of the region opened since (queued behind the seal)."""
        self._reap_seal_write(wait)
        if self._sealing is None and self._header_write is not None:
            ranges, fut = self._header_write
            if not wait and not fut.done():
                return
            self._header_write = None
            try:
                fut.result()
            except DeviceError:
                self._stats["device_errors"] += 1
                self._write_and_sync(ranges)

    def _reap_seal_write(self, wait: bool) -> None:
        if self._sealing is None:
            return
        image, writes, fut = self._sealing
        if fut is not None:
            if not wait and not fut.done():
                return
            try:
                fut.result()
            except DeviceError:
                self._stats["device_errors"] += 1
                self._sealing = (image, writes, None)
                fut = None
        if fut is None:
            if not wait:
                return  # retried by the next caller that must wait (seal, flush, durable put, close)
            self._write_and_sync(writes)
        self._table.seal(image.region, image.last_seq, image.data_end)
        self._sealing = None
        self._spare = image

    def _image_of(self, region: int) -> OpenRegion | None:
        """The DRAM image holding ``region`` (open, or still being sealed), if any."""
        if self._active and region == self._open.region:
            return self._open
        if self._sealing is not None and region == self._sealing[0].region:
            return self._sealing[0]
        return None

    def _write_and_sync(self, ranges) -> None:
        try:
            touched = self._array.write_ranges(ranges)
            self._array.sync(touched)
        except DeviceError:
            self._stats["device_errors"] += 1
            raise

    def _next_region(self) -> None:
        """Seal the open region (if any) and open a free one, or reclaim one (:meth:`_reclaim`)."""
        region = self._table.take_free()
        if region is None:
            self._reclaim()
            return
        if self._active:
            self._seal(wait=False)
        self._start_region(region)

    def _start_region(self, region: int) -> None:
        assert not self._active
        if self._header_write is not None:  # the image may be the one whose header is queued (staging)
            self._reap_seal(wait=True)
        base_seq = self._take_seq()
        header = self._open.reset(region, base_seq, self._generation)
        self._table.open(region, base_seq, time.time())
        self._active = True
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
        # * summary entries made durable before the seal: _make_durable syncs every pending write
        #   (this header) before it writes them;
        # * the seal's summary and trailer: recovery takes a valid trailer newer than the header
        #   as the region's (recovery._classify).
        # Nothing that must outlive the old region is still only there (see _reclaim).
        # While a seal is in flight the header write queues behind it on the sealer thread (the
        # seal goes to flash first, as it was issued first); _reap_seal finishes both.
        ranges = [(region * self._region_size, self._open.buffer[:fmt.REGION_HEADER_BYTES])]
        if self._sealing is not None:
            self._header_write = (ranges, self._sealer.submit(self._array.write_ranges, ranges))
        else:
            self._array.write_ranges(ranges)
        self._unsynced_writes += 1
        self._open.durable_end = fmt.REGION_HEADER_BYTES
        assert bytes(self._open.buffer[:len(header)]) == header

    def _reclaim(self) -> None:
        """No free region: evict the policy's victim and open it as the new region, moving its
        pinned blocks, its hot blocks (the reinsertion policy's pick) and its metadata records
        that still matter into it.

        Crash ordering: rewriting the victim's header makes recovery see an empty open region,
        so whatever must outlive the victim -- pinned blocks, records -- is made durable in
        another region first (hot blocks are a cache hint: losing them to a crash is a miss):

        * nothing to keep: reset the victim, append its hot blocks;
        * the open region has room for it: append it there and sync, then seal that region and
          reset the victim (the copies stay where they are);
        * the moved blocks, packed from the victim's start, miss the old places of its pinned
          blocks: rewrite the victim in place (:meth:`_reclaim_in_place`);
        * otherwise a *staging* region: a second reclaimable region holding no pinned block (its
          records still needed go to the open region first, synced) is evicted, reset, and gets
          copies of the pinned blocks and records, synced; then the victim is reset and gets
          them again (newer seqs: recovery prefers them), synced; only then is the staging
          region's header erased and the region freed. At every step one durable copy is found
          by recovery: the victim's sealed summary, the staging region's open scan (the victim
          is then empty), or the victim's own open scan.

        A pinned block that cannot be read (device error) aborts the reclaim of that victim (it
        is never dropped): the next one in policy order is tried, else NoSpaceError names the
        causes. A pinned block that fails verification (corrupt) is dropped and counted."""
        causes: list[str] = []
        # the region being sealed may be the one to reclaim: the victim must not depend on when its
        # seal write completes (every path below seals the open region, i.e. waits for it anyway)
        self._reap_seal(wait=True)
        for victim in self._table.victims():
            if self._reclaim_victim(victim, causes):
                return
        self._stats["alloc_failures"] += 1
        if not causes:
            raise NoSpaceError(f"no space: every one of the {self._table.sealed_count} sealed regions holds more "
                               f"pinned bytes than can be moved (unpin or delete blocks)")
        raise NoSpaceError(f"no space: no region could be reclaimed without losing pinned blocks or records: "
                           f"{'; '.join(dict.fromkeys(causes))}")

    def _reclaim_victim(self, victim: int, causes: list[str]) -> bool:
        moved, unreadable, pinned_ranges = self._read_moved(victim)
        if unreadable:
            causes.append(f"region {victim}: {unreadable} pinned blocks unreadable (device errors)")
            return False
        pinned_moved = [block for block, pinned in moved if pinned]
        records = self._needed_records(victim, {victim})
        if not pinned_moved and not records:
            self._sync_before_dropping(victim, 0)
            self._evict(victim, len(moved))
            if self._active:
                self._seal(wait=False)
            self._start_region(victim)
            self._move_in(moved, [])
            return True
        nbytes = sum(len(block) for block, _ in moved)
        if self._active and self._open.room_for(nbytes, len(moved) + len(records)):
            self._evict(victim, len(moved))
            self._move_in(moved, records)
            self._make_durable(with_entries=True)  # the victim holds nothing needed from here
            self._seal(wait=False)
            self._start_region(victim)
            return True
        if self._active and self._open.room_for(0, len(pinned_moved) + len(records)) and \
                not self._overlaps_new_layout(nbytes, len(moved), pinned_ranges):
            self._reclaim_in_place(victim, moved, records)
            return True
        staging = self._staging_region(victim, causes)
        if staging is None:
            return False
        # the victim stays readable by recovery until step 2: the staging region's records that
        # concern the victim's blocks (tombstones) still count (durable before it is reset; they fit,
        # _staging_region checked)
        staging_records = self._needed_records(staging, {staging})
        if staging_records:
            self._write_records(staging_records)
            self._make_durable(with_entries=True)
        self._sync_before_dropping(staging, len(staging_records))
        if self._active:
            self._seal(wait=False)
        self._evict(victim, len(moved))
        self._evict(staging, 0)
        self._start_region(staging)
        self._stage_copies(pinned_moved, records)
        self._make_durable(with_entries=True)  # step 1: the pinned blocks and records live in the staging region
        self._active = False  # the staging image is given up unsealed (the table frees it at step 3)
        self._start_region(victim)
        self._move_in(moved, records)
        self._make_durable(with_entries=True)  # step 2: ... and in the victim, newer
        # step 3: erase the staging region's header, synced: the table frees the region, so no record
        # is kept for the stale copies it would otherwise still show recovery
        self._write_and_sync([(staging * self._region_size, aligned_buffer(fmt.REGION_HEADER_BYTES))])
        self._table.discard_open(staging)
        return True

    def _reclaim_in_place(self, victim: int, moved: list[tuple[bytes, bool]], records: list[tuple]) -> None:
        """Reclaim ``victim`` keeping its moved blocks in it, when their new places (packed from the
        region's start) miss the old places of its pinned blocks. Order, each step synced:

        1. in the open region: the victim's records still needed, and a pin record for the new
           copy of each pinned block. Seqs are taken in write order -- the records, then the
           victim's base_seq, then the copies' -- so every region's seq span holds only its own
           entries (recovery drops entries past ``seq_span_max``); a pin record names the seq its
           copy is about to get;
        2. the new copies at the victim's start; its header, summary and trailer untouched, so
           recovery still reads the old region, whose pinned blocks are intact;
        3. the victim's header (new base_seq), alone: from here recovery scans an open region from
           the new base_seq, whose walk finds the new copies (pinned by the records of 1); the old
           trailer no longer matches the header and the old summary entries are older than it;
        4. the summary pages (the new copies' entries, a zeroed trailer). Were they written with
           the header, a crash could land them without it: the old header with a dead trailer, an
           open scan from the old base_seq that stops before the new copies (their seqs are past
           its span after a restart) and finds the old pinned blocks no more."""
        self._write_records(records)
        pins = sum(pinned for _, pinned in moved)
        base_seq = self._next_seq + pins  # taken right after the pin records below
        seqs = [base_seq + 1 + i for i in range(len(moved))]
        for (block, pinned), seq in zip(moved, seqs):
            if pinned:
                k0, k1 = _halves(decode_header(block).key)
                self._record(fmt.KIND_PIN, k0, k1, ZERO_NS, seq)
        self._make_durable(with_entries=True)  # step 1
        self._evict(victim, len(moved))
        self._seal(wait=False)
        assert self._take_seq() == base_seq and [self._take_seq() for _ in moved] == seqs, "seqs taken meanwhile"
        image = self._open
        image.reset(victim, base_seq, self._generation)
        tail = self._summary_start(len(moved))
        image.buffer[tail:] = bytes(self._region_size - tail)
        placed = []
        for (block, pinned), seq in zip(moved, seqs):
            header = decode_header(block)
            k0, k1 = _halves(header.key)
            offset = image.append_block(memoryview(block), seq, k0, k1, header.ns_id,
                                        fmt.FLAG_PINNED if pinned else 0)
            placed.append((k0, k1, offset, len(block), seq - base_seq, pinned))
        assert image.last_seq - base_seq <= seq_span_max(self._region_size), (base_seq, image.last_seq)
        base = victim * self._region_size
        self._write_and_sync([(base + fmt.REGION_HEADER_BYTES,
                               image.buffer[fmt.REGION_HEADER_BYTES:align_up(image.data_end)])])  # step 2
        self._write_and_sync([(base, image.buffer[:fmt.REGION_HEADER_BYTES])])  # step 3
        self._write_and_sync([(base + tail, image.buffer[tail:])])  # step 4
        image.durable_end, image.durable_entries = image.data_end, image.entry_count
        self._table.open(victim, base_seq, time.time())
        self._active = True
        for k0, k1, offset, nbytes, delta, pinned in placed:
            assert delta <= SEQ_DELTA_MAX, delta
            self._index.insert(k0, k1, base + offset, nbytes, delta | (PINNED_BIT if pinned else 0))
            self._table.add_block(victim, nbytes, pinned)
            self._stats["reinsertions"] += 1
        self._table.last_seq[victim] = image.last_seq

    def _summary_start(self, entries: int) -> int:
        """The first (aligned) byte of the pages holding ``entries`` (>= 1) summary entries and the trailer."""
        return align_down(fmt.entry_position(self._region_size, max(entries, 1) - 1))

    def _overlaps_new_layout(self, nbytes: int, entries: int, ranges: list[tuple[int, int]]) -> bool:
        """Whether ``nbytes`` of blocks packed from a region's start (aligned up), or the summary
        pages of ``entries`` entries, would overwrite any of these [start, end) ranges of it."""
        front_end = align_up(fmt.REGION_HEADER_BYTES + nbytes)
        summary_start = self._summary_start(entries)
        return any(start < front_end or end > summary_start for start, end in ranges)

    def _read_moved(self, victim: int) -> tuple[list[tuple[bytes, bool]], int, list[tuple[int, int]]]:
        """The blocks to move out of ``victim`` -- (block, pinned), in region order: every pinned
        block, and the hot ones the reinsertion policy picks -- read and verified; how many pinned
        ones could not be read (device errors); and the [start, end) places of the pinned ones in
        the region. Changes nothing but statistics."""
        lo = victim * self._region_size
        slots = self._index.slots_in_range(lo, lo + self._region_size)
        slots = slots[np.argsort(self._index.addr[slots], kind="stable")]  # region order
        meta = self._index.meta[slots]
        pinned = (meta & np.uint32(PINNED_BIT)) != 0
        hot = np.zeros(len(slots), bool)
        if self._index.track_hits:  # a reinsertion policy is configured
            unpinned = np.flatnonzero(~pinned)
            cost = self._index.length[slots[unpinned]].astype(np.int64) + fmt.ENTRY_BYTES
            hot[unpinned] = self._reinsertion.select(self._index.hits[slots[unpinned]], cost,
                                                     int(self._open.capacity_bytes * HOT_REINSERT_FRACTION_MAX))
        moved = pinned | hot
        keep: list[tuple[bytes, bool]] = []
        unreadable = 0
        ranges = [(int(self._index.addr[slot]) - lo, int(self._index.addr[slot]) - lo + int(self._index.length[slot]))
                  for slot in slots[pinned].tolist()]
        for slot, as_pinned in zip(slots[moved].tolist(), pinned[moved].tolist()):
            block = self._reader.read_one(fmt.halves_to_key(self._index.k0[slot], self._index.k1[slot]),
                                          int(self._index.addr[slot]), int(self._index.length[slot]),
                                          self._seq_of(slot))
            if isinstance(block, bytes):
                keep.append((block, as_pinned))
            elif block is ReadFailure.CORRUPT:
                self._stats["corrupt_reads"] += 1  # torn or damaged: dropped, whether pinned or not
            else:
                self._stats["device_errors"] += 1
                unreadable += as_pinned  # a hot block is only a cache hint; a pinned one is never dropped
        return keep, unreadable, ranges

    def _staging_region(self, victim: int, causes: list[str]) -> int | None:
        """A region to stage the victim's pinned blocks in: reclaimable, no pinned block, and its
        records still needed fit the open region."""
        for region in self._table.victims():
            if region == victim or self._table.pinned_bytes[region]:
                continue
            needed = len(self._needed_records(region, {region}))
            if not needed or (self._active and self._open.room_for(0, needed)):
                return region
        causes.append(f"region {victim}: no room to stage its pinned blocks and records (the open region is "
                      f"full and every other reclaimable region holds pinned blocks or records still needed)")
        return None

    def _evict(self, region: int, moved: int) -> None:
        """Drop every block of ``region`` from the index (``moved`` of them are being moved) and
        release it."""
        lo = region * self._region_size
        slots = self._index.slots_in_range(lo, lo + self._region_size)
        pinned = (self._index.meta[slots] & np.uint32(PINNED_BIT)) != 0
        self._table.drop_blocks(np.full(len(slots), region), self._index.length[slots].astype(np.int64), pinned)
        self._index.remove(slots)
        self._stats["evicted_blocks"] += int(len(slots) - moved)
        self._stats["evicted_regions"] += 1
        self._table.release(region)

    def _move_in(self, moved: list[tuple[bytes, bool]], records: list[tuple]) -> None:
        """Append moved blocks and records to the open region (durable if any is pinned or a record)."""
        for block, pinned in moved:
            self._append(memoryview(block), decode_header(block), pinned=pinned)
            self._stats["reinsertions"] += 1
        self._write_records(records)
        if records or any(pinned for _, pinned in moved):
            self._make_durable(with_entries=True)  # a crash must not unpin what was just moved

    def _stage_copies(self, blocks: list[bytes], records: list[tuple]) -> None:
        """Staging: copies of pinned blocks and records in the open region's image only (index and
        table untouched): recovery finds them if a crash comes before the victim has them."""
        image = self._open
        for block in blocks:
            header = decode_header(block)
            k0, k1 = _halves(header.key)
            image.append_block(memoryview(block), self._take_seq(), k0, k1, header.ns_id, fmt.FLAG_PINNED)
        for kind, k0, k1, ns, target_seq in records:
            image.append_meta(kind, k0, k1, ns, self._take_seq(), target_seq)

    def _needed_records(self, region: int, gone: set[int]) -> list[tuple]:
        """The metadata records of ``region`` that must outlive it -- (kind, k0, k1, ns, target_seq)
        -- if the regions in ``gone`` are evicted: tombstones and namespace tombstones while a live
        region outside ``gone`` is older than their target (it may hold a block they delete), and
        the current pin state of blocks still present.

        A tombstone's target is the newest copy of its key, but a crash can leave older copies
        in other regions, which recovery serves again once the tombstone is gone (a kill between
        moving a pinned block out of a victim and rewriting the victim's header leaves both; the
        index knows only the newest). So a tombstone goes only with the last region that may hold
        any copy it deletes: one whose base_seq is below the target (a block's seq exceeds its
        region's base_seq)."""
        live = self._table.state != RegionState.FREE
        live[list(gone)] = False
        live_base = self._table.base_seq[live]
        out = []
        for kind, k0, k1, ns, _, target_seq in self._table.meta_records.get(region, []):
            if kind in (fmt.KIND_TOMBSTONE, fmt.KIND_NS_TOMBSTONE):
                if np.any(live_base < np.uint64(target_seq)):
                    out.append((kind, k0, k1, ns, target_seq))
            else:
                slot = self._index.find(k0, k1)
                if slot >= 0 and self._seq_of(slot) == target_seq and \
                        int(self._index.addr[slot]) // self._region_size not in gone:
                    now_pinned = bool(self._index.meta[slot] & np.uint32(PINNED_BIT))
                    out.append((fmt.KIND_PIN if now_pinned else fmt.KIND_UNPIN, k0, k1, ns, target_seq))
        return out

    def _sync_before_dropping(self, region: int, kept: int) -> None:
        """Before ``region``'s header is rewritten with fewer of its records carried than it holds:
        make every write so far durable. Whether a record is still needed was judged from the
        region table, i.e. from the writes issued so far (region headers, seals); a crash must not
        bring back an older state of flash in which the dropped record would still matter."""
        if self._unsynced_writes and kept < len(self._table.meta_records.get(region, [])):
            self._make_durable()

    def _write_records(self, records: list[tuple]) -> None:
        for kind, k0, k1, ns, target_seq in records:
            self._record(kind, k0, k1, ns, target_seq)

    def _record(self, kind: int, k0: int, k1: int, ns: bytes, target_seq: int) -> None:
        """Append a metadata record to the open region's summary."""
        self._ensure_room(0)
        seq = self._take_seq()
        self._open.append_meta(kind, k0, k1, ns, seq, target_seq)
        self._table.last_seq[self._open.region] = seq
        self._table.meta_records.setdefault(self._open.region, []).append((kind, k0, k1, ns, seq, target_seq))

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _seqs_of(self, slots: np.ndarray) -> np.ndarray:
        regions = (self._index.addr[slots] // np.uint64(self._region_size)).astype(np.int64)
        return self._table.base_seq[regions] + (self._index.meta[slots] & np.uint32(SEQ_DELTA_MAX)).astype(np.uint64)

    def _seq_of(self, slot: int) -> int:
        region = int(self._index.addr[slot]) // self._region_size
        return int(self._table.base_seq[region]) + int(self._index.meta[slot] & np.uint32(SEQ_DELTA_MAX))

    # -- put ---------------------------------------------------------------
    def put(self, block, durable: bool = False) -> int:
        """Store one block (header + payload); returns its seq. A present key is a no-op."""
        return self.put_many([block], durable)[0]

    def put_many(self, blocks: Iterable, durable: bool = False) -> list[int]:
        """Store blocks; with ``durable`` they are on flash and synced on return.
        All blocks are validated before any is stored."""
        views, headers = [], []
        for i, block in enumerate(blocks):
            view = memoryview(block).cast("B")
            header = verify_block(view)
            if view.nbytes > self.block_size_max_bytes:
                raise BlockTooLargeError(f"block {i} of {view.nbytes} bytes is larger than a region can hold: "
                                  f"{self.block_size_max_bytes} bytes (region_size_bytes={self._region_size})")
            views.append(view)
            headers.append(header)
        if not views:
            return []
        k0s, k1s = fmt.keys_to_halves([h.key for h in headers])
        seqs: list[int] = [0] * len(views)
        self._await_seal_for(sum(v.nbytes for v in views), len(views))
        with self._lock:
            self._check_open()
            slots = self._index.find_many(k0s, k1s).tolist()
            k0l, k1l = k0s.tolist(), k1s.tolist()
            pending: list[tuple] = []  # index inserts, done in one vectorized batch per region
            first_of: dict[tuple[int, int], int] = {}  # keys of this batch appended but not yet in the index
            for i, (view, header) in enumerate(zip(views, headers)):
                if slots[i] >= 0:
                    seqs[i] = self._seq_of(slots[i])
                    continue
                if (k0l[i], k1l[i]) in first_of:  # the same key twice in one batch
                    seqs[i] = seqs[first_of[(k0l[i], k1l[i])]]
                    continue
                if not (self._active and self._open.room_for(view.nbytes)):
                    self._insert_pending(pending)
                    first_of.clear()
                    self._ensure_room(view.nbytes)
                    # a reclaim may have evicted or moved blocks and rehashed the index: find the
                    # rest of the batch again (this batch's blocks so far are in the index now)
                    slots[i:] = self._index.find_many(k0s[i:], k1s[i:]).tolist()
                    if slots[i] >= 0:
                        seqs[i] = self._seq_of(slots[i])
                        continue
                first_of[(k0l[i], k1l[i])] = i
                seq = self._take_seq()
                region = self._open.region
                offset = self._open.append_block(view, seq, k0l[i], k1l[i], header.ns_id, 0)
                pending.append((k0l[i], k1l[i], region * self._region_size + offset, view.nbytes,
                                seq - self._open.base_seq))
                self._table.last_seq[region] = seq
                self._table.add_block(region, view.nbytes, False)
                seqs[i] = seq
                self._stats["puts"] += 1
                self._stats["put_bytes"] += view.nbytes
            self._insert_pending(pending)
            if durable:
                self._make_durable()  # syncs all devices if a region of this batch was sealed meanwhile
            else:
                self._reap_seal(wait=False)
        return seqs

    def _await_seal_for(self, nbytes: int, entries: int) -> None:
        """A batch that will not fit the open region needs the spare image, which is free only
        once the seal in flight is written: wait for that write here, without the lock, so GETs,
        LOOKUPs and puts that fit go on meanwhile (under the lock, the seal is then reaped at
        once). Only waits; every decision is taken again under the lock."""
        with self._lock:
            if self._active and self._open.room_for(nbytes, entries):
                return
            sealing = self._sealing
        if sealing is not None and sealing[2] is not None:
            wait_futures([sealing[2]])

    def _insert_pending(self, pending: list[tuple]) -> None:
        if not pending:
            return
        k0, k1, addr, length, delta = zip(*pending)
        assert max(delta) <= SEQ_DELTA_MAX, max(delta)
        self._index.insert_many(np.array(k0, np.uint64), np.array(k1, np.uint64), np.array(addr, np.uint64),
                                np.array(length, np.uint32), np.array(delta, np.uint32))
        pending.clear()

    def _append(self, view: memoryview, header, pinned: bool) -> int:
        self._ensure_room(view.nbytes)
        k0, k1 = _halves(header.key)
        seq = self._take_seq()
        region = self._open.region
        offset = self._open.append_block(view, seq, k0, k1, header.ns_id, fmt.FLAG_PINNED if pinned else 0)
        self._table.last_seq[region] = seq
        self._table.add_block(region, view.nbytes, pinned)
        delta = seq - self._open.base_seq
        assert delta <= SEQ_DELTA_MAX, delta
        self._index.insert(k0, k1, region * self._region_size + offset, view.nbytes,
                           delta | (PINNED_BIT if pinned else 0))
        return seq

    def _make_durable(self, with_entries: bool = False) -> None:
        """Write the open region's unsynced prefix (and, ``with_entries``, its new summary entries:
        metadata records, flags of reinserted blocks) and fdatasync -- every device if seals or
        region headers were written since the last sync, else the devices just written."""
        if self._unsynced_writes:
            self._reap_seal(wait=True)
        image = self._open
        ranges = []
        if self._active:
            ranges = [image.unsynced_prefix()] + ([image.unsynced_tail()] if with_entries else [])
            ranges = [(start, end) for start, end in ranges if start < end]
        try:
            base = image.region * self._region_size
            if len(ranges) == 2:
                # entries first, synced: a torn write then never leaves a moved block on flash (newer
                # than its old copy) without its pinned flag; an entry whose block is missing is ignored.
                # Region headers written since the last sync go first: entries (and the zeroed trailer
                # of the image) must not land under an older header (see _start_region)
                if self._unsynced_writes:
                    self._array.sync()
                    self._unsynced_writes = 0
                start, end = ranges.pop()
                self._array.sync(self._array.write_ranges([(base + start, image.buffer[start:end])]))
            touched = self._array.write_ranges([(base + start, image.buffer[start:end]) for start, end in ranges])
            if self._unsynced_writes:
                self._array.sync()
            elif touched:
                self._array.sync(touched)
        except DeviceError:
            self._stats["device_errors"] += 1
            raise
        self._unsynced_writes = 0
        if self._active:
            image.durable_end = image.data_end
            if with_entries:
                image.durable_entries = image.entry_count

    def _persist_records(self) -> None:
        """Make the metadata records appended so far durable."""
        self._make_durable(with_entries=True)

    # -- get ---------------------------------------------------------------
    def get(self, key) -> bytes | None:
        """The whole verified block, or None (absent or failed verification)."""
        return self.get_many([key])[0]

    def get_into(self, key, buf) -> int | None:
        """Place the verified block in ``buf``; returns its size, or None. A block on flash is read
        straight into ``buf`` when ``buf`` is page-aligned (an ``aligned_buffer``) and holds the
        block rounded up to 4 KiB -- one device read and one CRC pass, no copy -- else read into a
        pooled buffer, verified there and copied once. On a miss, and past the returned size, the
        contents of ``buf`` are undefined."""
        return self.get_many_into([key], [buf])[0]

    def get_many_into(self, keys: Sequence, bufs: Sequence) -> list[int | None]:
        """The batch form of :meth:`get_into`: block i goes to ``bufs[i]`` (writable, distinct).
        Every buffer is checked for size against the index before any read."""
        return self._get_into(keys, bufs, placed=False, verify_payload=True)

    def get_many_placed(self, keys: Sequence, bufs: Sequence,
                        verify_payload: bool = True) -> list[tuple[int, int] | None]:
        """Like :meth:`get_many_into`, but block i may land anywhere in ``bufs[i]``: it comes back
        as ``(offset, size)``, the block being ``bufs[i][offset:offset + size]``. A block on flash
        is read straight into a page-aligned buffer that holds its aligned range (its size plus up
        to 4 KiB either side) whatever its alignment -- one device read, no copy; a smaller
        buffer needs only the block's size and gets a copy at offset 0. ``verify_payload=False``
        checks header, key and seq of blocks read from flash but not the payload CRC: for a
        caller passing the block to a reader that checks it (the daemon's GET)."""
        return self._get_into(keys, bufs, placed=True, verify_payload=verify_payload)

    def _get_into(self, keys: Sequence, bufs: Sequence, placed: bool, verify_payload: bool) -> list:
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        keys = [bytes(k) for k in keys]
        targets = [memoryview(b).cast("B") for b in bufs]
        for i, target in enumerate(targets):
            if target.readonly:
                raise TypeError(f"buffer {i} is read-only")
        results: list = [None] * len(keys)
        pending = self._serve_or_locate(keys, results, targets, placed)
        for _ in range(READ_RETRIES + 1):
            if not pending:
                break
            pending = self._read_sealed(keys, pending, results, targets, placed, verify_payload)
        if pending:
            self._drop_corrupt(keys, pending)
        sizes = [r[1] if placed else r for r in results if r is not None]
        self._count_gets(len(keys), len(sizes), sum(sizes))
        return results

    def record_misses(self, count: int) -> None:
        """Count GETs of keys a caller found absent with :meth:`locate_buffer` and so
        never asked to read (the server sizes its replies that way)."""
        self._count_gets(count, 0, 0)

    def _count_gets(self, requested: int, hits: int, nbytes: int) -> None:
        with self._lock:
            self._stats["hits"] += hits
            self._stats["misses"] += requested - hits
            self._stats["get_bytes"] += nbytes

    def get_many(self, keys: Sequence) -> list[bytes | None]:
        keys = [bytes(k) for k in keys]
        results: list[bytes | None] = [None] * len(keys)
        pending = self._serve_or_locate(keys, results)
        for _ in range(READ_RETRIES + 1):
            if not pending:
                break
            pending = self._read_sealed(keys, pending, results)
        if pending:
            self._drop_corrupt(keys, pending)
        got = [r for r in results if r is not None]
        self._count_gets(len(keys), len(got), sum(len(r) for r in got))
        return results

    def _serve_or_locate(self, keys, results, targets=None, placed: bool = False) -> list[tuple[int, int, int, int]]:
        """Serve open-region hits into ``results`` (as bytes, or copied into ``targets`` and their
        sizes -- ``placed``: (0, size)); returns (i, addr, length, seq) of the ones on flash. With
        ``targets``, every hit's buffer is checked for size first."""
        if not keys:
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        with self._lock:
            self._check_open()
            hit, addr, length, seq, sealed = (a.tolist() for a in self._resolve(k0, k1, count_hits=True))
            if targets is not None:
                for i, nbytes in zip(hit, length):
                    if targets[i].nbytes < nbytes:
                        raise EngineError(f"buffer of {targets[i].nbytes} bytes is too small for the "
                                          f"{nbytes}-byte block")
            self._touch_regions(addr)
            pending = []
            for i, at, nbytes, sq, on_flash in zip(hit, addr, length, seq, sealed):
                if on_flash:
                    pending.append((i, at, nbytes, sq))
                    continue
                region = at // self._region_size
                block = self._image_of(region).block(at - region * self._region_size, nbytes)
                if targets is None:
                    results[i] = bytes(block)
                else:
                    copy_bytes(targets[i][:nbytes], block)
                    results[i] = (0, nbytes) if placed else nbytes
        return pending

    def _touch_regions(self, addrs: list[int]) -> None:
        """Touch the regions of these blocks for the eviction policy, each once, in the order of
        its last block (the order one touch per block would leave)."""
        if not addrs:
            return
        now = time.time()
        newest_first = dict.fromkeys(addr // self._region_size for addr in reversed(addrs))
        for region in reversed(list(newest_first)):
            self._table.touch(region, now)

    def _resolve(self, k0: np.ndarray, k1: np.ndarray, count_hits: bool = False) -> tuple[np.ndarray, ...]:
        """One vectorized pass, lock held: (hit, addr, length, seq, sealed) -- the positions of the
        keys found and, for each, its location (``sealed`` False for a block in a DRAM image: the
        open region or the one being sealed). ``count_hits``: a read, counted for reinsertion."""
        slots = self._index.find_many(k0, k1)
        hit = np.flatnonzero(slots >= 0)
        found = slots[hit]
        if count_hits:
            self._index.count_hits(found)
        addr = self._index.addr[found]
        region = addr // np.uint64(self._region_size)
        sealed = np.ones(len(hit), bool)
        for image_region in self._image_regions():
            sealed &= region != np.uint64(image_region)
        seq = self._table.base_seq[region] + (self._index.meta[found] & np.uint32(SEQ_DELTA_MAX)).astype(np.uint64)
        return hit, addr, self._index.length[found], seq, sealed

    def _image_regions(self) -> list[int]:
        regions = [self._open.region] if self._active else []
        if self._sealing is not None:
            regions.append(self._sealing[0].region)
        return regions

    def _read_sealed(self, keys, pending, results, targets=None, placed: bool = False,
                     verify_payload: bool = True) -> list[tuple[int, int, int, int]]:
        """Read blocks from flash (as bytes, or into ``targets``); returns the ones that failed
        verification, re-located (they may have raced a reclaim)."""
        outcomes = self._reader.read_many([(keys[i], addr, length, seq) for i, addr, length, seq in pending],
                                          None if targets is None else [targets[i] for i, _, _, _ in pending],
                                          placed, verify_payload)
        failed = []
        device_errors = 0
        for (i, _, _, _), outcome in zip(pending, outcomes):
            if isinstance(outcome, (bytes, int, tuple)):
                results[i] = outcome
            elif outcome is ReadFailure.CORRUPT:
                failed.append(i)
            else:
                device_errors += 1
        if device_errors:
            with self._lock:
                self._stats["device_errors"] += device_errors
        if not failed:
            return []
        relocated = self._serve_or_locate([keys[i] for i in failed], sub := [None] * len(failed),
                                          None if targets is None else [targets[i] for i in failed], placed)
        for j, block in enumerate(sub):
            if block is not None:
                results[failed[j]] = block
        return [(failed[j], addr, length, seq) for j, addr, length, seq in relocated]

    def _drop_corrupt(self, keys, pending) -> None:
        """Blocks that failed verification at a location the index still holds: drop them."""
        with self._lock:
            for i, addr, length, seq in pending:
                k0, k1 = _halves(keys[i])
                slot = self._index.find(k0, k1)
                if slot >= 0 and int(self._index.addr[slot]) == addr and self._seq_of(slot) == seq:
                    self._forget(np.array([slot]))
                    self._stats["corrupt_reads"] += 1

    # -- lookup / locate -----------------------------------------------------
    def lookup(self, keys: Sequence) -> int:
        """How many leading keys of a chain are present (one vectorized probe)."""
        if not len(keys):
            return 0
        return self._lookup_halves(*fmt.keys_to_halves(keys))

    def lookup_buffer(self, keys_buf) -> int:
        """:meth:`lookup` for N keys given as one contiguous buffer of N x 16 bytes (bytes,
        memoryview, a NumPy array): no per-key Python step at all."""
        return self._lookup_halves(*fmt.key_buffer_to_halves(keys_buf))

    def _lookup_halves(self, k0: np.ndarray, k1: np.ndarray) -> int:
        if not len(k0):
            return 0
        with self._lock:
            self._check_open()
            present = self._index.find_many(k0, k1) >= 0
        return int(len(present) if present.all() else np.argmin(present))

    def locate_many(self, keys: Sequence) -> list[BlockLocation | None]:
        if not len(keys):
            return []
        rows = self._locate_halves(*fmt.keys_to_halves(keys))
        return [BlockLocation(addr, length, seq, sealed) if ok else None
                for ok, addr, length, seq, sealed in zip(rows["found"].tolist(), rows["logical_offset"].tolist(),
                                                         rows["length"].tolist(), rows["seq"].tolist(),
                                                         rows["sealed"].tolist())]

    def locate_buffer(self, keys_buf) -> np.ndarray:
        """:meth:`locate_many` for N keys given as one contiguous buffer of N x 16 bytes: a
        LOCATION_DTYPE array of N rows (``found`` False: absent, the other fields 0)."""
        return self._locate_halves(*fmt.key_buffer_to_halves(keys_buf))

    def _locate_halves(self, k0: np.ndarray, k1: np.ndarray) -> np.ndarray:
        rows = np.zeros(len(k0), LOCATION_DTYPE)
        if not len(k0):
            return rows
        with self._lock:
            self._check_open()
            hit, addr, length, seq, sealed = self._resolve(k0, k1)
        rows["found"][hit] = True
        rows["logical_offset"][hit] = addr
        rows["length"][hit] = length
        rows["seq"][hit] = seq
        rows["sealed"][hit] = sealed
        return rows

    # -- delete / pin ------------------------------------------------------
    def delete_many(self, keys: Sequence) -> list[bool]:
        """Forget blocks; a tombstone in the open region's summary makes it last (at the next seal)."""
        if not len(keys):
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        with self._lock:
            self._check_open()
            slots = self._index.find_many(k0, k1)
            found = slots >= 0
            unique = np.unique(slots[found])
            doomed = list(zip(self._index.k0[unique].tolist(), self._index.k1[unique].tolist(),
                              self._seqs_of(unique).tolist()))
            self._forget(unique)
            for k0_, k1_, seq in doomed:  # recording may open/reclaim regions: slots are not used past here
                self._record(fmt.KIND_TOMBSTONE, k0_, k1_, ZERO_NS, seq)
            if doomed:
                self._persist_records()
        return found.tolist()

    def _forget(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        regions = (self._index.addr[slots] // np.uint64(self._region_size)).astype(np.int64)
        pinned = (self._index.meta[slots] & np.uint32(PINNED_BIT)) != 0
        self._table.drop_blocks(regions, self._index.length[slots].astype(np.int64), pinned)
        self._index.remove(slots)

    def pin_many(self, keys: Sequence) -> list[bool]:
        return self._set_pinned(keys, True)

    def unpin_many(self, keys: Sequence) -> list[bool]:
        return self._set_pinned(keys, False)

    def _set_pinned(self, keys, pinned: bool) -> list[bool]:
        if not len(keys):
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        with self._lock:
            self._check_open()
            slots = self._index.find_many(k0, k1)
            unique = np.unique(slots[slots >= 0])
            meta = self._index.meta[unique]
            flip = unique[((meta & np.uint32(PINNED_BIT)) != 0) != pinned]
            if len(flip):
                if pinned:
                    self._index.meta[flip] |= np.uint32(PINNED_BIT)
                else:
                    self._index.meta[flip] &= np.uint32(SEQ_DELTA_MAX)
                regions = (self._index.addr[flip] // np.uint64(self._region_size)).astype(np.int64)
                lengths = self._index.length[flip].astype(np.int64)
                for region, nbytes in zip(regions.tolist(), lengths.tolist()):
                    self._table.set_pinned(region, nbytes, pinned)
            changed = list(zip(self._index.k0[flip].tolist(), self._index.k1[flip].tolist(),
                               self._seqs_of(flip).tolist()))
            for k0_, k1_, seq in changed:  # recording may open/reclaim regions: slots are not used past here
                self._record(fmt.KIND_PIN if pinned else fmt.KIND_UNPIN, k0_, k1_, ZERO_NS, seq)
            if changed:
                self._persist_records()
        return (slots >= 0).tolist()

    def delete_namespace(self, ns_id: bytes) -> int:
        """Delete every block of a namespace (reads the region summaries); returns the count."""
        ns_id = bytes(ns_id)
        if len(ns_id) != 16:
            raise EngineError(f"namespace id must be 16 bytes, got {len(ns_id)}")
        ns_void = np.frombuffer(ns_id, "V16")[0]
        with self._lock:
            self._check_open()
            self._reap_seal(wait=True)
            doomed = []
            for region in range(self._table.region_count):
                state = self._table.state[region]
                if state == RegionState.FREE:
                    continue
                entries = self._open.entries() if (self._active and region == self._open.region) else \
                    read_region_entries(self._array, region, self._region_size, int(self._table.base_seq[region]))
                hit = entries[(entries["kind"] == fmt.KIND_BLOCK) & (entries["ns"] == ns_void)]
                if not len(hit):
                    continue
                slots = self._index.find_many(hit["k0"], hit["k1"])
                addr = np.uint64(region * self._region_size) + hit["offset"].astype(np.uint64)
                ok = slots >= 0
                ok[ok] = self._index.addr[slots[ok]] == addr[ok]
                doomed.append(slots[ok])
            slots = np.unique(np.concatenate(doomed)) if doomed else np.zeros(0, np.int64)
            self._forget(slots)
            k0, k1 = _halves(ns_id)
            self._record(fmt.KIND_NS_TOMBSTONE, k0, k1, ns_id, self._next_seq)
            self._persist_records()
        return int(len(slots))

    def delete_all(self) -> int:
        """Forget every block: a new generation in all superblocks makes every region free."""
        with self._lock:
            self._check_open()
            self._reap_seal(wait=True)
            count = len(self._index)
            sbs = read_superblocks(self._devices)
            # every seq taken so far is < _next_seq: recovery ignores them all from now on, so no
            # erased block left in a region that is reused later can pass for a new one
            generation, seq_floor = self._generation + 1, self._next_seq
            try:
                write_generation(self._devices, sbs, generation, seq_floor)
            except DeviceError:
                # nothing changed in memory; put back the superblocks already rewritten, or a reopen
                # would finish the delete_all and drop what is stored from here on (if this fails
                # too, it raises: the store then needs a reopen, which finishes the delete_all)
                self._stats["device_errors"] += 1
                write_generation(self._devices, sbs, self._generation, self._seq_floor)
                raise
            self._generation, self._seq_floor = generation, seq_floor
            self._next_seq = seq_floor + 1
            self._index.clear()
            self._table.reset_all()
            self._active = False
        return count

    # -- info / maintenance --------------------------------------------------
    def block_info(self, key) -> dict | None:
        k0, k1 = _halves(bytes(key))
        with self._lock:
            self._check_open()
            slot = self._index.find(k0, k1)
            if slot < 0:
                return None
            addr, length, seq = int(self._index.addr[slot]), int(self._index.length[slot]), self._seq_of(slot)
            region = addr // self._region_size
            pinned = bool(self._index.meta[slot] & np.uint32(PINNED_BIT))
            last_access = float(self._table.last_access_s[region])
            image = self._image_of(region)
            in_open = image is not None
            head = bytes(image.block(addr - region * self._region_size, HEADER_SIZE)) if in_open else None
        if head is None:
            start = align_down(addr)
            buf = aligned_buffer(align_up(addr + HEADER_SIZE) - start)
            self._array.read(start, buf)
            head = bytes(buf[addr - start:addr - start + HEADER_SIZE])
        try:
            header = decode_header(head)
        except BlockFormatError:
            return None
        if header.key != bytes(key) or header.seq != seq:  # raced a reclaim
            return None
        return {"present": True, "size_bytes": length, "codec_id": header.codec_id, "ns_id": header.ns_id.hex(),
                "region": region, "seq": seq, "pinned": pinned, "region_last_access": last_access,
                "sealed": not in_open}

    def flush(self) -> None:
        """Seal and sync the open region (if it holds anything)."""
        with self._lock:
            self._check_open()
            if self._active and self._open.entry_count:
                self._seal(wait=True)
            self._make_durable()

    def statistics(self) -> EngineStatistics:
        with self._lock:
            if not self._closed:
                self._reap_seal(wait=False)
            s = self._stats
            return EngineStatistics(
                blocks=len(self._index), bytes_stored=int(self._table.live_bytes.sum()),
                regions_total=self._table.region_count, regions_free=self._table.free_count,
                regions_sealed=self._table.sealed_count, hits=s["hits"], misses=s["misses"], puts=s["puts"],
                put_bytes=s["put_bytes"], get_bytes=s["get_bytes"], evicted_blocks=s["evicted_blocks"],
                evicted_regions=s["evicted_regions"], reinsertions=s["reinsertions"],
                device_errors=s["device_errors"], alloc_failures=s["alloc_failures"],
                corrupt_reads=s["corrupt_reads"], recovered_blocks=s["recovered_blocks"],
                recovery_seconds=self._recovery_seconds, index_bytes=self._index.nbytes)

    def close(self) -> None:
        """Seal, sync and close the devices (idempotent)."""
        with self._lock:
            if self._closed:
                return
            try:
                if self._active and self._open.entry_count:
                    self._seal(wait=True)
                self._make_durable()
            finally:
                self._closed = True
                self._sealer.shutdown(wait=True)
                self._pool.shutdown(wait=True)
                self._array.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")


def _halves(key: bytes) -> tuple[int, int]:
    if len(key) != 16:
        raise ValueError(f"keys must be 16 bytes, got {len(key)}")
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
