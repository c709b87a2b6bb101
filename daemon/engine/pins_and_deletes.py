"""Deletes and pins: the index and the region table change at once, and a metadata record in
the open region's summary -- a tombstone, namespace tombstone, pin or unpin -- makes each
change last. Every call is durable when it returns (its records are written and synced).
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np

from . import regionfmt as fmt
from .allocator import Allocator
from .blockmap import BlockMap
from .durability import Durability
from .errors import EngineError
from .index import PINNED_BIT, SEQ_DELTA_MAX
from .raid0 import StripedArray
from .recovery import read_region_entries
from .regions import RegionState
from .seqs import SeqCounter


class PinsAndDeletes:
    def __init__(self, blocks: BlockMap, allocator: Allocator, durability: Durability, array: StripedArray,
                 lock: threading.RLock, seqs: SeqCounter, check_open: Callable[[], None], region_size_bytes: int):
        self._blocks = blocks
        self._index, self._table = blocks.index, blocks.table
        self._allocator = allocator
        self._durability = durability
        self._array = array
        self._lock = lock
        self._seqs = seqs
        self._check_open = check_open  # raises once the engine is closed
        self._region_size = region_size_bytes

    def delete_many(self, keys: Sequence) -> list[bool]:
        if not len(keys):
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        with self._lock:
            self._check_open()
            self._allocator.wait_unreserved()
            slots = self._index.find_many(k0, k1)
            found = slots >= 0
            unique = np.unique(slots[found])
            doomed = list(zip(self._index.k0[unique].tolist(), self._index.k1[unique].tolist(),
                              self._blocks.seqs_of(unique).tolist()))
            self._blocks.forget(unique)
            for k0_, k1_, seq in doomed:  # recording may open/reclaim regions: slots are not used past here
                self._durability.record(fmt.KIND_TOMBSTONE, k0_, k1_, fmt.NO_NAMESPACE, seq)
            if doomed:
                self._durability.persist_records()
        return found.tolist()

    def set_pinned(self, keys: Sequence, pinned: bool) -> list[bool]:
        if not len(keys):
            return []
        k0, k1 = fmt.keys_to_halves(keys)
        index = self._index
        with self._lock:
            self._check_open()
            self._allocator.wait_unreserved()
            slots = index.find_many(k0, k1)
            unique = np.unique(slots[slots >= 0])
            meta = index.meta[unique]
            flip = unique[((meta & np.uint32(PINNED_BIT)) != 0) != pinned]
            if len(flip):
                if pinned:
                    index.meta[flip] |= np.uint32(PINNED_BIT)
                else:
                    index.meta[flip] &= np.uint32(SEQ_DELTA_MAX)
                regions = (index.addr[flip] // np.uint64(self._region_size)).astype(np.int64)
                lengths = index.length[flip].astype(np.int64)
                for region, nbytes in zip(regions.tolist(), lengths.tolist()):
                    self._table.set_pinned(region, nbytes, pinned)
            changed = list(zip(index.k0[flip].tolist(), index.k1[flip].tolist(),
                               self._blocks.seqs_of(flip).tolist()))
            for k0_, k1_, seq in changed:  # recording may open/reclaim regions: slots are not used past here
                self._durability.record(fmt.KIND_PIN if pinned else fmt.KIND_UNPIN, k0_, k1_, fmt.NO_NAMESPACE, seq)
            if changed:
                self._durability.persist_records()
        return (slots >= 0).tolist()

    def delete_namespace(self, ns_id: bytes) -> int:
        ns_id = bytes(ns_id)
        if len(ns_id) != 16:
            raise EngineError(f"namespace id must be 16 bytes, got {len(ns_id)}")
        ns_void = np.frombuffer(ns_id, "V16")[0]
        allocator = self._allocator
        with self._lock:
            self._check_open()
            self._allocator.wait_unreserved()
            allocator.reap_seal(wait=True)
            doomed = []
            for region in range(self._table.region_count):
                state = self._table.state[region]
                if state == RegionState.FREE:
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
            slots = np.unique(np.concatenate(doomed)) if doomed else np.zeros(0, np.int64)
            self._blocks.forget(slots)
            k0, k1 = fmt.key_to_halves(ns_id)
            self._durability.record(fmt.KIND_NS_TOMBSTONE, k0, k1, ns_id, self._seqs.next)
            self._durability.persist_records()
        return int(len(slots))
