"""The region manager: reclaim, eviction and reinsertion over the region pool.

When the allocator finds no free region it calls :meth:`RegionManager.reclaim`: the
eviction policy's victim is evicted and opened as the new region, and what must or should
outlive it -- pinned blocks, metadata records still needed, hot blocks the reinsertion
policy picks -- is moved. What it works on, all shared with the engine: the region table
and the index (:class:`.BlockMap`), the allocator (the open region), the durability
ordering, the device array and block reader, and the engine lock, which
:meth:`RegionManager.reclaim` holds throughout.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from kvtier.common.aligned import align_down, align_up, aligned_buffer
from kvtier.common.blockformat import decode_header

from . import regionfmt as fmt
from .allocator import Allocator
from .blockmap import BlockMap
from .durability import Durability
from .errors import NoSpaceError
from .index import PINNED_BIT, SEQ_DELTA_MAX
from .raid0 import StripedArray
from .reader import BlockReader, ReadFailure
from .recovery import seq_span_max
from .regions import RegionState
from .reinsertion import HOT_REINSERT_FRACTION_MAX, ReinsertionPolicy
from .seqs import SeqCounter
from .statistics import EngineCounters


class RegionManager:
    def __init__(self, blocks: BlockMap, allocator: Allocator, durability: Durability, array: StripedArray,
                 reader: BlockReader, lock: threading.RLock, seqs: SeqCounter, counters: EngineCounters,
                 reinsertion: ReinsertionPolicy, region_size_bytes: int):
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

    def reclaim(self) -> None:
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
        with self._lock:
            causes: list[str] = []
            # the region being sealed may be the one to reclaim: the victim must not depend on when its
            # seal write completes (every path below seals the open region, i.e. waits for it anyway)
            self._allocator.reap_seal(wait=True)
            for victim in self._table.victims():
                if self._reclaim_victim(victim, causes):
                    return
            self._counters.alloc_failures += 1
            if not causes:
                raise NoSpaceError(f"no space: every one of the {self._table.sealed_count} sealed regions holds "
                                   f"more pinned bytes than can be moved (unpin or delete blocks)")
            raise NoSpaceError(f"no space: no region could be reclaimed without losing pinned blocks or records: "
                               f"{'; '.join(dict.fromkeys(causes))}")

    def _reclaim_victim(self, victim: int, causes: list[str]) -> bool:
        allocator, durability = self._allocator, self._durability
        moved, unreadable, pinned_ranges = self._read_moved(victim)
        if unreadable:
            causes.append(f"region {victim}: {unreadable} pinned blocks unreadable (device errors)")
            return False
        pinned_moved = [block for block, pinned in moved if pinned]
        records = self._needed_records(victim, {victim})
        if not pinned_moved and not records:
            durability.sync_before_dropping(victim, 0)
            self._evict(victim, len(moved))
            if allocator.active:
                allocator.seal(wait=False)
            allocator.start_region(victim)
            self._move_in(moved, [])
            return True
        nbytes = sum(len(block) for block, _ in moved)
        if allocator.active and allocator.open.room_for(nbytes, len(moved) + len(records)):
            self._evict(victim, len(moved))
            self._move_in(moved, records)
            durability.make_durable(with_entries=True)  # the victim holds nothing needed from here
            allocator.seal(wait=False)
            allocator.start_region(victim)
            return True
        if allocator.active and allocator.open.room_for(0, len(pinned_moved) + len(records)) and \
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
            durability.write_records(staging_records)
            durability.make_durable(with_entries=True)
        durability.sync_before_dropping(staging, len(staging_records))
        if allocator.active:
            allocator.seal(wait=False)
        self._evict(victim, len(moved))
        self._evict(staging, 0)
        allocator.start_region(staging)
        self._stage_copies(pinned_moved, records)
        durability.make_durable(with_entries=True)  # step 1: the pinned blocks and records live in the staging region
        allocator.active = False  # the staging image is given up unsealed (the table frees it at step 3)
        allocator.start_region(victim)
        self._move_in(moved, records)
        durability.make_durable(with_entries=True)  # step 2: ... and in the victim, newer
        # step 3: erase the staging region's header, synced: the table frees the region, so no record
        # is kept for the stale copies it would otherwise still show recovery
        durability.write_and_sync([(staging * self._region_size, aligned_buffer(fmt.REGION_HEADER_BYTES))])
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
        allocator, durability = self._allocator, self._durability
        durability.write_records(records)
        pins = sum(pinned for _, pinned in moved)
        base_seq = self._seqs.next + pins  # taken right after the pin records below
        seqs = [base_seq + 1 + i for i in range(len(moved))]
        for (block, pinned), seq in zip(moved, seqs):
            if pinned:
                k0, k1 = fmt.key_to_halves(decode_header(block).key)
                durability.record(fmt.KIND_PIN, k0, k1, fmt.NO_NAMESPACE, seq)
        durability.make_durable(with_entries=True)  # step 1
        self._evict(victim, len(moved))
        allocator.seal(wait=False)
        assert self._seqs.take() == base_seq and [self._seqs.take() for _ in moved] == seqs, "seqs taken meanwhile"
        image = allocator.open
        image.reset(victim, base_seq, allocator.generation)
        tail = self._summary_start(len(moved))
        image.buffer[tail:] = bytes(self._region_size - tail)
        placed = []
        for (block, pinned), seq in zip(moved, seqs):
            header = decode_header(block)
            k0, k1 = fmt.key_to_halves(header.key)
            offset = image.append_block(memoryview(block), seq, k0, k1, header.ns_id,
                                        fmt.FLAG_PINNED if pinned else 0)
            placed.append((k0, k1, offset, len(block), seq - base_seq, pinned))
        assert image.last_seq - base_seq <= seq_span_max(self._region_size), (base_seq, image.last_seq)
        base = victim * self._region_size
        durability.write_and_sync([(base + fmt.REGION_HEADER_BYTES,
                                    image.buffer[fmt.REGION_HEADER_BYTES:align_up(image.data_end)])])  # step 2
        durability.write_and_sync([(base, image.buffer[:fmt.REGION_HEADER_BYTES])])  # step 3
        durability.write_and_sync([(base + tail, image.buffer[tail:])])  # step 4
        image.durable_end, image.durable_entries = image.data_end, image.entry_count
        self._table.open(victim, base_seq, time.time())
        allocator.active = True
        for k0, k1, offset, nbytes, delta, pinned in placed:
            assert delta <= SEQ_DELTA_MAX, delta
            self._index.insert(k0, k1, base + offset, nbytes, delta | (PINNED_BIT if pinned else 0))
            self._table.add_block(victim, nbytes, pinned)
            self._counters.reinsertions += 1
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
        index = self._index
        lo = victim * self._region_size
        slots = index.slots_in_range(lo, lo + self._region_size)
        slots = slots[np.argsort(index.addr[slots], kind="stable")]  # region order
        meta = index.meta[slots]
        pinned = (meta & np.uint32(PINNED_BIT)) != 0
        hot = np.zeros(len(slots), bool)
        if index.track_hits:  # a reinsertion policy is configured
            unpinned = np.flatnonzero(~pinned)
            cost = index.length[slots[unpinned]].astype(np.int64) + fmt.ENTRY_BYTES
            hot[unpinned] = self._reinsertion.select(index.hits[slots[unpinned]], cost,
                                                     int(self._allocator.capacity_bytes * HOT_REINSERT_FRACTION_MAX))
        moved = pinned | hot
        keep: list[tuple[bytes, bool]] = []
        unreadable = 0
        ranges = [(int(index.addr[slot]) - lo, int(index.addr[slot]) - lo + int(index.length[slot]))
                  for slot in slots[pinned].tolist()]
        for slot, as_pinned in zip(slots[moved].tolist(), pinned[moved].tolist()):
            block = self._reader.read_one(fmt.halves_to_key(index.k0[slot], index.k1[slot]),
                                          int(index.addr[slot]), int(index.length[slot]),
                                          self._blocks.seq_of(slot))
            if isinstance(block, bytes):
                keep.append((block, as_pinned))
            elif block is ReadFailure.CORRUPT:
                self._counters.corrupt_reads += 1  # torn or damaged: dropped, whether pinned or not
            else:
                self._counters.device_errors += 1
                unreadable += as_pinned  # a hot block is only a cache hint; a pinned one is never dropped
        return keep, unreadable, ranges

    def _staging_region(self, victim: int, causes: list[str]) -> int | None:
        """A region to stage the victim's pinned blocks in: reclaimable, no pinned block, and its
        records still needed fit the open region."""
        for region in self._table.victims():
            if region == victim or self._table.pinned_bytes[region]:
                continue
            needed = len(self._needed_records(region, {region}))
            if not needed or (self._allocator.active and self._allocator.open.room_for(0, needed)):
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
        self._counters.evicted_blocks += int(len(slots) - moved)
        self._counters.evicted_regions += 1
        self._table.release(region)

    def _move_in(self, moved: list[tuple[bytes, bool]], records: list[tuple]) -> None:
        """Append moved blocks and records to the open region (durable if any is pinned or a record)."""
        for block, pinned in moved:
            self._allocator.append(memoryview(block), decode_header(block), pinned=pinned)
            self._counters.reinsertions += 1
        self._durability.write_records(records)
        if records or any(pinned for _, pinned in moved):
            self._durability.make_durable(with_entries=True)  # a crash must not unpin what was just moved

    def _stage_copies(self, blocks: list[bytes], records: list[tuple]) -> None:
        """Staging: copies of pinned blocks and records in the open region's image only (index and
        table untouched): recovery finds them if a crash comes before the victim has them."""
        image = self._allocator.open
        for block in blocks:
            header = decode_header(block)
            k0, k1 = fmt.key_to_halves(header.key)
            image.append_block(memoryview(block), self._seqs.take(), k0, k1, header.ns_id, fmt.FLAG_PINNED)
        for kind, k0, k1, ns, target_seq in records:
            image.append_meta(kind, k0, k1, ns, self._seqs.take(), target_seq)

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
                if slot >= 0 and self._blocks.seq_of(slot) == target_seq and \
                        int(self._index.addr[slot]) // self._region_size not in gone:
                    now_pinned = bool(self._index.meta[slot] & np.uint32(PINNED_BIT))
                    out.append((fmt.KIND_PIN if now_pinned else fmt.KIND_UNPIN, k0, k1, ns, target_seq))
        return out
