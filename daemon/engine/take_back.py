"""All or nothing: what a failed request appended to the open region is taken back.

A PUT batch, a DELETE, a PIN or an UNPIN appends blocks and metadata records to the open
region's image, then makes them durable. If it fails part way -- a reclaim finds no room
(NoSpaceError), a write or sync fails (DeviceError) -- its caller gets an error, so nothing
of it may stay: :func:`appends_or_nothing` marks the open image before the request appends
and, if the request raises, zeroes what it appended (no later seal or durable write carries
it, no recovery walk finds it) and, where the failure was a device error, writes the zeroed
pages once more so that what a failed write may have left on flash is covered too. Index
changes are the caller's: they come after the appends succeeded, or are undone by the
``undo`` callback.

What is not taken back: what a PUT batch that spans reservations committed before the one
that failed (:mod:`.puts`). That part is indexed, so other clients may have seen it: a LOOKUP
that skipped its own store, a durable PUT of the same key answered from it.

A durable PUT whose group commit fails (:func:`take_back_failed_commit`) cannot be zeroed
either: the commit ran without the lock, other writers' blocks may share its pages and follow
it in the region (zeroing would cut recovery's walk short of them), and after a failed
fdatasync what reached flash is unknown. So its blocks leave the index and a tombstone for
each (its seq) goes into the open region's summary: written at once (best effort: the device
just failed) and by every later commit until one succeeds (``Durability.owe_entries``).
From the first write that lands, no restart serves them; until then a crash may bring
them back.

A DELETE, PIN or UNPIN whose group commit fails (:func:`take_back_failed_records`) has its
change undone in memory by its caller, and its records -- none acknowledged -- are taken back
once no commit is in flight: zeroed as above if nothing was appended after them (the zeroed
pages written once more, best effort), else rewritten in place as tombstones that name no
block (target seq 0), so the entries after them keep their places; those are written at once
(best effort) and, the image's durable mark moved back before them, by every later commit
until one succeeds (``Durability.owe_entries``). Until a write of them lands, a crash may
apply them. Records in a region sealed meanwhile cannot be taken back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvtier.common.aligned import align_down, align_up

from . import regionfmt as fmt
from .allocator import Allocator
from .blockmap import BlockMap
from .durability import Durability
from .errors import DeviceError
from .regions import RegionTable


class appends_or_nothing:  # noqa: N801 (used as a context manager, like contextlib's)
    """Callers hold the engine lock throughout (the mark is only good while nobody else appends).
    ``cover``: queues (logical offset, buffer) ranges to write and sync (``Durability.cover``).
    A class, not a generator: every PUT enters one."""

    __slots__ = ("_allocator", "_table", "_region_size", "_cover", "_undo", "_image", "_mark")

    def __init__(self, allocator: Allocator, table: RegionTable, region_size_bytes: int,
                 cover: Callable[[list], None], undo: Callable[[], None] | None = None):
        self._allocator, self._table, self._region_size = allocator, table, region_size_bytes
        self._cover, self._undo = cover, undo
        self._image = allocator.open if allocator.active else None
        self._mark = None

    def __enter__(self) -> "appends_or_nothing":
        self._take_mark()
        return self

    def _take_mark(self) -> None:
        image = self._image
        if image is not None:
            region = image.region
            self._mark = (region, image.data_end, image.entry_count, image.last_seq, int(self._table.last_seq[region]),
                          len(self._table.meta_records.get(region, ())))

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None:
            return False
        if self._undo is not None:
            self._undo()
        allocator, table, image = self._allocator, self._table, self._image
        if image is not None and allocator.active and allocator.open is image and image.region == self._mark[0] \
                and allocator.reservation is None:
            region, data_end, entries, last_seq, table_last_seq, records_kept = self._mark
            ranges = image.take_back(data_end, entries, last_seq)
            table.last_seq[region] = table_last_seq
            if region in table.meta_records:
                del table.meta_records[region][records_kept:]
            if ranges and isinstance(exc, DeviceError):
                _cover(self._cover, region * self._region_size, image, ranges)
        return False


def _cover(cover: Callable[[list], None], base: int, image, ranges) -> None:
    """Queue the zeroed pages of a failed request to be written once more (Durability.cover: on the
    sealer thread, best effort: the device just failed, and the request's own error is what the
    caller gets)."""
    cover([(base + start, image.flash_copy(start, end)) for start, end in ranges])


def forget_new_keys(blocks: BlockMap, k0s: np.ndarray, k1s: np.ndarray) -> Callable[[], None]:
    """An ``undo`` for a PUT's commit: drop its keys from the index (all were absent when it was
    reserved, and no other writer stores a key while a reservation is in flight)."""
    def undo() -> None:
        slots = blocks.index.find_many(k0s, k1s)
        blocks.forget(np.unique(slots[slots >= 0]))
    return undo


def take_back_failed_commit(blocks: BlockMap, allocator: Allocator, durability: Durability, placed: list[tuple],
                            region_size_bytes: int) -> None:
    """After a durable PUT's commit failed (under the lock, let go of since): ``placed`` is the
    (k0, k1, addr, seq) of its blocks. Those still indexed there (same seq) leave the index, but not one a
    later commit made durable meanwhile (another caller's PUT of the same key was acknowledged);
    each one dropped, or evicted meanwhile (its bytes may still be on flash), gets a tombstone.
    Raises what appending them raises (NoSpaceError: no room for a record; DeviceError: a seal
    that room needs failed): the caller then fails the engine closed. The caller commits them,
    without the lock."""
    k0, k1, addr, seq = (np.array(col, np.uint64) for col in zip(*placed))
    index = blocks.index
    slots = index.find_many(k0, k1)
    found = slots >= 0
    doomed = found.copy()
    doomed[found] = (index.addr[slots[found]] == addr[found]) & (blocks.seqs_of(slots[found]) == seq[found])
    for i in np.flatnonzero(doomed).tolist():
        doomed[i] = not _durable_now(allocator, int(addr[i]), int(index.length[slots[i]]), region_size_bytes)
    blocks.forget(slots[doomed])
    for i in np.flatnonzero(doomed | ~found).tolist():
        durability.record(fmt.KIND_TOMBSTONE, int(k0[i]), int(k1[i]), fmt.NO_NAMESPACE, int(seq[i]))
    durability.owe_entries()  # the caller's next commit (without the lock) writes them, and every later one until one succeeds


def _durable_now(allocator: Allocator, addr: int, length: int, region_size_bytes: int) -> bool:
    """Whether a block is on flash and synced: within the open image's synced prefix, or in a
    sealed region (no DRAM image) with every seal synced."""
    region = addr // region_size_bytes
    image = allocator.image_of(region)
    if image is None:
        return not allocator.unsynced_writes
    return image is allocator.open and addr - region * region_size_bytes + length <= image.durable_end


@dataclass
class AppendedRecords:
    """Where a request's metadata records lie in the open image (taken under the lock)."""

    image: object
    region: int
    base_seq: int
    first: int  # the entry number of the first of them
    end: int
    last_seq: int  # the image's last seq before them
    table_last_seq: int
    records_kept: int  # the region's table.meta_records before them


def mark_records(allocator: Allocator, table: RegionTable) -> AppendedRecords:
    """Before a request appends its records (room for all of them reserved: they go to this image)."""
    image = allocator.open
    region = image.region
    return AppendedRecords(image, region, image.base_seq, image.entry_count, image.entry_count, image.last_seq,
                           int(table.last_seq[region]), len(table.meta_records.get(region, ())))


def take_back_failed_records(allocator: Allocator, table: RegionTable, durability: Durability,
                             appended: AppendedRecords, region_size_bytes: int) -> None:
    """After the commit that was to make these records durable failed (under the lock; let go
    of while a commit is in flight, so that none lands an older copy of them after this)."""
    durability.wait_for_commits()
    image = appended.image
    if not (allocator.active and allocator.open is image and (image.region, image.base_seq) ==
            (appended.region, appended.base_seq)) or appended.end == appended.first:
        return
    image.wait_io_idle()
    image.durable_entries = min(image.durable_entries, appended.first)
    records = table.meta_records.get(appended.region, [])
    if image.entry_count == appended.end and allocator.reservation is None:
        ranges = image.take_back(image.data_end, appended.first, appended.last_seq)
        table.last_seq[appended.region] = appended.table_last_seq
        del records[appended.records_kept:]
    else:
        start = fmt.entry_position(image.size_bytes, appended.end - 1)
        end = fmt.entry_position(image.size_bytes, appended.first) + fmt.ENTRY_BYTES
        for number in range(appended.first, appended.end):
            position = fmt.entry_position(image.size_bytes, number)
            k0, k1, _, seq, *_ = fmt.ENTRY_STRUCT.unpack_from(image.buffer, position)
            fmt.pack_entry(image.buffer, position, k0, k1, fmt.NO_NAMESPACE, seq, 0, 0, 0, fmt.KIND_TOMBSTONE)
        mine = range(appended.records_kept, appended.records_kept + appended.end - appended.first)
        for i in mine if mine.stop <= len(records) else ():
            k0, k1, _, _, seq, _ = records[i]
            records[i] = (fmt.KIND_TOMBSTONE, k0, k1, fmt.NO_NAMESPACE, seq, 0)
        ranges = [(align_down(start), align_up(end))]
        durability.owe_entries()
    _cover(durability.cover, appended.region * region_size_bytes, image, ranges)
