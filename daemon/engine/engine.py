"""The engine facade: a log-structured, content-addressed block cache on a
striped array of devices (after CacheLib Navy's block cache).

::

    put ──verify──> a reservation in the open region image (DRAM), filled, committed ──seal──> sealed region
                       │ durable put: write the filled prefix + fdatasync
    get ──index──> open image (copy)  |  flash read outside the lock ──verify key, seq, CRCs──> bytes
    get_many_placed ──index──> flash read straight into the caller's aligned buffer ──verify──> (offset, size)
    full? ──> seal, take a clean region from the pool that the reclaim worker keeps filled
              (it moves pinned blocks, and hot ones the reinsertion policy picks, out of its victims)

The parts, one module each: :mod:`.allocator` (the open region, its spare image, seal), :mod:`.region_manager`
(the clean-region pool and its reclaim worker), :mod:`.durability` (group commit: what is synced, in which
order), :mod:`.puts` (every PUT), :mod:`.get_driver` (every GET and LOOKUP), :mod:`.pins_and_deletes`,
:mod:`.rebuild` (the index rebuilt at open), :mod:`.blockmap` (index and region table), :mod:`.deleted_keys`
(what re-replication must not copy back).

Batch calls resolve their keys in one vectorized pass over the index (NumPy); ``lookup_buffer`` /
``locate_buffer`` take the keys as one N x 16-byte buffer.

One lock guards the index, the region table and the open image; no device write or sync runs under it on
the put, flush and reclaim paths: seal and region-header writes go to the sealer thread, durability writes
to a group commit, reclaim I/O to its worker. Flash reads of sealed regions run outside it (a read racing a
reclaim fails its key/seq check and is retried once, then counted as a miss).

Durability: ``put(durable=True)`` returns after the block's bytes are on flash and synced (one fdatasync
acknowledges every durable put waiting on it). Deletes, pins and unpins are durable when they return (their
summary records are written and synced); soft pins (``pin_many(keys, ttl_s)``) live in memory only. A mutating
call that raises changed nothing (:mod:`.take_back`); an unexpected exception makes the caller
:meth:`Engine.fail` it closed (:mod:`.fail_closed`). A buffered put is durable at the next seal or ``flush``
(which writes the open region's filled part in place) or ``close``.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Callable, Iterable, Sequence

import numpy as np

from kvtier.common.blockformat import verify_block
from kvtier.common.stripe import StripeGeometry

from . import regionfmt as fmt
from .allocator import Allocator
from .block_events import BlockListener
from .blockmap import BlockMap
from .config import EngineConfig
from .devices import Device
from .durability import Durability
from .errors import BadArgumentError, BlockTooLargeError, DeviceError, EngineError, EngineFailedError, GeometryError
from .fail_closed import fails_closed
from .get_driver import GetDriver
from .locations import BlockLocation
from .pins_and_deletes import PinsAndDeletes
from .puts import Puts, Reservation, verify_item
from .raid0 import StripedArray
from .reader import BlockReader
from .rebuild import rebuild
from .region_manager import RegionManager
from .regions import RegionTable
from .reinsertion import make_reinsertion
from .seqs import SeqCounter
from .statistics import EngineCounters, EngineStatistics
from .store import StoreLayout, format_store, open_devices, read_superblocks, validate_store, write_generation

log = logging.getLogger("kvtier.daemon.engine")


class Engine:
    """See the module doc; construct with :meth:`open`."""

    # -- construction ------------------------------------------------------
    @staticmethod
    def format(cfg: EngineConfig, force: bool = False, devices: Sequence[Device] | None = None,
               force_hint: str = "force=True") -> None:
        """Write fresh superblocks (erases the store). A device that already holds a kvtier store
        needs ``force=True``; the refusal names it as ``force_hint`` (``--force`` on the command line)."""
        owned = devices is None
        devs = open_devices(cfg, create=True) if owned else list(devices)
        try:
            format_store(cfg, devs, force, force_hint)
        finally:
            for device in devs if owned else ():
                device.close()

    @classmethod
    def open(cls, cfg: EngineConfig, create_if_missing: bool = False,
             devices: Sequence[Device] | None = None) -> "Engine":
        """Validate the superblocks, recover the index. ``create_if_missing`` formats only when no device
        holds a store yet. ``devices`` replaces the files of ``cfg.device_paths`` (memory or faulty devices: tests)."""
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
        self._seq_floor = layout.seq_floor  # seqs <= this are of an erased generation (superblock)
        self._region_size = size = cfg.region_size_bytes
        self._pool = ThreadPoolExecutor(max_workers=len(devices) * cfg.io_threads_per_device,
                                        thread_name_prefix="kvtier-io")
        self._array = StripedArray(self._devices, layout.geometry, self._pool)
        self._reader = BlockReader(self._array, self._pool)
        self._lock = threading.RLock()
        self._counters = EngineCounters()
        self._closed = False
        self._failure: str | None = None  # set by fail(): the state in memory is not to be trusted
        self.on_failure: Callable[[str], None] | None = None  # told once, by fail() (the daemon exits)
        self._table = RegionTable(layout.region_count, fmt.data_room_bytes(size), cfg.eviction)
        try:
            rebuilt = rebuild(self._array, self._table, size, layout.generation, self._seq_floor,
                              track_hits=cfg.reinsertion_hits_min > 0)
        except BaseException:
            self._pool.shutdown(wait=True)
            raise
        self._counters.recovered_blocks = rebuilt.recovered_blocks
        self._recovery_seconds = rebuilt.recovery_seconds
        self._index = rebuilt.index
        self._seqs = SeqCounter(rebuilt.next_seq)
        self._blocks = BlockMap(self._index, self._table, size)
        self._allocator = Allocator(self._array, self._blocks, self._seqs, self._counters, self._lock, size,
                                    layout.generation)
        self._durability = Durability(self._allocator, self._array, self._table, self._seqs, self._counters, size,
                                      self._lock)
        self._regions = RegionManager(self._blocks, self._allocator, self._durability, self._array, self._reader,
                                      self._lock, self._seqs, self._counters,
                                      make_reinsertion(cfg.reinsertion_hits_min), size, cfg.clean_regions_target,
                                      cfg.rescue_dir)
        self._gets = GetDriver(self._blocks, self._allocator, self._reader, self._lock, self._counters,
                               self._check_open, size, self._array)
        self._pins_and_deletes = PinsAndDeletes(self._blocks, self._allocator, self._durability, self._array,
                                                self._lock, self._seqs, self._check_open, size, self._counters,
                                                cfg.pinned_fraction_max, self._regions.data_regions)
        self._regions.soft_pins = self._pins_and_deletes.soft  # reclaim moves soft-pinned blocks
        self._regions.on_bug = self.fail
        self._puts = Puts(self._blocks, self._allocator, self._durability, self._lock, self._seqs, self._counters,
                          self._check_open, lambda: self.block_size_max_bytes, size, self.fail)

    @property
    def geometry(self) -> StripeGeometry:
        return self._layout.geometry

    @property
    def region_size_bytes(self) -> int:
        return self._region_size

    @property
    def block_size_max_bytes(self) -> int:
        """The largest block a region can take (its room less one summary entry)."""
        return self._allocator.capacity_bytes - fmt.ENTRY_BYTES

    # -- put ---------------------------------------------------------------
    def put(self, block, durable: bool = False) -> int:
        """Store one block (header + payload); returns its seq. A present key is a no-op."""
        return self.put_many([block], durable)[0]

    @fails_closed
    def put_many(self, blocks: Iterable, durable: bool = False, skip_deleted: bool = False,
                 keys: Sequence | None = None) -> list[int]:
        """Store blocks; with ``durable`` they are on flash and synced on return. All are validated before any is
        stored. A batch failing after it crossed into a new region keeps what it placed before (:mod:`.take_back`).
        ``skip_deleted``: a key deleted here lately (:mod:`.deleted_keys`) is not stored, its seq 0. ``keys``:
        the key each block was sent under (a request's items), checked with it, a failure naming the item."""
        blocks = list(blocks)
        if keys is not None and len(keys) != len(blocks):
            raise BadArgumentError(f"{len(blocks)} blocks but {len(keys)} keys")
        views, headers = [], []
        for i, block in enumerate(blocks):
            view = memoryview(block).cast("B")
            header = verify_block(view) if keys is None else verify_item(view, i, keys[i])
            if view.nbytes > self.block_size_max_bytes:
                raise BlockTooLargeError(f"block {i} of {view.nbytes} bytes is larger than a region can hold: "
                                  f"{self.block_size_max_bytes} bytes (region_size_bytes={self._region_size})")
            views.append(view)
            headers.append(header)
        return self._puts.put_many(views, headers, durable, skip_deleted) if views else []

    # -- a PUT received in place: its payload lands in a reservation (puts.Puts) -----
    @fails_closed
    def reserve_put(self, keys: Sequence, lengths: Sequence[int], new_region: bool = True) -> Reservation | None:
        """Room in the open region to receive blocks into (``reservation.view``), then
        :meth:`commit_put` or :meth:`abort_put`; None: use :meth:`put_many`."""
        return self._puts.reserve(keys, lengths, new_region)

    @fails_closed
    def commit_put(self, reservation: Reservation, durable: bool = False) -> list[int]:
        return self._puts.commit(reservation, durable)

    @fails_closed
    def abort_put(self, reservation: Reservation) -> None:
        self._puts.abort(reservation)

    # -- get: one driver (get_driver.GetDriver) behind every form ---------------
    def get(self, key) -> bytes | None:
        """The whole verified block, or None (absent or failed verification)."""
        return self.get_many([key])[0]

    @fails_closed
    def get_many(self, keys: Sequence) -> list[bytes | None]:
        return self._gets.get(keys)

    @fails_closed
    def get_many_placed(self, keys: Sequence, bufs: Sequence, verify_payload: bool = True,
                        located: np.ndarray | None = None) -> list[tuple[int, int] | None]:
        """The verified block i placed in ``bufs[i]`` (writable, distinct; each checked for size
        against the index before any read), as ``(offset, size)``: the block is
        ``bufs[i][offset:offset + size]``, or None (a miss). A block on flash is read straight
        into a page-aligned buffer that holds its aligned range (its size plus up to 4 KiB either
        side) whatever its alignment -- one device read, no copy; a smaller buffer needs only the
        block's size and gets a copy at offset 0. ``verify_payload=False`` checks header, key and
        seq of blocks read from flash but not the payload CRC: for a caller passing the block to
        a reader that checks it (the daemon's GET). ``located``: the keys' rows from
        :meth:`locate_buffer` with ``for_read``: blocks on flash are read where they were found,
        not resolved again."""
        return self._gets.get(keys, bufs, verify_payload=verify_payload, located=located)

    @fails_closed
    def record_misses(self, count: int) -> None:
        """Count GETs of keys a caller found absent with :meth:`locate_buffer` and so
        never asked to read (the server sizes its replies that way)."""
        self._gets.count_gets(count, 0, 0)

    # -- lookup / locate -----------------------------------------------------
    @fails_closed
    def lookup(self, keys: Sequence) -> int:
        """How many leading keys of a chain are present (one vectorized probe)."""
        return self._gets.lookup(*fmt.keys_to_halves(keys))

    @fails_closed
    def lookup_buffer(self, keys_buf) -> int:
        """:meth:`lookup` for N keys given as one contiguous buffer of N x 16 bytes (bytes,
        memoryview, a NumPy array): no per-key Python step at all."""
        return self._gets.lookup(*fmt.key_buffer_to_halves(keys_buf))

    @fails_closed
    def locate_many(self, keys: Sequence) -> list[BlockLocation | None]:
        if not len(keys):
            return []
        rows = self._gets.locate(*fmt.keys_to_halves(keys))
        return [BlockLocation(addr, length, seq, sealed) if ok else None
                for ok, addr, length, seq, sealed in zip(rows["found"].tolist(), rows["logical_offset"].tolist(),
                                                         rows["length"].tolist(), rows["seq"].tolist(),
                                                         rows["sealed"].tolist())]

    @fails_closed
    def locate_buffer(self, keys_buf, for_read: bool = False) -> np.ndarray:
        """:meth:`locate_many` for N keys given as one contiguous buffer of N x 16 bytes: a
        LOCATION_DTYPE array of N rows (``found`` False: absent, the other fields 0). ``for_read``:
        the blocks found are read next (:meth:`get_many_placed` with ``located``)."""
        return self._gets.locate(*fmt.key_buffer_to_halves(keys_buf), for_read=for_read)

    # -- delete / pin (pins_and_deletes.PinsAndDeletes) --------------------------
    @fails_closed
    def delete_many(self, keys: Sequence) -> list[bool]:
        """Forget blocks; a tombstone in the open region's summary makes it last (synced on return)."""
        return self._pins_and_deletes.delete_many(keys)

    @fails_closed
    def pin_many(self, keys: Sequence, ttl_s: float | None = None) -> list[bool]:
        """Pin the present keys (per key: present). Without ``ttl_s`` a hard pin, durable on
        return; with it a soft pin for ``ttl_s`` seconds, in memory only (see :mod:`.soft_pins`).
        Refused whole (PinLimitError) past ``pinned_fraction_max`` of the capacity."""
        return self._pins_and_deletes.pin(keys, ttl_s)

    @fails_closed
    def unpin_many(self, keys: Sequence) -> list[bool]:
        """Drop the hard and soft pins of the present keys (per key: present)."""
        return self._pins_and_deletes.unpin(keys)

    @property
    def soft_pin_clock(self):
        """The monotonic clock soft pins expire by (a test may swap in a fake one)."""
        return self._pins_and_deletes.soft.clock

    @soft_pin_clock.setter
    def soft_pin_clock(self, clock) -> None:
        with self._lock:
            self._pins_and_deletes.soft.clock = clock

    @fails_closed
    def delete_namespace(self, ns_id: bytes) -> int:
        """Delete every block of a namespace (reads the region summaries); returns the count."""
        return self._pins_and_deletes.delete_namespace(ns_id)

    @fails_closed
    def delete_all(self) -> int:
        """Forget every block: a new generation in all superblocks makes every region free."""
        with self._lock, self._regions.hold():
            self._check_open()
            self._allocator.wait_unreserved()
            self._allocator.reap_seal(wait=True)
            count = len(self._index)
            sbs = read_superblocks(self._devices)
            # every seq taken so far is below the next one: recovery ignores them all from now on, so
            # no erased block left in a region that is reused later can pass for a new one
            old_generation = self._allocator.generation
            generation, seq_floor = old_generation + 1, self._seqs.next
            try:
                write_generation(self._devices, sbs, generation, seq_floor)
            except DeviceError:
                # nothing changed in memory; put back the superblocks already rewritten, or a reopen
                # would finish the delete_all and drop what is stored from here on (if this fails
                # too, it raises: the store then needs a reopen, which finishes the delete_all)
                self._counters.device_errors += 1
                write_generation(self._devices, sbs, old_generation, self._seq_floor)
                raise
            self._allocator.generation, self._seq_floor = generation, seq_floor
            self._seqs.next = seq_floor + 1
            self._index.clear()
            self._table.reset_all()
            self._pins_and_deletes.soft.clear()
            self._blocks.deleted.clear()  # a local reset: the cluster refills this node
            self._allocator.active = False
            self._allocator.held_region = None  # every region is clean again
            self._blocks.events.all_cleared()
        return count

    # -- block events (block_events) -----------------------------------------
    def set_block_listener(self, listener: BlockListener) -> None:
        """Tell ``listener`` of every block stored, removed or cleared from now on (see
        :mod:`.block_events`); ``NO_LISTENER`` stops it."""
        with self._lock:
            self._blocks.events = listener

    @fails_closed
    def stored_keys(self, then: Callable[[], object] = lambda: None) -> tuple[np.ndarray, np.ndarray, object]:
        """Every stored key as (k0, k1) little-endian halves, and what ``then()`` returns when
        called under the same lock hold: a listener's position in its event stream, so the keys
        are exactly the state after that event."""
        with self._lock:
            self._check_open()
            slots = self._index.live_slots()
            return self._index.k0[slots], self._index.k1[slots], then()

    @fails_closed
    def keys_page(self, cursor: int, limit: int) -> tuple[bytes, int]:
        """Up to ``limit`` stored keys from index slot ``cursor`` on (16 bytes each, joined) and
        the next page's cursor (0 after the last page). A listing, not a snapshot: a table that
        grows between pages may list a key twice or skip one (a later listing sees it)."""
        if cursor < 0 or limit < 1:
            raise BadArgumentError(f"cursor {cursor} and limit {limit}: need cursor >= 0 and limit >= 1")
        with self._lock:
            self._check_open()
            live = self._index.live_slots()
            slots = live[np.searchsorted(live, cursor):][:limit]
            pairs = np.column_stack((self._index.k0[slots], self._index.k1[slots])).astype("<u8")
            more = len(slots) == limit and int(slots[-1]) < int(live[-1])
        return pairs.tobytes(), int(slots[-1]) + 1 if more else 0

    @fails_closed
    def deleted_keys_page(self, cursor: int, limit: int) -> tuple[bytes, int]:
        """As :meth:`keys_page`, of the keys deleted lately (:mod:`.deleted_keys`), oldest first."""
        with self._lock:
            return self._blocks.deleted.page(cursor, limit)

    # -- info / maintenance --------------------------------------------------
    @fails_closed
    def block_info(self, key) -> dict | None:
        """What the index and the block's header say of ``key`` (the admin API's block view), or None."""
        return self._gets.info(bytes(key), self._pins_and_deletes.soft)

    @fails_closed
    def flush(self) -> None:
        """Make every block and record stored so far durable: the open region's filled part is
        written in place and synced (recovery walks it), nothing is sealed. A group commit, without
        the lock: GETs and LOOKUPs go on meanwhile."""
        with self._lock:
            self._check_open()
        self._durability.commit(with_entries=True)

    @fails_closed
    def statistics(self) -> EngineStatistics:
        with self._lock:
            if not self._closed:
                self._allocator.reap_seal(wait=False)
            table = self._table
            hard_pinned, soft_pinned = self._pins_and_deletes.pinned_bytes()
            soft = self._pins_and_deletes.soft
            return EngineStatistics(
                **asdict(self._counters), blocks=len(self._index), bytes_stored=int(table.live_bytes.sum()),
                regions_total=table.region_count, regions_free=table.free_count, regions_sealed=table.sealed_count,
                recovery_seconds=self._recovery_seconds, index_bytes=self._index.nbytes,
                pinned_bytes=hard_pinned + soft_pinned, soft_pinned_bytes=soft_pinned, soft_pins=len(soft),
                soft_pins_expired=soft.expired, pinned_bytes_max=self._pins_and_deletes.pinned_bytes_max,
                pinned_cost_bytes=self._pins_and_deletes.pinned_cost_bytes(),
                clean_regions_target=self._regions.target)

    def fail(self, reason: str) -> None:
        """Fail closed: an unexpected exception left the index or the region table in a state that
        cannot be trusted. Every call from now on raises EngineFailedError, :meth:`close` seals
        nothing (a restart recovers from flash, where every acknowledged durable change is), and
        ``on_failure`` is told once. Takes no lock: the failing thread may hold it."""
        if self._failure is not None:
            return
        self._failure = reason
        if self.on_failure is not None:
            self.on_failure(reason)

    @property
    def failure(self) -> str | None:
        """Why the engine failed closed, or None."""
        return self._failure

    def close(self) -> None:
        """Seal, sync and close the devices (idempotent); a failed engine only closes them."""
        with self._lock:
            if self._closed:
                return
        self._regions.close()  # the reclaim worker, after the reclaim in flight
        with self._lock:
            if self._closed:
                return
            try:
                if self._failure is None:
                    self._seal_and_sync()
                    self._regions.invalidate_freed(self._allocator.generation)
            finally:
                self._closed = True
                self._allocator.close()
                self._pool.shutdown(wait=True)
                self._array.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _seal_and_sync(self) -> None:
        self._allocator.wait_unreserved()  # a region is sealed once its reservation is committed or aborted
        if self._allocator.active and self._allocator.open.entry_count:
            self._allocator.seal(wait=True)
        self._durability.make_durable()

    def _check_open(self) -> None:
        if self._failure is not None:
            raise EngineFailedError(f"the engine failed closed ({self._failure}); a restart recovers from flash")
        if self._closed:
            raise EngineError("engine is closed")
