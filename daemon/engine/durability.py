"""Durability ordering: what is written and synced, in which order, before a promise returns.

A buffered put is a cache entry: its region is written at seal but not synced, and a sealed
region whose bytes did not all reach flash only yields misses (every read verifies). Whoever
promises durability -- flush, a durable put, a delete, a pin, a reclaim that moves pinned
blocks or records -- waits for a commit: the open region's filled prefix not yet durable (and,
with entries, its new summary entries: metadata records, flags of moved blocks) written in
place and the devices synced. A FLUSH is a commit: it seals nothing.

Group commit (:meth:`Durability.commit`, called without the engine lock): one commit runs at
a time; every caller that arrives while one is in flight waits for the next, which one of
them runs for all (one fdatasync acknowledges every durable write waiting on it). A commit
takes a snapshot under the lock -- the ranges to write, copies of the partly filled pages (a
writer may be filling them), a pin on the image for the whole pages it writes in place -- and
does its writes and syncs without it, so no reader or writer waits behind a sync.

Order within a commit, as before: seals and region headers issued earlier must be complete
and synced before summary entries are written (entries must not land under an older header,
see Allocator.start_region); entries are synced before the blocks they flag (a torn write
then never leaves a moved block on flash, newer than its old copy, without its pinned flag).

A commit that fails raises DeviceError to every caller it covered; a durable PUT among them
then takes its blocks back with tombstones (take_back.take_back_failed_commit), which every
later commit writes (:meth:`Durability.owe_entries`) until one succeeds.

Metadata records (tombstones, pins) are summary entries of the open region;
:meth:`Durability.record` appends one; a DELETE, PIN or UNPIN makes them last by a group
commit with entries. Only :meth:`Durability.make_durable`, at close, writes under the lock.
"""
from __future__ import annotations

import threading
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.common.aligned import align_down, align_up

from .errors import DeviceError
from .openregion import OpenRegion
from .raid0 import StripedArray
from .regions import RegionTable
from .seqs import SeqCounter
from .statistics import EngineCounters

if TYPE_CHECKING:
    from .allocator import Allocator

COMMIT_RESULTS_KEPT = 64  # failed commits remembered for the callers that waited on them


def write_and_sync(array: StripedArray, ranges, counters: EngineCounters) -> None:
    """Write (logical offset, buffer) ranges and fdatasync the devices they touched."""
    try:
        touched = array.write_ranges(ranges)
        array.sync(touched)
    except DeviceError:
        counters.device_errors += 1
        raise


@dataclass
class CommitSnapshot:
    """What one commit writes, taken under the lock."""

    issued: int  # seals and headers issued before it: complete, and synced by the commit
    futures: list
    image: OpenRegion | None = None
    region: int = -1
    base_seq: int = 0
    data_end: int = 0
    entry_count: int = 0
    in_place: tuple[int, memoryview] | None = None  # whole pages of blocks, written from the pinned image
    copied: list[tuple[int, memoryview]] = field(default_factory=list)  # the partly filled prefix page
    entries: tuple[int, memoryview] | None = None  # summary entries (a copy)


class Durability:
    def __init__(self, allocator: Allocator, array: StripedArray, table: RegionTable, seqs: SeqCounter,
                 counters: EngineCounters, region_size_bytes: int, lock: threading.RLock | None = None):
        self._allocator = allocator
        self._array = array
        self._table = table
        self._seqs = seqs
        self._counters = counters
        self._region_size = region_size_bytes
        self._lock = lock or threading.RLock()
        self._commit_done = threading.Condition(self._lock)
        self._started = 0  # commits started so far (commit n covers what was appended before it started)
        self._done = 0
        self._in_flight = False
        self._entries_wanted = False  # a caller waiting for the next commit wants summary entries too
        self._entries_owed_from: int | None = None  # commits from this number on carry entries until one succeeds
        self._failed: dict[int, DeviceError] = {}

    # -- group commit, without the engine lock -----------------------------------
    def commit(self, with_entries: bool = False) -> None:
        """Make durable everything appended before this call (the open region's prefix, and with
        ``with_entries`` its summary entries; seals and headers issued before it). Call without the
        engine lock; raises DeviceError if the commit that covers this call failed."""
        with self._lock:
            mine = self._started + 1  # the first commit to start from now on covers this call
            self._entries_wanted |= with_entries
            while self._done < mine:
                if not self._in_flight and self._started < mine:
                    self._lead()
                    continue
                self._commit_done.wait()
            error = self._failed.get(mine)
            self._counters.durable_commit_waiters += 1
        if error is not None:
            raise error

    def _lead(self) -> None:
        """Run the next commit for everyone waiting on it (called under the lock, which is let
        go while it waits for seal and header writes, and during its own writes and syncs)."""
        self._started += 1
        number, self._in_flight = self._started, True
        error = None
        snap = None
        owed = wanted = False
        try:
            self._wait_for_issued_writes()
            owed = self._entries_owed_from is not None and number >= self._entries_owed_from
            wanted, self._entries_wanted = self._entries_wanted, False
            snap = self._snapshot(wanted or owed)
            self._lock.release()
            try:
                self._write(snap)
            finally:
                if snap.image is not None:
                    snap.image.unpin_io()  # before taking the lock: a locked writer may wait for this
                self._lock.acquire()
        except DeviceError as exc:
            error = exc
        try:
            if error is None:
                self._publish(snap)
                if owed and self._entries_owed_from is not None and number >= self._entries_owed_from:
                    self._entries_owed_from = None  # owed since before this commit began: all written
            else:
                # callers of the next commit may have asked for entries before this one took them
                self._entries_wanted |= wanted
                self._counters.device_errors += 1
                self._failed[number] = error
                self._failed.pop(number - COMMIT_RESULTS_KEPT, None)
        finally:
            self._done, self._in_flight = number, False
            self._counters.group_commits += 1
            self._commit_done.notify_all()

    def _wait_for_issued_writes(self) -> None:
        """Until every seal and region header issued so far is written (under the lock, let go
        while waiting; a failed write is retried on the sealer thread, see Allocator.reap_seal)."""
        allocator = self._allocator
        while True:
            futures = allocator.pending_writes()
            if not futures and not allocator.write_failed():
                return
            self._lock.release()
            try:
                wait_futures(futures)
            finally:
                self._lock.acquire()
            failed = allocator.write_failed() or \
                any(f.done() and f.exception() is not None for f in allocator.pending_writes())
            allocator.reap_seal(wait=failed)
            if not failed and all(f.done() for f in allocator.pending_writes()):
                allocator.reap_seal(wait=True)  # all complete: reaping does not wait
                return

    def _snapshot(self, with_entries: bool) -> CommitSnapshot:
        allocator = self._allocator
        snap = CommitSnapshot(allocator.writes_issued, [])
        if not allocator.active:
            return snap
        image = allocator.open
        base = image.region * self._region_size
        snap.image, snap.region, snap.base_seq = image, image.region, image.base_seq
        snap.data_end, snap.entry_count = image.data_end, image.entry_count
        if image.data_end > image.durable_end:
            start, whole_end = align_down(image.durable_end), align_down(image.data_end)
            if whole_end > start:  # whole pages of placed blocks: they do not change until the image is reset
                snap.in_place = (base + start, image.buffer[start:whole_end])
            end = align_up(image.data_end)
            if end > whole_end:  # the page the next block is being copied into
                snap.copied.append((base + whole_end, image.flash_copy(whole_end, end)))
        # a block whose entry flags it (a moved pinned block) never reaches flash before that entry:
        # else a crash could leave it there, newer than its old copy, and not pinned
        with_entries = with_entries or image.flagged_entries > image.durable_entries
        if with_entries and image.entry_count > image.durable_entries:
            start, end = image.unsynced_tail()
            snap.entries = (base + start, image.flash_copy(start, end))
        image.pin_io()  # no reset, seal or locked write of this image lands before these writes are done
        return snap

    def _write(self, snap: CommitSnapshot) -> None:
        """The commit's I/O, without the lock (see the module doc for the order). Every seal and
        header counted in ``snap.issued`` is complete (:meth:`_wait_for_issued_writes`)."""
        array = self._array
        unsynced = snap.issued > self._allocator.writes_synced
        if snap.entries is not None:
            if unsynced:
                array.sync()
                unsynced = False
            array.sync(array.write_ranges([snap.entries]))
        prefix = ([snap.in_place] if snap.in_place is not None else []) + snap.copied
        touched = array.write_ranges(prefix) if prefix else set()
        if prefix:  # before unpin_io: a seal of this image, waiting for that, then writes only what follows
            snap.image.written_end = max(snap.image.written_end, snap.data_end)
        if unsynced:
            array.sync()
        elif touched:
            array.sync(touched)

    def _publish(self, snap: CommitSnapshot) -> None:
        self._allocator.mark_synced(snap.issued)
        image = snap.image
        if image is None or not self._allocator.active or self._allocator.open is not image or \
                (image.region, image.base_seq) != (snap.region, snap.base_seq):
            return  # sealed meanwhile: its seal covers the rest
        image.durable_end = max(image.durable_end, snap.data_end)
        if snap.entries is not None:
            image.durable_entries = max(image.durable_entries, snap.entry_count)

    # -- under the engine lock --------------------------------------------------
    def make_durable(self, with_entries: bool = False) -> None:
        """As :meth:`commit`, for a caller holding the engine lock across what it promises (the
        writes and syncs then happen under the lock)."""
        allocator = self._allocator
        if allocator.active:
            allocator.open.wait_io_idle()  # a commit in flight must not land its older copies after these
        if allocator.unsynced_writes:
            allocator.reap_seal(wait=True)
        issued = allocator.writes_issued
        image = allocator.open
        ranges = []
        if allocator.active:
            ranges = [image.unsynced_prefix()] + ([image.unsynced_tail()] if with_entries else [])
            ranges = [(start, end) for start, end in ranges if start < end]
        try:
            base = image.region * self._region_size
            if with_entries and len(ranges) and ranges[-1] == image.unsynced_tail():
                if allocator.unsynced_writes:
                    self._array.sync()
                    allocator.mark_synced(issued)
                start, end = ranges.pop()
                self._array.sync(self._array.write_ranges([(base + start, image.flash_copy(start, end))]))
            touched = self._array.write_ranges([(base + offset, view) for start, _ in ranges  # the prefix
                                                for offset, view in _prefix_writes(image, start)])
            if allocator.unsynced_writes:
                self._array.sync()
            elif touched:
                self._array.sync(touched)
        except DeviceError:
            self._counters.device_errors += 1
            raise
        allocator.mark_synced(issued)
        if with_entries:
            self._entries_owed_from = None  # every record so far is on flash: sealed, or just written
        if allocator.active:
            image.durable_end = image.data_end
            if with_entries:
                image.durable_entries = image.entry_count

    def wait_for_commits(self) -> None:
        """Until no commit is in flight (under the lock, let go of while waiting)."""
        while self._in_flight:
            self._commit_done.wait()

    def owe_entries(self) -> None:
        """Records were appended that must last though their caller got no promise (tombstones for
        the blocks of a failed commit): every commit from the next one on writes the summary
        entries too, until one succeeds. Under the lock."""
        self._entries_owed_from = self._started + 1  # not one in flight: its snapshot may predate them

    def write_and_sync(self, ranges) -> None:
        write_and_sync(self._array, ranges, self._counters)

    def cover(self, ranges) -> None:
        """Queue the zeroed pages of a request taken back for the sealer thread (under the lock, no
        I/O here); every later commit and seal lands after them (Allocator.queue_cover)."""
        self._allocator.queue_cover(ranges)

    def write_records(self, records: list[tuple]) -> None:
        """Append (kind, k0, k1, ns, target_seq) records to the open region's summary."""
        for kind, k0, k1, ns, target_seq in records:
            self.record(kind, k0, k1, ns, target_seq)

    def record(self, kind: int, k0: int, k1: int, ns: bytes, target_seq: int) -> None:
        """Append a metadata record to the open region's summary (durable at the next commit with
        entries, or at the seal)."""
        allocator = self._allocator
        allocator.ensure_room(0)
        seq = self._seqs.take()
        allocator.open.append_meta(kind, k0, k1, ns, seq, target_seq)
        self._table.last_seq[allocator.open.region] = seq
        self._table.meta_records.setdefault(allocator.open.region, []).append((kind, k0, k1, ns, seq, target_seq))


def _prefix_writes(image: OpenRegion, start: int) -> list[tuple[int, memoryview]]:
    """The image from ``start`` (page aligned) through the page ``data_end`` falls in, as region
    offsets and views: whole pages where they lie, that page as :meth:`OpenRegion.flash_copy`."""
    whole_end, end = align_down(image.data_end), align_up(image.data_end)
    writes = [(start, image.buffer[start:whole_end])] if whole_end > start else []
    if end > whole_end:
        writes.append((whole_end, image.flash_copy(whole_end, end)))
    return writes
