"""Durability ordering: what is written and synced, in which order, before a promise returns.

A buffered put is a cache entry: its region is written at seal but not synced, and a sealed
region whose bytes did not all reach flash only yields misses (every read verifies). Whoever
promises durability -- flush, close, a durable put, a delete, a pin, a reclaim that moves
pinned blocks or records -- calls :meth:`Durability.make_durable`. Metadata records
(tombstones, pins) are summary entries of the open region; :meth:`Durability.record` appends
one, :meth:`Durability.persist_records` makes them last.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import DeviceError
from .raid0 import StripedArray
from .regions import RegionTable
from .seqs import SeqCounter
from .statistics import EngineCounters

if TYPE_CHECKING:
    from .allocator import Allocator


def write_and_sync(array: StripedArray, ranges, counters: EngineCounters) -> None:
    """Write (logical offset, buffer) ranges and fdatasync the devices they touched."""
    try:
        touched = array.write_ranges(ranges)
        array.sync(touched)
    except DeviceError:
        counters.device_errors += 1
        raise


class Durability:
    """Callers hold the engine lock."""

    def __init__(self, allocator: Allocator, array: StripedArray, table: RegionTable, seqs: SeqCounter,
                 counters: EngineCounters, region_size_bytes: int):
        self._allocator = allocator
        self._array = array
        self._table = table
        self._seqs = seqs
        self._counters = counters
        self._region_size = region_size_bytes

    def make_durable(self, with_entries: bool = False) -> None:
        """Write the open region's unsynced prefix (and, ``with_entries``, its new summary entries:
        metadata records, flags of reinserted blocks) and fdatasync -- every device if seals or
        region headers were written since the last sync, else the devices just written."""
        allocator = self._allocator
        if allocator.unsynced_writes:
            allocator.reap_seal(wait=True)
        image = allocator.open
        ranges = []
        if allocator.active:
            ranges = [image.unsynced_prefix()] + ([image.unsynced_tail()] if with_entries else [])
            ranges = [(start, end) for start, end in ranges if start < end]
        try:
            base = image.region * self._region_size
            if len(ranges) == 2:
                # entries first, synced: a torn write then never leaves a moved block on flash (newer
                # than its old copy) without its pinned flag; an entry whose block is missing is ignored.
                # Region headers written since the last sync go first: entries (and the zeroed trailer
                # of the image) must not land under an older header (see Allocator.start_region)
                if allocator.unsynced_writes:
                    self._array.sync()
                    allocator.unsynced_writes = 0
                start, end = ranges.pop()
                self._array.sync(self._array.write_ranges([(base + start, image.buffer[start:end])]))
            touched = self._array.write_ranges([(base + start, image.buffer[start:end]) for start, end in ranges])
            if allocator.unsynced_writes:
                self._array.sync()
            elif touched:
                self._array.sync(touched)
        except DeviceError:
            self._counters.device_errors += 1
            raise
        allocator.unsynced_writes = 0
        if allocator.active:
            image.durable_end = image.data_end
            if with_entries:
                image.durable_entries = image.entry_count

    def persist_records(self) -> None:
        """Make the metadata records appended so far durable."""
        self.make_durable(with_entries=True)

    def sync_before_dropping(self, region: int, kept: int) -> None:
        """Before ``region``'s header is rewritten with fewer of its records carried than it holds:
        make every write so far durable. Whether a record is still needed was judged from the
        region table, i.e. from the writes issued so far (region headers, seals); a crash must not
        bring back an older state of flash in which the dropped record would still matter."""
        if self._allocator.unsynced_writes and kept < len(self._table.meta_records.get(region, [])):
            self.make_durable()

    def write_and_sync(self, ranges) -> None:
        write_and_sync(self._array, ranges, self._counters)

    def write_records(self, records: list[tuple]) -> None:
        """Append (kind, k0, k1, ns, target_seq) records to the open region's summary."""
        for kind, k0, k1, ns, target_seq in records:
            self.record(kind, k0, k1, ns, target_seq)

    def record(self, kind: int, k0: int, k1: int, ns: bytes, target_seq: int) -> None:
        """Append a metadata record to the open region's summary (durable at the next
        :meth:`make_durable` with entries, or at the seal)."""
        allocator = self._allocator
        allocator.ensure_room(0)
        seq = self._seqs.take()
        allocator.open.append_meta(kind, k0, k1, ns, seq, target_seq)
        self._table.last_seq[allocator.open.region] = seq
        self._table.meta_records.setdefault(allocator.open.region, []).append((kind, k0, k1, ns, seq, target_seq))
