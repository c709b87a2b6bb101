"""Deletes and pins: the index and the region table change at once, and a metadata record in
the open region's summary -- a tombstone, namespace tombstone, pin or unpin -- makes each
change last. Every call is durable when it returns (its records are written and synced).

Each call is all-or-nothing as its caller sees it. Room for every record is taken first (that
may seal the open region or reclaim one, which may fail: NoSpaceError, nothing changed), and
the keys to change chosen again after it (taking room may let go of the lock): never more
than there is room for, so all of a call's records go to one open image; a
DELETE, UNPIN or namespace delete on a store with no room left tries once more with its
change applied in memory -- dropping or unpinning blocks may be what makes a region
reclaimable -- and undoes it if that fails too. Then, under the engine lock, the change is
applied to the index and the region table (so no reclaim moves a deleted block under a new
seq, or evicts a block being pinned) and its records appended; the lock is let go of and a
group commit makes them durable (``Durability.commit``), so no reader or writer waits for
that sync. If the commit fails (DeviceError), the change is undone in memory and the records
taken back (:mod:`.take_back`). Meanwhile the change is visible: a request that finds
nothing to change while another one's change is not durable yet waits for a commit too, so
that what it answers lasts.

Known limits, all on a failed commit with other requests running: records sealed into a
region before the take-back cannot be taken back (a restart may apply them); until a write of
the taken-back records lands, a crash may apply them; a "nothing to change" request covered
by a commit that succeeded may answer success for a change that is then undone; a reclaim in
that window may keep a moved block's pinned flag, or its eviction, after a failed PIN or
UNPIN; UNPIN's undo re-pins by key, so it may pin a block PUT again in that window.

Soft pins (:mod:`.soft_pins`, ``ttl_s``) change memory only. Pinned bytes -- hard and soft --
are limited to ``pinned_fraction_max`` of the store's capacity: a PIN past it is refused
(:class:`.errors.PinLimitError`) and changes nothing; PUTs are never refused for pins.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import numpy as np

from . import regionfmt as fmt
from .allocator import Allocator
from .blockmap import BlockMap
from .durability import Durability
from .errors import DeviceError, EngineError, NoSpaceError, PinLimitError
from .index import PINNED_BIT, SEQ_DELTA_MAX
from .raid0 import StripedArray
from .recovery import read_region_entries
from .regions import RegionState
from .seqs import SeqCounter
from .soft_pins import SoftPins, check_ttl_s
from .statistics import EngineCounters
from .take_back import AppendedRecords, appends_or_nothing, mark_records, take_back_failed_records


# the slots a request changes, of its keys' index slots (-1: absent): one record each
Pick = Callable[[np.ndarray], np.ndarray]
# (the keys' slots, those picked, their records' (k0, k1, target seq), the undo of a change applied early or None)
Chosen = tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]], Callable[[], None] | None]


def _present(slots: np.ndarray) -> np.ndarray:
    return np.unique(slots[slots >= 0])


class PinsAndDeletes:
    def __init__(self, blocks: BlockMap, allocator: Allocator, durability: Durability, array: StripedArray,
                 lock: threading.RLock, seqs: SeqCounter, check_open: Callable[[], None], region_size_bytes: int,
                 counters: EngineCounters, pinned_fraction_max: float, data_regions: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._blocks = blocks
        self._index, self._table = blocks.index, blocks.table
        self._allocator = allocator
        self._durability = durability
        self._array = array
        self._lock = lock
        self._seqs = seqs
        self._check_open = check_open  # raises once the engine is closed
        self._region_size = region_size_bytes
        self._counters = counters
        self._pinned_fraction_max = pinned_fraction_max
        # the regions that hold blocks: all but the clean ones the region manager keeps in reserve
        self._data_regions = self._table.region_count if data_regions is None else data_regions
        self.soft = SoftPins(clock)
        self._unsettled = 0  # requests whose records are appended and their commit not done

    # -- pinned bytes ------------------------------------------------------
    @property
    def pinned_bytes_max(self) -> int:
        """The most bytes pins may hold: ``pinned_fraction_max`` of the store's room for blocks (the
        room of the regions that hold blocks: the reserve region holds none)."""
        return int(self._pinned_fraction_max * self._capacity_bytes)

    @property
    def _capacity_bytes(self) -> int:
        return self._data_regions * self._table.region_capacity_bytes

    def pinned_bytes(self) -> tuple[int, int]:
        """(hard-pinned, soft-pinned) bytes now; under the lock."""
        soft = self.soft.live_slots(self._index)
        return int(self._table.pinned_bytes.sum()), int(self._index.length[soft].astype(np.int64).sum())

    def pinned_cost_bytes(self, extra: np.ndarray | None = None) -> int:
        """What hard and soft pins (and ``extra`` pinned bytes per region) cost the cache
        (RegionTable.pinned_cost_bytes); under the lock."""
        region_count = self._table.region_count
        soft = self.soft.bytes_by_region(self._index, self._region_size, region_count) if len(self.soft) else None
        more = [a for a in (soft, extra) if a is not None]
        return self._table.pinned_cost_bytes(sum(more) if more else None)

    def _check_pin_limit(self, new_slots: np.ndarray) -> None:
        """Refuse pins that would take what pins cost past the limit: their bytes, or a whole region's
        room for a region they would pin past what a reclaim moves (it is then never reclaimed)."""
        lengths = self._index.length[new_slots].astype(np.int64)
        added = int(lengths.sum())
        if not added:
            return
        extra = np.zeros(self._table.region_count, np.int64)
        np.add.at(extra, (self._index.addr[new_slots] // np.uint64(self._region_size)).astype(np.int64), lengths)
        cost = self.pinned_cost_bytes(extra)
        limit = self.pinned_bytes_max
        if cost > limit:
            hard, soft = self.pinned_bytes()
            self._counters.pins_refused += 1
            raise PinLimitError(
                f"pin refused: {len(new_slots)} blocks of {added} bytes would bring what pins cost the cache to "
                f"{cost} bytes, past pinned_bytes_max={limit} (pinned_fraction_max={self._pinned_fraction_max} of "
                f"{self._capacity_bytes} bytes; a region pinned past half its room costs all of it, as it is never "
                f"reclaimed); pinned now: {hard + soft} bytes ({hard} hard, {soft} soft). Unpin or delete blocks, "
                f"or raise pinned_fraction_max")

    # -- deletes -----------------------------------------------------------
    def delete_many(self, keys: Sequence) -> list[bool]:
        if not len(keys):
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        with self._lock:
            slots = self._slots_to_change(k0, k1)
            settle, appended = self._unsettled > 0, None
            if (slots >= 0).any():
                slots, unique, doomed, undo = self._room_for_records(k0, k1, slots, _present, self._forget_tentatively)
                if undo is None:
                    undo = self._forget_tentatively(unique)
                appended = self._append_records([(fmt.KIND_TOMBSTONE, k0_, k1_, fmt.NO_NAMESPACE, seq)
                                                 for k0_, k1_, seq in doomed], undo)
        if appended is None:
            present = self._after_unsettled(settle, slots)
        else:
            self._commit_records(appended, undo)
            present = (slots >= 0).tolist()
        with self._lock:
            if appended is not None:
                self.soft.discard((k0_, k1_) for k0_, k1_, _ in doomed)
            self._blocks.deleted.record(k0, k1)  # absent keys too: a replica may hold them
        return present

    def delete_namespace(self, ns_id: bytes) -> int:
        ns_id = bytes(ns_id)
        if len(ns_id) != 16:
            raise EngineError(f"namespace id must be 16 bytes, got {len(ns_id)}")
        allocator = self._allocator
        with self._lock:
            self._check_open()
            self._allocator.wait_unreserved()
            allocator.reap_seal(wait=True)
            try:
                self._reserve_records(1)  # before the scan: taking room may reclaim regions
                roomy = True
            except NoSpaceError:
                roomy = False
            scanned: list[tuple[np.ndarray, list]] = []

            def forget_scanned() -> Callable[[], None]:  # scanned where the lock was held since
                allocator.reap_seal(wait=True)
                slots = self._namespace_slots(ns_id)
                scanned.append((slots, list(zip(self._index.k0[slots].tolist(), self._index.k1[slots].tolist()))))
                return self._forget_tentatively(slots)
            undo = None if roomy else self._room_for_count(1, forget_scanned)  # may let go of the lock
            if undo is None:
                undo = forget_scanned()
            slots, keys = scanned[-1]
            k0, k1 = fmt.key_to_halves(ns_id)
            appended = self._append_records([(fmt.KIND_NS_TOMBSTONE, k0, k1, ns_id, self._seqs.next)], undo)
        self._commit_records(appended, undo)
        with self._lock:
            self.soft.discard(keys)
            self._blocks.deleted.record([k[0] for k in keys], [k[1] for k in keys])
        return int(len(slots))

    def _namespace_slots(self, ns_id: bytes) -> np.ndarray:
        """The index slots of every stored block of the namespace (reads the region summaries)."""
        ns_void = np.frombuffer(ns_id, "V16")[0]
        allocator = self._allocator
        doomed = []
        for region in range(self._table.region_count):
            if self._table.state[region] == RegionState.FREE:
                continue
            entries = allocator.open.entries() if (allocator.active and region == allocator.open.region) else \
                read_region_entries(self._array, region, self._region_size, int(self._table.base_seq[region]))
            hit = entries[(entries["kind"] == fmt.KIND_BLOCK) & (entries["ns"] == ns_void)]
            if not len(hit):
                continue
            slots = self._index.find_many(hit["k0"], hit["k1"])
            addr = np.uint64(region * self._region_size) + hit["offset"].astype(np.uint64)
            ok = slots >= 0
            ok[ok] = self._index.addr[slots[ok]] == addr[ok]
            doomed.append(slots[ok])
        return np.unique(np.concatenate(doomed)) if doomed else np.zeros(0, np.int64)

    def _slots_to_change(self, k0, k1) -> np.ndarray:
        """Under the engine lock: the keys' index slots (-1: absent) once the engine is open and
        no in-place PUT holds a reservation in the open region."""
        self._check_open()
        self._allocator.wait_unreserved()
        return self._index.find_many(k0, k1)

    # -- pins --------------------------------------------------------------
    def pin(self, keys: Sequence, ttl_s: float | None = None) -> list[bool]:
        """Pin the present keys: hard (a durable record) without ``ttl_s``, else soft for
        ``ttl_s`` seconds (memory only; a hard-pinned block stays hard). Per key: present."""
        if ttl_s is not None:
            ttl_s = check_ttl_s(ttl_s)
        if not len(keys):
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        index = self._index
        with self._lock:
            slots = self._slots_to_change(k0, k1)
            if ttl_s is not None:
                unique = np.unique(slots[slots >= 0])
                unpinned = unique[(index.meta[unique] & np.uint32(PINNED_BIT)) == 0]
                pairs = list(zip(index.k0[unpinned].tolist(), index.k1[unpinned].tolist()))
                fresh = np.array([not self.soft.contains(pair) for pair in pairs], bool)
                self._check_pin_limit(unpinned[fresh])
                self.soft.pin(pairs, ttl_s)
                return (slots >= 0).tolist()
            flip = self._unpinned_slots(slots)
            settle, appended = self._unsettled > 0, None
            if len(flip):
                self._check_pin_limit(self._not_soft(flip))
                slots, flip, changed, _ = self._room_for_records(k0, k1, slots, self._unpinned_slots)
                self._check_pin_limit(self._not_soft(flip))
                undo = self._set_pins_tentatively(flip, True)
                appended = self._append_records([(fmt.KIND_PIN, k0_, k1_, fmt.NO_NAMESPACE, seq)
                                                 for k0_, k1_, seq in changed], undo)
        if appended is None:
            return self._after_unsettled(settle, slots)
        self._commit_records(appended, undo)
        with self._lock:
            self.soft.discard((k0_, k1_) for k0_, k1_, _ in changed)  # a hard pin replaces a soft one
        return (slots >= 0).tolist()

    def unpin(self, keys: Sequence) -> list[bool]:
        """Unpin the present keys (hard and soft pins). Per key: present."""
        if not len(keys):
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        with self._lock:
            slots = self._slots_to_change(k0, k1)
            flip = self._hard_slots(slots)
            appended = undo = None
            if len(flip):
                slots, flip, targets, undo = self._room_for_records(
                    k0, k1, slots, self._hard_slots, lambda chosen: self._set_pins_tentatively(chosen, False))
                if undo is None:
                    undo = self._set_pins_tentatively(flip, False)
                # else unpinned already: that is what let a region be reclaimed (the block may be gone)
                appended = self._append_records([(fmt.KIND_UNPIN, k0_, k1_, fmt.NO_NAMESPACE, seq)
                                                 for k0_, k1_, seq in targets], undo)
            settle = appended is None and self._unsettled > 0
        if appended is not None:
            self._commit_records(appended, undo)
        self._after_unsettled(settle, slots)
        with self._lock:
            if len(self.soft):
                self.soft.discard(zip(k0.tolist(), k1.tolist()))
        return (slots >= 0).tolist()

    def _unpinned_slots(self, slots: np.ndarray) -> np.ndarray:
        unique = np.unique(slots[slots >= 0])
        return unique[(self._index.meta[unique] & np.uint32(PINNED_BIT)) == 0]

    def _hard_slots(self, slots: np.ndarray) -> np.ndarray:
        unique = np.unique(slots[slots >= 0])
        return unique[(self._index.meta[unique] & np.uint32(PINNED_BIT)) != 0]

    def _not_soft(self, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` that hold no live soft pin (their bytes are not counted yet)."""
        if not len(self.soft):
            return slots
        return slots[~np.isin(slots, self.soft.live_slots(self._index))]

    def _set_pins_tentatively(self, slots: np.ndarray, pinned: bool) -> Callable[[], None]:
        """Hard-pin (or unpin) these slots in memory; the undo reverses it for those still present
        and still as this left them."""
        index = self._index
        keys = list(zip(index.k0[slots].tolist(), index.k1[slots].tolist()))
        self._set_pinned_in_memory(slots, pinned)

        def undo() -> None:
            found = index.find_many(np.array([k[0] for k in keys], np.uint64),
                                    np.array([k[1] for k in keys], np.uint64))
            found = found[found >= 0]
            self._set_pinned_in_memory(found[((index.meta[found] & np.uint32(PINNED_BIT)) != 0) == pinned], not pinned)
        return undo

    def _set_pinned_in_memory(self, slots: np.ndarray, pinned: bool) -> None:
        index = self._index
        if pinned:
            index.meta[slots] |= np.uint32(PINNED_BIT)
        else:
            index.meta[slots] &= np.uint32(SEQ_DELTA_MAX)
        regions = (index.addr[slots] // np.uint64(self._region_size)).astype(np.int64)
        for region, nbytes in zip(regions.tolist(), index.length[slots].astype(np.int64).tolist()):
            self._table.set_pinned(region, nbytes, pinned)

    # -- records: room first, taken back on failure ------------------------------
    def _targets(self, slots: np.ndarray) -> list[tuple[int, int, int]]:
        """(k0, k1, seq) of these slots: what their records name."""
        index = self._index
        return list(zip(index.k0[slots].tolist(), index.k1[slots].tolist(), self._blocks.seqs_of(slots).tolist()))

    def _room_for_records(self, k0: np.ndarray, k1: np.ndarray, slots: np.ndarray, pick: Pick,
                          apply: Callable[[np.ndarray], Callable[[], None]] | None = None) -> Chosen:
        """Under the engine lock: room in the open region for one record per slot that ``pick``
        chooses of the request's keys' index ``slots``, chosen again after each wait for room.
        Taking room may let go of the lock, and meanwhile other requests may store, pin or unpin
        keys of this one (a reclaim may move or evict their blocks): the records must all go to
        the image open when they are appended (:func:`.take_back.mark_records`), so no more of
        them may be chosen than there is room for. Room is taken for the count chosen; if the
        keys chosen again outnumber it, once more for every distinct key named, which no choice
        exceeds. Returns (slots, chosen, their targets, undo): undo is None unless a DELETE or
        UNPIN found no room (``apply``, see :meth:`_room_with_change_applied`)."""
        count, distinct = len(pick(slots)), None
        while True:
            try:
                self._reserve_records(count)
            except NoSpaceError:
                if apply is None:
                    raise
                return self._room_with_change_applied(k0, k1, pick, apply)
            slots = self._index.find_many(k0, k1)
            chosen = pick(slots)
            if self._allocator.appendable(0, len(chosen)):  # the lock held since room was taken
                return slots, chosen, self._targets(chosen), None
            assert distinct is None, f"{len(chosen)} records chosen from {distinct} distinct keys"
            count = distinct = len(np.unique(np.stack([k0, k1], axis=1), axis=0))

    def _room_with_change_applied(self, k0: np.ndarray, k1: np.ndarray, pick: Pick,
                                  apply: Callable[[np.ndarray], Callable[[], None]]) -> Chosen:
        """No room to be had for a DELETE's or UNPIN's records: its change is applied in memory
        first (dropping or unpinning blocks may be what lets a region be reclaimed) to the slots
        chosen now (the failed wait for room let go of the lock), and room is sought again for
        exactly their records. If that fails too, the change is undone and the error raised."""
        slots = self._index.find_many(k0, k1)
        chosen = pick(slots)
        targets = self._targets(chosen)
        undo = apply(chosen)
        try:
            self._reserve_records(len(chosen))
        except BaseException:
            undo()
            raise
        return slots, chosen, targets, undo

    def _room_for_count(self, count: int, apply: Callable[[], Callable[[], None]]) -> Callable[[], None] | None:
        """Room for ``count`` records of a request that appends that many whatever changes meanwhile
        (a namespace delete: one). With none to be had, its change is applied in memory first
        (``apply``, which returns its undo) and room is sought again: dropping blocks may be what
        lets a region be reclaimed. Returns that undo (the change is applied), or None (room was
        found without it); if room cannot be had either way, the change is undone and
        NoSpaceError raised."""
        try:
            self._reserve_records(count)
            return None
        except NoSpaceError:
            undo = apply()
            try:
                self._reserve_records(count)
            except BaseException:
                undo()
                raise
            return undo

    def _forget_tentatively(self, slots: np.ndarray) -> Callable[[], None]:
        """Drop these blocks from the index; the undo puts back those whose region was not reclaimed
        meanwhile, and whose key was not stored again meanwhile."""
        index, table = self._index, self._table
        regions = (index.addr[slots] // np.uint64(self._region_size)).astype(np.int64)
        kept = list(zip(index.k0[slots].tolist(), index.k1[slots].tolist(), index.addr[slots].tolist(),
                        index.length[slots].tolist(), index.meta[slots].tolist(), regions.tolist(),
                        table.base_seq[regions].tolist()))
        self._blocks.forget(slots)

        def undo() -> None:
            back = [row for row in kept
                    if table.state[row[5]] != RegionState.FREE and int(table.base_seq[row[5]]) == row[6]]
            if back:
                absent = index.find_many(np.array([r[0] for r in back], np.uint64),
                                         np.array([r[1] for r in back], np.uint64)) < 0
                back = [row for row, gone in zip(back, absent.tolist()) if gone]
            for k0_, k1_, addr, length, meta, region, _ in back:
                index.insert(k0_, k1_, addr, length, meta)
                table.add_block(region, length, bool(meta & PINNED_BIT))
            if back:
                self._blocks.events.blocks_stored(np.array([r[0] for r in back], np.uint64),
                                                  np.array([r[1] for r in back], np.uint64))
        return undo

    def _reserve_records(self, count: int) -> None:
        """Room in the open region for ``count`` more records (opening or reclaiming a region
        if needed; NoSpaceError changes nothing the caller did)."""
        if count * fmt.ENTRY_BYTES > self._allocator.capacity_bytes:
            raise EngineError(f"{count} keys in one request need {count * fmt.ENTRY_BYTES} bytes of records, more "
                              f"than a region holds ({self._allocator.capacity_bytes}); send fewer keys at once")
        self._allocator.ensure_room(0, count)

    def _append_records(self, records: list[tuple], undo: Callable[[], None]) -> AppendedRecords:
        """Append (kind, k0, k1, ns, target_seq) records, room for them reserved and the change
        already applied in memory (``undo`` takes it back if appending raises)."""
        assert self._allocator.reservation is None and self._allocator.appendable(0, len(records)), \
            f"{len(records)} records to append, more than the room reserved: some would go to another region"
        appended = mark_records(self._allocator, self._table)
        with self._records_or_nothing(undo):
            self._durability.write_records(records)
        appended.end = appended.image.entry_count
        self._unsettled += 1
        return appended

    def _commit_records(self, appended: AppendedRecords, undo: Callable[[], None]) -> None:
        """Make the appended records durable by a group commit, without the lock; if it fails,
        the change is undone in memory and the records taken back (:mod:`.take_back`)."""
        try:
            self._durability.commit(with_entries=True)
        except DeviceError:
            with self._lock:
                take_back_failed_records(self._allocator, self._table, self._durability, appended, self._region_size)
                undo()
            raise
        finally:
            with self._lock:
                self._unsettled -= 1

    def _after_unsettled(self, settle: bool, slots: np.ndarray) -> list[bool]:
        """The answer of a request that changed nothing because another one's change, applied in
        memory, is not durable yet: it waits for that change's commit (``settle``), without the lock."""
        if settle:
            self._durability.commit(with_entries=True)
        return (slots >= 0).tolist()

    def _records_or_nothing(self, undo: Callable[[], None] | None = None):
        """Records appended inside this block are taken back out of the open image if it raises
        (with room reserved first, they all go to the image open on entry), and ``undo`` is run."""
        assert self._allocator.active, "records appended with no open region (reserve room first)"
        return appends_or_nothing(self._allocator, self._table, self._region_size, self._durability.cover,
                                  undo)
