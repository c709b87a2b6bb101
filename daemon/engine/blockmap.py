"""The index and the region table, kept in step (pure, no I/O).

The index holds a block's address and ``seq - base_seq`` of its region; the region table
holds the base. A block's seq, its region and dropping it need both.
"""
from __future__ import annotations

import numpy as np

from .block_events import NO_LISTENER, BlockListener
from .deleted_keys import DeletedKeys
from .index import PINNED_BIT, SEQ_DELTA_MAX, BlockIndex
from .regions import RegionTable


class BlockMap:
    def __init__(self, index: BlockIndex, table: RegionTable, region_size_bytes: int):
        self.index = index
        self.table = table
        self._region_size = region_size_bytes
        self.events: BlockListener = NO_LISTENER  # told of every index change (block_events)
        self.deleted = DeletedKeys()  # deleted lately; a key stored again leaves it

    def seq_of(self, slot: int) -> int:
        region = int(self.index.addr[slot]) // self._region_size
        return int(self.table.base_seq[region]) + int(self.index.meta[slot] & np.uint32(SEQ_DELTA_MAX))

    def seqs_of(self, slots: np.ndarray) -> np.ndarray:
        regions = (self.index.addr[slots] // np.uint64(self._region_size)).astype(np.int64)
        return self.table.base_seq[regions] + (self.index.meta[slots] & np.uint32(SEQ_DELTA_MAX)).astype(np.uint64)

    def forget(self, slots: np.ndarray) -> None:
        """Drop these blocks from the index and from their regions' accounting."""
        if not len(slots):
            return
        regions = (self.index.addr[slots] // np.uint64(self._region_size)).astype(np.int64)
        pinned = (self.index.meta[slots] & np.uint32(PINNED_BIT)) != 0
        self.table.drop_blocks(regions, self.index.length[slots].astype(np.int64), pinned)
        self.events.blocks_removed(self.index.k0[slots], self.index.k1[slots])
        self.index.remove(slots)

    def resolve(self, k0: np.ndarray, k1: np.ndarray, image_regions: list[int],
                count_hits: bool = False, durable_ends: list[int] | None = None) -> tuple[np.ndarray, ...]:
        """One vectorized pass: (hit, addr, length, seq, sealed) -- the positions of the keys found
        and, for each, its location (``sealed`` False for a block of ``image_regions``, the regions
        held in a DRAM image -- unless it ends within that image's ``durable_ends`` entry, the
        bytes of it already written in place and synced: then it is on flash too).
        ``count_hits``: a read, counted for reinsertion."""
        slots = self.index.find_many(k0, k1)
        hit = np.flatnonzero(slots >= 0)
        found = slots[hit]
        if count_hits:
            self.index.count_hits(found)
        addr = self.index.addr[found]
        region = addr // np.uint64(self._region_size)
        sealed = np.ones(len(hit), bool)
        for i, image_region in enumerate(image_regions):
            in_image = region == np.uint64(image_region)
            if durable_ends is not None:
                end = np.uint64(image_region * self._region_size + durable_ends[i])
                in_image &= addr + self.index.length[found].astype(np.uint64) > end
            sealed &= ~in_image
        seq = self.table.base_seq[region] + (self.index.meta[found] & np.uint32(SEQ_DELTA_MAX)).astype(np.uint64)
        return hit, addr, self.index.length[found], seq, sealed

    def insert_appended(self, pending: list[tuple]) -> None:
        """Index blocks just appended -- (k0, k1, addr, length, seq delta) each -- in one batch."""
        if not pending:
            return
        k0, k1, addr, length, delta = zip(*pending)
        assert max(delta) <= SEQ_DELTA_MAX, max(delta)
        k0s, k1s = np.array(k0, np.uint64), np.array(k1, np.uint64)
        self.index.insert_many(k0s, k1s, np.array(addr, np.uint64), np.array(length, np.uint32),
                               np.array(delta, np.uint32))
        self.events.blocks_stored(k0s, k1s)
        self.deleted.forget(k0s, k1s)
        pending.clear()
