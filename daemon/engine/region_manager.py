"""The region manager: the clean-region pool, and the background reclaim that fills it (after
CacheLib Navy's RegionManager).

::

    writer needs a region ──take_clean──> pool (FREE regions) ──empty──> waits (counted)
                                            ^
    reclaim worker ──victim (policy order)──┘  keeps ``clean_regions_target`` regions ready:
        1. read the victim's summary                           (no lock; O(victim))
        2. its live blocks: the summary's keys found in the index at the victim's addresses;
           pinned, soft-pinned and hot ones (reinsertion policy) are to be moved
        3. read and verify those blocks                        (no lock)
        4. under the lock: each one still at its address is appended to the open region and
           its index slot pointed there (compare-and-swap on the address); the rest are
           evicted; the victim's records still needed are appended too
        5. commit (group commit, no lock) when a pinned block or a record moved
        6. the victim joins the pool

A writer never runs a reclaim. The invariant that keeps pins from wedging the store: the worker
can always compact a victim, because a whole clean region (or the held region below) is always
there for its moved blocks, and a victim's moved blocks fit one region. So writers -- of blocks
and of metadata records alike -- take a clean region only while more than RESERVE_REGIONS are
left; only the worker takes the last. A region the worker opens is *held*
(:attr:`Allocator.held_region`): it takes records and moved blocks, no writer's blocks, until the
worker has reclaimed a region back into the pool, so writers waiting for room cannot fill it
between the worker opening it and moving its victim's blocks there.

Crash ordering: the victim is not rewritten before step 5, so until its copies are durable
its old contents stay the ones recovery finds. At step 6 a fresh header is queued for it (not
synced): a restart before it lands serves what was evicted again (a cache may), after it the
region is free. Until the region is opened again it counts as live for the tombstones that
must outlive what it held (``RegionTable.stale_on_flash``).

A device error while reclaiming a victim (its summary or a pinned block cannot be read, the
commit fails) puts it back in the policy, or retires it after RECLAIM_FAILURES_MAX failures in
a row, with a log line and a counter; when no victim can be reclaimed the writers waiting get
NoSpaceError naming why. A device error that stops the attempt itself (the seal it waits for,
the region it opens) is the writers' DeviceError, logged once per episode of failed attempts
with their count. Any other exception is a bug in engine state: the engine fails closed
(``on_bug``, :meth:`Engine.fail`) and every writer waiting gets EngineFailedError.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import wait as wait_futures

import numpy as np

from kvtier.common.aligned import aligned_buffer
from kvtier.common.blockformat import decode_header

from . import regionfmt as fmt
from .allocator import Allocator
from .blockmap import BlockMap
from .durability import Durability
from .errors import DeviceError, EngineError, EngineFailedError, NoSpaceError, WaitTimeoutError
from .index import PINNED_BIT, SEQ_DELTA_MAX
from .no_space import no_space_message
from .raid0 import StripedArray
from .reader import BlockReader, ReadFailure
from .recovery import read_region_entries
from .regions import RegionState
from .rescue import Rescue, RescueJournal
from .reinsertion import HOT_REINSERT_FRACTION_MAX, ReinsertionPolicy
from .seqs import SeqCounter
from .soft_pins import SoftPins
from .statistics import EngineCounters

log = logging.getLogger("kvtier.daemon.engine")

RESERVE_REGIONS = 1  # clean regions writers leave to the reclaim worker: where it compacts moved blocks
CLEAN_POOL_FRACTION_MAX = 1 / 8  # the pool never holds more than this share of the store's regions
RECLAIM_FAILURES_MAX = 2  # device errors in a row while reclaiming one region before it is retired
CLEAN_REGION_WAIT_S_MAX = 120.0  # a writer waits this long for one reclaim attempt to end (each ends: device waits are bounded)
REVALIDATE_ROUNDS_MAX = 4  # rounds of (look, read what is missing or take the reserve) before a victim is left for later


def effective_target(configured: int, region_count: int) -> int:
    """The pool size kept: ``configured``, at most CLEAN_POOL_FRACTION_MAX of the regions, at least
    the reserve (a small store then reclaims when a writer needs a region)."""
    return max(RESERVE_REGIONS, min(configured, int(region_count * CLEAN_POOL_FRACTION_MAX)))


class RegionManager:
    def __init__(self, blocks: BlockMap, allocator: Allocator, durability: Durability, array: StripedArray,
                 reader: BlockReader, lock: threading.RLock, seqs: SeqCounter, counters: EngineCounters,
                 reinsertion: ReinsertionPolicy, region_size_bytes: int, clean_regions_target: int = 2,
                 rescue_dir: str | None = None):
        self._blocks = blocks
        self._index, self._table = blocks.index, blocks.table
        self._allocator = allocator
        self._durability = durability
        self._array = array
        self._reader = reader
        self._lock = lock
        self._seqs = seqs
        self._counters = counters
        self._reinsertion = reinsertion
        self._region_size = region_size_bytes
        self.soft_pins: SoftPins | None = None  # wired by the engine: soft-pinned blocks are moved, never dropped
        self.target = effective_target(clean_regions_target, self._table.region_count)
        self._reserve = RESERVE_REGIONS if self._table.region_count > 2 else 0
        self._changed = threading.Condition(lock)  # the pool, the worker's state or a waiter changed
        self._waiters: list[tuple] = []  # writers waiting for a clean region: (floor, satisfied, attempts, since)
        self._attempts = 0  # reclaim attempts finished so far
        self._last_failed_attempt = 0  # the number of the last one that reclaimed nothing
        self._failure: EngineError | None = None  # why it reclaimed nothing, as the writers waiting get it
        self._device_episode = 0  # attempts in a row that stopped on a device error (logged at the first and last)
        self._broken: str | None = None  # a bug stopped the worker: the engine failed closed
        self.on_bug = lambda reason: None  # wired by the engine: Engine.fail
        self._paused_after_failure = False
        self._busy = False  # the worker is reclaiming (the lock may be let go)
        self._holds = 0  # callers that need the worker idle (delete_all)
        self._closing = False
        self._failures: dict[int, int] = {}  # region -> device errors in a row while reclaiming it
        allocator.take_clean = self.take_clean
        allocator.give_back_clean = self.give_back_clean
        self.repair_at_open(RescueJournal(rescue_dir) if rescue_dir is not None else None)
        self._worker = threading.Thread(target=self._run, name="kvtier-reclaim", daemon=True)
        self._worker.start()

    @property
    def data_regions(self) -> int:
        """The regions that can hold blocks: all but the reserve."""
        return self._table.region_count - self._reserve

    # -- the pool (under the lock) -------------------------------------------------
    def take_clean(self, satisfied=lambda: False) -> int | None:
        """A clean region for the allocator to open, or None once ``satisfied()`` (the caller's need
        was met meanwhile). Waits, letting go of the lock, while the pool is down to the reserve
        (the worker: empty; the region it takes is held, see the module doc). Raises NoSpaceError
        when an attempt of the worker that began after this call started waiting reclaimed nothing."""
        worker = threading.current_thread() is self._worker
        floor = 0 if worker else self._reserve
        waiter = None
        try:
            while self._table.free_count <= floor:
                if self._closing:
                    raise EngineError("engine is closed")
                if self._broken is not None:
                    raise EngineFailedError(f"the engine failed closed ({self._broken}); a restart recovers from flash")
                if waiter is None:
                    waiter = (floor, satisfied, self._attempts, time.monotonic())
                    self._waiters.append(waiter)
                    self._counters.clean_region_waits += 1
                    self._changed.notify_all()
                elif self._last_failed_attempt > waiter[2]:
                    self._counters.alloc_failures += 1
                    raise type(self._failure)(str(self._failure))
                elif time.monotonic() - waiter[3] > CLEAN_REGION_WAIT_S_MAX:
                    self._counters.alloc_failures += 1
                    raise WaitTimeoutError(f"waited {CLEAN_REGION_WAIT_S_MAX:g} s for a clean region "
                                           f"(reclaim attempts since: {self._attempts - waiter[2]}, busy: {self._busy})")
                self._changed.wait(CLEAN_REGION_WAIT_S_MAX)
                if satisfied():
                    return None
        finally:
            if waiter is not None:
                self._waiters.remove(waiter)
                self._counters.clean_region_wait_seconds += time.monotonic() - waiter[3]
        region = self._take_free() if worker else self._table.take_free()
        self._changed.notify_all()  # the worker refills the pool
        return region

    def _take_free(self) -> int:
        """A clean region for the worker to compact into: held until it has reclaimed one."""
        region = self._allocator.held_region = self._table.take_free()
        return region

    def give_back_clean(self, region: int) -> None:
        """A region taken but not opened (the writer found room meanwhile): the pool's first again."""
        self._table.give_back_free(region)
        self._changed.notify_all()

    def hold(self):
        """A context (entered under the lock) during which the worker reclaims nothing: it waits for
        the reclaim in flight to finish (delete_all resets the table under it)."""
        manager = self

        class _Hold:
            def __enter__(self):
                manager._holds += 1
                manager._changed.wait_for(lambda: not manager._busy)

            def __exit__(self, *exc):
                manager._holds -= 1
                manager._changed.notify_all()

        return _Hold()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait (under the lock, letting go of it) until the worker has nothing to do: the pool is at
        its target or the last attempt failed. False on a timeout (tests and benchmarks)."""
        return self._changed.wait_for(lambda: not self._busy and not self._wanted(), timeout_s)

    def close(self) -> None:
        """Stop the worker (after the reclaim in flight); writers still waiting get EngineError."""
        with self._lock:
            self._closing = True
            self._changed.notify_all()
        self._worker.join()

    # -- the worker -------------------------------------------------------------
    def _wanted(self) -> bool:
        if self._holds:
            return False
        free = self._table.free_count
        for floor, satisfied, since_attempt, _ in self._waiters:
            if free <= floor and since_attempt >= self._last_failed_attempt and not satisfied():
                return True  # a writer waits, and no attempt since it began waiting has failed
        return free < self.target and not self._paused_after_failure

    def _run(self) -> None:
        with self._lock:
            while True:
                self._changed.wait_for(lambda: self._closing or self._wanted())
                if self._closing:
                    return
                self._busy = True
                try:
                    reason = self._reclaim_one()
                    failure = NoSpaceError(reason) if reason else None
                except DeviceError as exc:
                    failure = DeviceError(f"reclaim stopped on a device error: {exc}")
                except WaitTimeoutError as exc:
                    failure = exc
                except Exception as exc:  # a bug in engine state: fail closed; nobody waits on the worker again
                    log.exception("event=reclaim_crashed")
                    self._broken = f"{type(exc).__name__} in the reclaim worker: {exc}"
                    self.on_bug(self._broken)
                    self._changed.notify_all()
                    return
                finally:
                    self._busy = False
                self._attempts += 1
                self._note_device_episode(failure)
                if failure is not None:
                    self._failure, self._last_failed_attempt = failure, self._attempts
                else:
                    self._allocator.held_region = None  # a region is back in the pool: writers may fill what is left
                self._paused_after_failure = failure is not None
                self._changed.notify_all()

    def _note_device_episode(self, failure: EngineError | None) -> None:
        """One log line when attempts begin to stop on device errors, one with their count when one
        no longer does (not a line per writer refused)."""
        if isinstance(failure, DeviceError):
            self._counters.reclaim_errors += 1
            self._device_episode += 1
            if self._device_episode == 1:
                log.error("event=reclaim_device_errors_began reason=%r (writers waiting get DEVICE_ERROR)", str(failure))
        elif self._device_episode:
            log.warning("event=reclaim_device_errors_ended attempts_failed=%d", self._device_episode)
            self._device_episode = 0

    def _reclaim_one(self) -> str:
        """Reclaim one victim into the pool; '' on success, else why nothing could be reclaimed."""
        causes: dict[str, list[int]] = {}
        tried: set[int] = set()
        while True:
            if self._allocator.sealing is not None:
                self._wait_for_seal()  # the region being sealed is a candidate: the victim must not depend on when
            victim = self._table.next_victim(self._soft_pinned_bytes())  # its write completes
            if victim is not None and victim in tried:
                self._table.requeue_victim(victim)  # tried in this attempt already: first for the next one
            if victim is None or victim in tried:
                return "no space: " + no_space_message(causes, self._table.sealed_count,
                                                       int(self._table.pinned_bytes.sum()),
                                                       self._table.region_count * self._table.region_capacity_bytes)
            tried.add(victim)
            self._table.begin_reclaim(victim)
            try:
                cause = self._reclaim(victim)
            except BaseException:
                if victim in self._table.reclaiming:  # a bug: the victim must not stay out of the policy
                    self._table.abandon_reclaim(victim)
                raise
            if not cause:
                self._failures.pop(victim, None)
                return ""
            causes.setdefault(cause, []).append(victim)

    def _wait_for_seal(self) -> None:
        futures = self._allocator.pending_writes()
        self._lock.release()
        try:
            wait_futures(futures)
        finally:
            self._lock.acquire()
        self._allocator.reap_seal(wait=True)

    def _unlocked(self, call, *args):
        """Run ``call`` with the engine lock let go (the worker holds it once)."""
        self._lock.release()
        try:
            return call(*args)
        finally:
            self._lock.acquire()

    # -- one victim ---------------------------------------------------------------
    def _reclaim(self, victim: int) -> str:
        """Steps 1-6 of the module doc for ``victim`` (out of the policy); '' once it is in the pool,
        else the reason it is not (it is back in the policy, or retired)."""
        base = victim * self._region_size
        try:
            entries = self._unlocked(read_region_entries, self._array, victim, self._region_size,
                                     int(self._table.base_seq[victim]))
        except DeviceError as exc:
            return self._device_failure(victim, f"its summary cannot be read ({exc})")
        blocks = entries[entries["kind"] == fmt.KIND_BLOCK]
        addrs = np.uint64(base) + blocks["offset"].astype(np.uint64)
        copies: dict[tuple[int, int, int], tuple[bytes, bool]] = {}  # (k0, k1, addr) -> (verified block, pinned)
        for _ in range(REVALIDATE_ROUNDS_MAX):
            self._allocator.wait_unreserved()
            slots = self._victim_slots(blocks, addrs)
            to_move = self._to_move(slots)
            missing = [slot for slot in to_move.tolist() if self._copy_key(slot) not in copies]
            if missing:  # read without the lock, then look again: pins and reclaims may have changed it
                outcome = self._read_blocks(missing, copies)
                if outcome:
                    return self._device_failure(victim, outcome)
                continue
            moved = [(slot, copies[self._copy_key(slot)]) for slot in to_move.tolist()]
            records = self._needed_records(victim, {victim})
            nbytes = sum(len(block) for _, (block, _) in moved)
            entries_needed = sum(1 for _, (block, _) in moved if block) + len(records)
            if self._has_room(nbytes, entries_needed):
                break  # the lock is now held until the victim's blocks are moved or evicted
            if self._table.free_count == 0:
                self._table.abandon_reclaim(victim)
                return "no clean region to compact its moved blocks into"
            self._allocator.open_region(self._take_free())  # the reserve (may let go of the lock)
        else:
            self._table.abandon_reclaim(victim)
            return "its blocks changed faster than they could be read"
        pinned_moved = self._move(moved)
        self._durability.write_records(records)
        self._evict_rest(victim, slots, moved)
        dropped = len(self._table.meta_records.get(victim, [])) > len(records)
        if pinned_moved or records or (dropped and self._allocator.unsynced_writes):
            try:
                self._unlocked(self._durability.commit, True)
            except DeviceError as exc:
                # the moved copies may not be on flash: the victim keeps its contents there for good
                self._retire(victim, f"the commit of its moved blocks failed ({exc})")
                return "device errors"
        self._allocator.invalidate_region(victim, self._seqs.take())
        self._table.release(victim)
        self._counters.reclaims += 1
        return ""

    def _copy_key(self, slot: int) -> tuple[int, int, int]:
        return int(self._index.k0[slot]), int(self._index.k1[slot]), int(self._index.addr[slot])

    def _has_room(self, nbytes: int, entries: int) -> bool:
        allocator = self._allocator
        return (not nbytes and not entries) or allocator.appendable(nbytes, entries, compacting=True)

    def _victim_slots(self, blocks: np.ndarray, addrs: np.ndarray) -> np.ndarray:
        """Index slots of the victim's live blocks: its summary's keys found at its addresses."""
        if not len(blocks):
            return np.zeros(0, np.int64)
        slots = self._index.find_many(blocks["k0"], blocks["k1"])
        ok = slots >= 0
        ok[ok] = self._index.addr[slots[ok]] == addrs[ok]
        return np.unique(slots[ok])

    def _to_move(self, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` to move: pinned, soft-pinned, and hot by the reinsertion policy."""
        index = self._index
        slots = slots[np.argsort(index.addr[slots], kind="stable")]  # region order
        pinned = (index.meta[slots] & np.uint32(PINNED_BIT)) != 0
        moved = pinned.copy()
        if index.track_hits:
            unpinned = np.flatnonzero(~pinned)
            cost = index.length[slots[unpinned]].astype(np.int64) + fmt.ENTRY_BYTES
            moved[unpinned] = self._reinsertion.select(index.hits[slots[unpinned]], cost,
                                                       int(self._allocator.capacity_bytes * HOT_REINSERT_FRACTION_MAX))
        if self.soft_pins is not None and len(self.soft_pins):
            moved |= np.isin(slots, self.soft_pins.live_slots(index))
        return slots[moved]

    def _read_blocks(self, slots: list[int], copies: dict) -> str:
        """Read and verify these blocks without the lock into ``copies``; '' or why a pinned one
        could not be read (a device error: never dropped). A corrupt one is dropped later (evicted)."""
        index = self._index
        requests = [(fmt.halves_to_key(index.k0[s], index.k1[s]), int(index.addr[s]), int(index.length[s]),
                     self._blocks.seq_of(s)) for s in slots]
        pinned = [bool(index.meta[s] & np.uint32(PINNED_BIT)) for s in slots]
        keys = [self._copy_key(s) for s in slots]
        outcomes = self._unlocked(self._reader.read_many, requests)
        unreadable = 0
        for key, as_pinned, outcome in zip(keys, pinned, outcomes):
            if isinstance(outcome, bytes):
                copies[key] = (outcome, as_pinned)
            elif outcome is ReadFailure.CORRUPT:
                self._counters.corrupt_reads += 1
                copies[key] = (b"", as_pinned)  # torn or damaged: dropped, whether pinned or not
            else:
                self._counters.device_errors += 1
                unreadable += as_pinned  # a hot block is only a cache hint; a pinned one is never dropped
        return f"{unreadable} pinned blocks unreadable (device errors)" if unreadable else ""

    def _move(self, moved: list[tuple[int, tuple[bytes, bool]]]) -> bool:
        """Append the copies to the open region and point their slots there (they are still at the
        victim's addresses: checked under this lock hold); returns whether a pinned one moved. A
        moved block keeps its key: no block event (block_events)."""
        index, table = self._index, self._table
        pinned_any = False
        for slot, (block, _) in moved:
            if not block:
                continue  # corrupt: evicted with the rest
            pinned = bool(index.meta[slot] & np.uint32(PINNED_BIT))  # as now: pinned or unpinned meanwhile
            old_region = int(index.addr[slot]) // self._region_size
            length = int(index.length[slot])
            addr, seq = self._allocator.append_moved(memoryview(block), decode_header(block), pinned)
            table.drop_blocks(np.array([old_region]), np.array([length]), np.array([pinned]))
            delta = seq - int(table.base_seq[addr // self._region_size])
            assert delta <= SEQ_DELTA_MAX, delta
            index.addr[slot] = addr
            index.meta[slot] = delta | (PINNED_BIT if pinned else 0)
            if index.track_hits:
                index.hits[slot] = 0
            pinned_any |= pinned
            self._counters.reinsertions += 1
        return pinned_any

    def _evict_rest(self, victim: int, slots: np.ndarray, moved: list) -> None:
        """Drop the victim's blocks that did not move from the index."""
        kept = {slot for slot, (block, _) in moved if block}
        doomed = np.array([slot for slot in slots.tolist() if slot not in kept], np.int64)
        self._blocks.forget(doomed)
        if self._table.live_blocks[victim]:  # blocks its summary does not list (it was damaged): by address
            lo = victim * self._region_size
            extra = self._index.slots_in_range(lo, lo + self._region_size)
            self._blocks.forget(extra)
            doomed = np.concatenate([doomed, extra])
        self._counters.evicted_blocks += int(len(doomed))
        self._counters.evicted_regions += 1

    def _device_failure(self, victim: int, what: str) -> str:
        """A reclaim of ``victim`` that changed nothing failed on a device error."""
        self._counters.reclaim_errors += 1
        failures = self._failures.get(victim, 0) + 1
        self._failures[victim] = failures
        if failures >= RECLAIM_FAILURES_MAX:
            self._retire(victim, what)
        else:
            log.warning("event=reclaim_failed region=%d reason=%r", victim, what)
            self._table.abandon_reclaim(victim)
        return what.split(" (")[0]

    def _retire(self, victim: int, why: str) -> None:
        self._failures.pop(victim, None)
        self._table.retire(victim)
        self._counters.regions_retired += 1
        log.error("event=region_retired region=%d reason=%r (it is not reused until a restart)", victim, why)

    def _soft_pinned_bytes(self) -> np.ndarray | None:
        """Soft-pinned bytes per region (None without soft pins): they count as pinned when
        choosing a victim, so a region full of them is not reclaimed to free nothing."""
        if self.soft_pins is None or not len(self.soft_pins):
            return None
        return self.soft_pins.bytes_by_region(self._index, self._region_size, self._table.region_count)

    def _needed_records(self, region: int, gone: set[int]) -> list[tuple]:
        """The metadata records of ``region`` that must outlive it -- (kind, k0, k1, ns, target_seq)
        -- if the regions in ``gone`` are evicted: tombstones and namespace tombstones while a region
        outside ``gone`` whose contents recovery may read is older than their target (it may hold a
        block they delete), and the current pin state of blocks still present.

        A tombstone's target is the newest copy of its key, but a crash can leave older copies
        in other regions (a freed region keeps its contents on flash until it is opened again),
        which recovery serves again once the tombstone is gone. So a tombstone goes only with
        the last region that may hold any copy it deletes: one whose base_seq is below the target
        (a block's seq exceeds its region's base_seq)."""
        records = self._table.meta_records.get(region, [])
        if not records:
            return []
        live = self._table.live_for_records()
        live[list(gone)] = False
        oldest = int(self._table.base_seq[live].min()) if live.any() else None
        out = []
        for kind, k0, k1, ns, _, target_seq in records:
            if kind in (fmt.KIND_TOMBSTONE, fmt.KIND_NS_TOMBSTONE):
                if oldest is not None and oldest < target_seq:
                    out.append((kind, k0, k1, ns, target_seq))
            else:
                slot = self._index.find(k0, k1)
                if slot >= 0 and self._blocks.seq_of(slot) == target_seq and \
                        int(self._index.addr[slot]) // self._region_size not in gone:
                    now_pinned = bool(self._index.meta[slot] & np.uint32(PINNED_BIT))
                    out.append((fmt.KIND_PIN if now_pinned else fmt.KIND_UNPIN, k0, k1, ns, target_seq))
                elif slot < 0 and oldest is not None and oldest < target_seq:
                    out.append((kind, k0, k1, ns, target_seq))  # evicted, but a copy recovery may read is pinned
        return out

    # -- repair at open: an in-place compaction (rescue) ---------------------------------
    def repair_at_open(self, journal: RescueJournal | None) -> None:
        """Before the worker starts: finish an in-place compaction a crash cut short (its journal is
        there), or, when the store has no clean region left for the worker to compact into (an older
        version, or a crash, left it so), compact the sealed region with the fewest pinned bytes in
        place. Either way the region it compacts is open and held for the worker afterwards, so the
        worker can always compact its next victim."""
        with self._lock:
            rescue = journal.read() if journal is not None else None
            if rescue is not None:
                log.warning("event=rescue_resumed region=%d blocks=%d records=%d", rescue.region,
                            len(rescue.blocks), len(rescue.records))
                self._compact_in_place(rescue.region, journal, rescue)
            elif self._table.free_count == 0 and self._table.sealed_count:
                sealed = np.flatnonzero(self._table.state == RegionState.SEALED)
                sealed = np.array([r for r in sealed.tolist() if r not in self._table.retired], np.int64)
                if not len(sealed):
                    return
                if journal is None:
                    log.error("event=rescue_impossible reason='no clean region and no rescue_dir' (writes that "
                              "need a new region may be refused until pins are undone)")
                    return
                victim = int(sealed[np.argmin(self._table.pinned_bytes[sealed])])
                self._compact_in_place(victim, journal, None)

    def _compact_in_place(self, victim: int, journal: RescueJournal, resumed: Rescue | None) -> None:
        """Keep ``victim``'s pinned blocks and needed records (and those of a ``resumed`` journal that
        are gone from the index) in the journal, free the region, open it again, append them and
        commit; then remove the journal. Under the lock, at open (nobody else is served yet)."""
        table, index = self._table, self._index
        kept: list[tuple[int, bytes]] = []  # (slot or -1, verified block) to append
        records: list[tuple] = list(resumed.records) if resumed is not None else []
        slots = np.zeros(0, np.int64)
        if table.state[victim] == RegionState.SEALED:
            entries = read_region_entries(self._array, victim, self._region_size, int(table.base_seq[victim]))
            blocks = entries[entries["kind"] == fmt.KIND_BLOCK]
            slots = self._victim_slots(blocks, np.uint64(victim * self._region_size) + blocks["offset"].astype(np.uint64))
            lo = victim * self._region_size
            slots = np.union1d(slots, index.slots_in_range(lo, lo + self._region_size))
            pinned = slots[(index.meta[slots] & np.uint32(PINNED_BIT)) != 0]
            copies: dict = {}
            if self._read_blocks(pinned.tolist(), copies):
                log.error("event=rescue_failed region=%d reason='pinned blocks unreadable'", victim)
                return
            kept = [(int(slot), copies[self._copy_key(int(slot))][0]) for slot in pinned.tolist()]
            records += self._needed_records(victim, {victim})
        present = {(int(index.k0[s]), int(index.k1[s])) for s, _ in kept}
        for block, was_pinned in resumed.blocks if resumed is not None else ():
            k0, k1 = fmt.key_to_halves(decode_header(block).key)
            if was_pinned and (k0, k1) not in present and index.find(k0, k1) < 0:
                kept.append((-1, block))
        kept = [(slot, block) for slot, block in kept if block]  # a corrupt one: dropped
        journal.write(Rescue(victim, int(table.base_seq[victim]), [(block, True) for _, block in kept], records))
        if table.state[victim] == RegionState.SEALED:  # free it: its kept blocks leave its accounting now
            table.begin_reclaim(victim)
            table.drop_blocks(np.full(len(kept), victim), np.array([len(block) for _, block in kept], np.int64),
                              np.ones(len(kept), bool))
            self._blocks.forget(np.setdiff1d(slots, [slot for slot, _ in kept]))
            table.release(victim)
        table.take_free_region(victim)  # its new header lands with the commit below
        self._allocator.open_region(victim)
        self._allocator.held_region = victim
        for slot, block in kept:
            header = decode_header(block)
            addr, seq = self._allocator.append_moved(memoryview(block), header, True)
            delta = seq - int(table.base_seq[victim])
            if slot < 0:
                k0, k1 = fmt.key_to_halves(header.key)
                self._blocks.insert_appended([(k0, k1, addr, len(block), delta)])
                slot = index.find(k0, k1)
            index.addr[slot] = addr
            index.meta[slot] = delta | PINNED_BIT
        self._durability.write_records(records)
        self._unlocked(self._durability.commit, True)
        journal.remove()
        self._counters.rescues += 1
        log.warning("event=rescued region=%d pinned_blocks=%d records=%d (compacted in place: the store had no "
                    "clean region)", victim, len(kept), len(records))

    def invalidate_freed(self, generation: int) -> None:
        """At a clean close: give every freed region whose old contents are still on flash a new
        header (synced), so a restart finds it free instead of serving what was evicted from it."""
        stale = np.flatnonzero(self._table.stale_on_flash).tolist()
        if not stale:
            return
        ranges = []
        for region in stale:
            page = aligned_buffer(fmt.REGION_HEADER_BYTES)
            page[:] = fmt.encode_region_header(fmt.RegionHeader(generation, region, self._seqs.take()))
            ranges.append((region * self._region_size, page))
        self._durability.write_and_sync(ranges)
        self._table.stale_on_flash[stale] = False
