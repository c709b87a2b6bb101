"""Hot pool: ref counts, prefix sharing, LRU over unreferenced blocks, exact order."""
from __future__ import annotations

import pytest
import torch

from kvtier.client.hot_pool import HotPool, HotPoolIndex
from kvtier.common.keys import KVLayout, Namespace


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(index: HotPoolIndex, key: bytes) -> int:
    slot, fresh = index.reserve(key)
    assert fresh
    index.commit(key)
    index.release([key])
    return slot


def test_slots_are_handed_out_in_order_and_lru_evicts_oldest_unreferenced():
    idx = HotPoolIndex(3)
    assert [fill(idx, k(i)) for i in range(3)] == [0, 1, 2]
    assert idx.lru_order() == [k(0), k(1), k(2)]
    # touching k(0) makes it most recent
    assert idx.acquire_prefix([k(0)]) == [0]
    idx.release([k(0)])
    assert idx.lru_order() == [k(1), k(2), k(0)]
    # a new block takes the slot of the oldest unreferenced block (k(1))
    assert fill(idx, k(3)) == 1
    assert idx.lru_order() == [k(2), k(0), k(3)]
    assert not idx.contains(k(1))
    assert idx.statistics().evictions == 1


def test_referenced_block_is_never_evicted():
    idx = HotPoolIndex(2)
    fill(idx, k(0))
    fill(idx, k(1))
    assert idx.acquire_prefix([k(0), k(1)]) == [0, 1]  # a request holds both
    assert idx.reserve(k(2)) is None  # shortage: a None, not an eviction
    assert idx.statistics().reservations_refused == 1
    idx.release([k(1)])
    # only k(1) is unreferenced, so only k(1) can go
    assert idx.reserve(k(2)) == (1, True)
    idx.commit(k(2))
    idx.release([k(2)])
    assert idx.contains(k(0)) and not idx.contains(k(1)) and idx.contains(k(2))
    assert idx.lru_order() == [k(2)]
    idx.release([k(0)])
    assert idx.lru_order() == [k(2), k(0)]


def test_shared_prefix_is_held_once_and_refcounted():
    idx = HotPoolIndex(4)
    for i in range(3):
        fill(idx, k(i))
    # two requests share the first two blocks
    a = idx.acquire_prefix([k(0), k(1), k(2)])
    b = idx.acquire_prefix([k(0), k(1), k(9)])
    assert a == [0, 1, 2] and b == [0, 1]
    assert idx.statistics().resident_blocks == 3
    assert idx.statistics().referenced_blocks == 3
    idx.release([k(0), k(1), k(2)])
    assert idx.lru_order() == [k(2)]  # k(0), k(1) still held by b
    idx.release([k(0), k(1)])
    assert idx.lru_order() == [k(2), k(0), k(1)]
    # reserving a resident key shares it instead of copying it again
    assert idx.reserve(k(1)) == (1, False)
    idx.release([k(1)])
    assert idx.lru_order() == [k(2), k(0), k(1)]


def test_block_being_filled_is_invisible_and_abort_frees_it():
    idx = HotPoolIndex(2)
    assert idx.reserve(k(5)) == (0, True)
    assert idx.acquire_prefix([k(5)]) == []
    assert idx.reserve(k(5)) is None  # someone else is filling it
    idx.abort(k(5))
    assert not idx.contains(k(5))
    assert idx.statistics().free_blocks == 2


def test_prefix_acquire_stops_at_first_gap():
    idx = HotPoolIndex(4)
    fill(idx, k(0))
    fill(idx, k(2))
    assert idx.acquire_prefix([k(0), k(1), k(2)]) == [0]
    idx.release([k(0)])


def test_caller_errors_raise():
    idx = HotPoolIndex(1)
    with pytest.raises(ValueError, match="not referenced"):
        idx.release([k(0)])
    fill(idx, k(0))
    with pytest.raises(ValueError, match="not referenced"):
        idx.release([k(0)])
    with pytest.raises(ValueError, match="not reserved"):
        idx.commit(k(0))
    with pytest.raises(ValueError, match="capacity"):
        HotPoolIndex(-1)


def test_zero_capacity_pool_refuses_everything():
    idx = HotPoolIndex(0)
    assert idx.reserve(k(0)) is None
    assert idx.acquire_prefix([k(0)]) == []


def test_discard_only_drops_unreferenced():
    idx = HotPoolIndex(2)
    fill(idx, k(0))
    idx.acquire_prefix([k(0)])
    assert not idx.discard(k(0))
    idx.release([k(0)])
    assert idx.discard(k(0))
    assert idx.lru_order() == []
    assert idx.statistics().free_blocks == 2


def _layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_tokens=4)


def test_pool_holds_tensors_and_lease_protects_them():
    layout = _layout()
    pool = HotPool(layout, capacity_bytes=2 * layout.block_raw_bytes)
    assert pool.capacity_blocks == 2
    blocks = [torch.full(layout.block_shape, float(i)) for i in range(3)]
    assert pool.put(k(0), blocks[0]) and pool.put(k(1), blocks[1])
    with pool.lease([k(0), k(1)]) as lease:
        assert lease.hits == 2
        assert torch.equal(lease.block(0), blocks[0]) and torch.equal(lease.block(1), blocks[1])
        assert not pool.put(k(2), blocks[2])  # both held: no room, nothing evicted
    # the lease ended: k(0) was released first, so it is the LRU victim
    assert pool.put(k(2), blocks[2])
    assert not pool.contains(k(0)) and pool.contains(k(1)) and pool.contains(k(2))
    with pool.lease([k(2)]) as lease:
        assert torch.equal(lease.block(0), blocks[2])
    # prefix leases stop at the first gap; per-block leases do not
    with pool.lease([k(0), k(2)]) as lease:
        assert lease.slots[1] is None and lease.hits == 0
    with pool.lease([k(0), k(2)], prefix_only=False) as lease:
        assert lease.block(0) is None and torch.equal(lease.block(1), blocks[2])
    assert pool.statistics().referenced_blocks == 0


def test_lease_is_released_on_exception():
    layout = _layout()
    pool = HotPool(layout, capacity_bytes=layout.block_raw_bytes)
    pool.put(k(0), torch.zeros(layout.block_shape))
    with pytest.raises(RuntimeError):
        with pool.lease([k(0)]):
            raise RuntimeError("request failed")
    assert pool.statistics().referenced_blocks == 0
    assert pool.index.lru_order() == [k(0)]


def test_namespace_keys_share_hot_blocks_across_prompts():
    layout = _layout()
    ns = Namespace("m", layout)
    shared = list(range(8))
    a, b = ns.keys(shared + [100] * 4), ns.keys(shared + [200] * 4)
    pool = HotPool(layout, capacity_bytes=4 * layout.block_raw_bytes)
    for key in a:
        pool.put(key, torch.ones(layout.block_shape))
    for key in b:
        pool.put(key, torch.ones(layout.block_shape))
    # 2 shared blocks held once + one tail block each
    assert pool.statistics().resident_blocks == 4
