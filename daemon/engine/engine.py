"""The engine facade: a log-structured, content-addressed block cache on a
striped array of devices (after CacheLib Navy's block cache).

::

    put ──verify──> open region image (DRAM) ──seal: one striped write + fdatasync──> sealed region
                       │ durable put: write the filled prefix + fdatasync
    get ──index──> open image (copy)  |  flash read outside the lock ──verify key, seq, CRCs──> bytes
    full? ──> seal, take a free region, or reclaim the policy's victim (pinned blocks are reinserted)

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
from typing import Iterable, Sequence

import numpy as np

from kvtier.client.blockformat import HEADER_SIZE, BlockFormatError, decode_header, verify_block
from kvtier.client.stripe import StripeGeometry

from . import regionfmt as fmt
from .config import BlockLocation, EngineConfig, EngineStatistics
from .devices import ALIGNMENT_BYTES, Device, aligned_buffer, align_down, align_up
from .errors import DeviceError, EngineError, GeometryError, NoSpaceError
from .index import PINNED_BIT, SEQ_DELTA_MAX, BlockIndex
from .openregion import OpenRegion
from .raid0 import StripedArray
from .reader import BlockReader, ReadFailure
from .recovery import LiveSet, RegionScan, read_region_entries, scan_regions, select_live, write_summary
from .regions import RegionState, RegionTable
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
        self._region_size = cfg.region_size_bytes
        self._pool = ThreadPoolExecutor(max_workers=len(devices) * cfg.io_threads_per_device,
                                        thread_name_prefix="kvtier-io")
        self._array = StripedArray(self._devices, layout.geometry, self._pool)
        self._reader = BlockReader(self._array, self._pool)
        self._lock = threading.RLock()
        self._index = BlockIndex()
        self._open = OpenRegion(aligned_buffer(self._region_size, populate=True))
        # a full region is written by the sealer thread from its image while puts fill the spare
        self._spare: OpenRegion | None = OpenRegion(aligned_buffer(self._region_size, populate=True))
        self._sealing: tuple[OpenRegion, list, Future | None] | None = None
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-seal")
        self._table = RegionTable(layout.region_count, self._open.capacity_bytes, cfg.eviction)
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
        scans = scan_regions(self._array, self._table.region_count, self._region_size, self._generation)
        live = select_live(scans)
        now = time.time()
        for scan in sorted((s for s in scans if s.kind != "free"), key=lambda s: s.base_seq):
            if scan.kind == "open":
                self._seal_recovered(scan)
            self._table.restore_sealed(scan.region, scan.base_seq, scan.last_seq, scan.data_end, now)
        self._load_live(live)
        self._next_seq = live.max_seq + SEQ_RESTART_GAP
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
        self._index = BlockIndex(capacity=int(len(live.k0) / 0.75) + 1)
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
        if self._active:
            self._seal(wait=False)
        self._open_region()
        if not self._open.room_for(block_bytes, entries):
            self._seal(wait=False)  # reinserted pinned blocks took the room: one more region
            self._open_region()
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
        base = image.region * self._region_size
        writes = [(base + start, image.buffer[start:end]) for start, end in image.seal_ranges()]
        self._sealing = (image, writes, self._sealer.submit(self._array.write_ranges, writes))
        self._unsynced_writes += 1
        self._open, self._spare = self._spare, None
        self._active = False
        if wait:
            self._reap_seal(wait=True)

    def _reap_seal(self, wait: bool) -> None:
        """Finish the in-flight seal (waiting for it if ``wait``): the region becomes SEALED.
        A failed seal write is retried here, in the caller's thread, and raises if it fails again."""
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

    def _open_region(self) -> None:
        assert not self._active
        region = self._table.take_free()
        carried: list[tuple] = []
        reinsert: list[bytes] = []
        if region is None:
            region, reinsert, carried = self._reclaim()
        base_seq = self._take_seq()
        header = self._open.reset(region, base_seq, self._generation)
        self._table.open(region, base_seq, time.time())
        self._active = True
        # invalidate what the region held before: new header page + zeroed last page. Not synced
        # here: the next durable promise syncs every device first (_make_durable). Until then a
        # power loss may leave the old header and trailer: entries whose bytes were overwritten
        # fail verification (misses), the others are the region's old, valid blocks.
        tail = self._open.buffer[self._region_size - ALIGNMENT_BYTES:]
        tail[:] = bytes(ALIGNMENT_BYTES)
        base = region * self._region_size
        self._array.write_ranges([(base, self._open.buffer[:fmt.REGION_HEADER_BYTES]),
                                  (base + self._region_size - ALIGNMENT_BYTES, tail)])
        self._unsynced_writes += 1
        self._open.durable_end = fmt.REGION_HEADER_BYTES
        assert bytes(self._open.buffer[:len(header)]) == header
        for block in reinsert:
            self._append(memoryview(block), decode_header(block), pinned=True)
            self._stats["reinsertions"] += 1
        self._carry_forward(carried)
        if reinsert or carried:
            self._make_durable(with_entries=True)  # a crash must not unpin what was just moved

    def _reclaim(self) -> tuple[int, list[bytes], list[tuple]]:
        victim = self._table.victim()
        if victim is None and self._sealing is not None:
            self._reap_seal(wait=True)  # the region being sealed may be the one to reclaim
            victim = self._table.victim()
        if victim is None:
            self._stats["alloc_failures"] += 1
            raise NoSpaceError(f"no space: every one of the {self._table.sealed_count} sealed regions holds more "
                               f"pinned bytes than can be moved (unpin or delete blocks)")
        lo = victim * self._region_size
        slots = self._index.slots_in_range(lo, lo + self._region_size)
        meta = self._index.meta[slots]
        pinned = (meta & np.uint32(PINNED_BIT)) != 0
        keep: list[bytes] = []
        for slot in slots[pinned].tolist():
            block = self._reader.read_one(fmt.halves_to_key(self._index.k0[slot], self._index.k1[slot]),
                                          int(self._index.addr[slot]), int(self._index.length[slot]),
                                          self._seq_of(slot))
            if isinstance(block, bytes):
                keep.append(block)
            else:
                self._stats["corrupt_reads" if block is ReadFailure.CORRUPT else "device_errors"] += 1
        lengths = self._index.length[slots].astype(np.int64)
        self._table.drop_blocks(np.full(len(slots), victim), lengths, pinned)
        self._index.remove(slots)
        self._stats["evicted_blocks"] += int(len(slots) - len(keep))
        self._stats["evicted_regions"] += 1
        carried = self._table.meta_records.get(victim, [])
        self._table.release(victim)
        return victim, keep, carried

    def _carry_forward(self, records: list[tuple]) -> None:
        """Re-record the metadata of a reclaimed region that still matters."""
        for kind, k0, k1, ns, seq, target_seq in records:
            if kind == fmt.KIND_TOMBSTONE:
                if self._table.region_of_seq(target_seq) is not None:
                    self._record(kind, k0, k1, ns, target_seq)
            elif kind == fmt.KIND_NS_TOMBSTONE:
                live = self._table.state != RegionState.FREE
                if np.any(live & (self._table.base_seq < np.uint64(target_seq))):
                    self._record(kind, k0, k1, ns, target_seq)
            else:
                slot = self._index.find(k0, k1)
                if slot >= 0 and self._seq_of(slot) == target_seq:
                    now_pinned = bool(self._index.meta[slot] & np.uint32(PINNED_BIT))
                    self._record(fmt.KIND_PIN if now_pinned else fmt.KIND_UNPIN, k0, k1, ns, target_seq)

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
                raise EngineError(f"block {i} of {view.nbytes} bytes is larger than a region can hold: "
                                  f"{self.block_size_max_bytes} bytes (region_size_bytes={self._region_size})")
            views.append(view)
            headers.append(header)
        if not views:
            return []
        k0s, k1s = fmt.keys_to_halves([h.key for h in headers])
        seqs: list[int] = [0] * len(views)
        with self._lock:
            self._check_open()
            slots = self._index.find_many(k0s, k1s).tolist()
            k0l, k1l = k0s.tolist(), k1s.tolist()
            pending: list[tuple] = []  # index inserts, done in one vectorized batch per region
            first_of: dict[tuple[int, int], int] = {}
            for i, (view, header) in enumerate(zip(views, headers)):
                if slots[i] >= 0:
                    seqs[i] = self._seq_of(slots[i])
                    continue
                if (k0l[i], k1l[i]) in first_of:  # the same key twice in one batch
                    seqs[i] = seqs[first_of[(k0l[i], k1l[i])]]
                    continue
                first_of[(k0l[i], k1l[i])] = i
                if not (self._active and self._open.room_for(view.nbytes)):
                    self._insert_pending(pending)
                    self._ensure_room(view.nbytes)
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
        """Copy the verified block into ``buf``; returns its size, or None. A block on flash is
        copied once, from the read buffer straight into ``buf``."""
        key = bytes(key)
        target = memoryview(buf).cast("B")
        found: list[bytes | None] = [None]
        pending = self._serve_or_locate([key], found)
        if pending:
            _, addr, length, seq = pending[0]
            if target.nbytes < length:
                raise EngineError(f"buffer of {target.nbytes} bytes is too small for the {length}-byte block")
            outcome = self._reader.read_one(key, addr, length, seq, into=target)
            if isinstance(outcome, int):
                self._count_gets(1, 1, outcome)
                return outcome
            found = self.get_many([key])  # raced a reclaim, corrupt or a device error: the full path
        else:
            self._count_gets(1, int(found[0] is not None), len(found[0] or b""))
        block = found[0]
        if block is None:
            return None
        if target.nbytes < len(block):
            raise EngineError(f"buffer of {target.nbytes} bytes is too small for the {len(block)}-byte block")
        target[:len(block)] = block
        return len(block)

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

    def _serve_or_locate(self, keys, results) -> list[tuple[int, int, int, int]]:
        """Serve open-region hits; returns (i, addr, length, seq) of the ones on flash."""
        if not keys:
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        pending = []
        with self._lock:
            self._check_open()
            slots = self._index.find_many(k0, k1)
            now = time.time()
            for i, slot in enumerate(slots.tolist()):
                if slot < 0:
                    continue
                addr, length = int(self._index.addr[slot]), int(self._index.length[slot])
                region = addr // self._region_size
                self._table.touch(region, now)
                image = self._image_of(region)
                if image is not None:
                    results[i] = bytes(image.block(addr - region * self._region_size, length))
                else:
                    pending.append((i, addr, length, self._seq_of(slot)))
        return pending

    def _read_sealed(self, keys, pending, results) -> list[tuple[int, int, int, int]]:
        """Read blocks from flash; returns the ones that failed verification, re-located
        (they may have raced a reclaim)."""
        outcomes = self._reader.read_many([(keys[i], addr, length, seq) for i, addr, length, seq in pending])
        failed = []
        device_errors = 0
        for (i, _, _, _), outcome in zip(pending, outcomes):
            if isinstance(outcome, bytes):
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
        relocated = self._serve_or_locate([keys[i] for i in failed], sub := [None] * len(failed))
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
        k0, k1 = fmt.keys_to_halves(keys)
        with self._lock:
            self._check_open()
            present = self._index.find_many(k0, k1) >= 0
        return int(len(keys) if present.all() else np.argmin(present))

    def locate_many(self, keys: Sequence) -> list[BlockLocation | None]:
        if not len(keys):
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        out: list[BlockLocation | None] = []
        with self._lock:
            self._check_open()
            for slot in self._index.find_many(k0, k1).tolist():
                if slot < 0:
                    out.append(None)
                    continue
                addr = int(self._index.addr[slot])
                sealed = self._image_of(addr // self._region_size) is None
                out.append(BlockLocation(addr, int(self._index.length[slot]), self._seq_of(slot), sealed))
        return out

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
            doomed = [(int(self._index.k0[s]), int(self._index.k1[s]), self._seq_of(s)) for s in unique.tolist()]
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
            changed = []
            for slot in np.unique(slots[slots >= 0]).tolist():
                meta = int(self._index.meta[slot])
                if bool(meta & PINNED_BIT) == pinned:
                    continue
                self._index.meta[slot] = (meta | PINNED_BIT) if pinned else (meta & ~PINNED_BIT)
                region = int(self._index.addr[slot]) // self._region_size
                self._table.set_pinned(region, int(self._index.length[slot]), pinned)
                changed.append((int(self._index.k0[slot]), int(self._index.k1[slot]), self._seq_of(slot)))
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
            self._generation += 1
            write_generation(self._devices, sbs, self._generation)
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
