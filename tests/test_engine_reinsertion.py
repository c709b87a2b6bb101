"""Reinsertion of hot (frequently read) blocks on region reclaim: the policy in isolation, and
exact eviction order in the engine (hottest first, then region order, within a byte budget)."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.common.blockformat import HEADER_SIZE
from kvtier.daemon.engine import Engine, EngineConfig
from kvtier.daemon.engine.devices import MemoryDevice
from kvtier.daemon.engine.reinsertion import HitsReinsertion, NoReinsertion, make_reinsertion
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

from test_engine import PAYLOAD_5_PER_REGION, REGION, block, fill, key, present, same_block, seal


def hot_engine(hits_min: int, regions: int = 5):  # 4 regions of blocks, 1 the clean reserve
    cfg = EngineConfig(device_paths=("mem0", "mem1"), stripe_size_bytes=REGION // 4, region_size_bytes=REGION,
                       eviction="fifo", reinsertion_hits_min=hits_min)
    devs = [MemoryDevice(DATA_OFFSET_BYTES + regions * REGION // 2, f"mem{i}") for i in range(2)]
    Engine.format(cfg, devices=devs)
    return Engine.open(cfg, devices=devs), cfg, devs


def read(engine, i: int, times: int) -> None:
    for _ in range(times):
        assert engine.get(key(i)) is not None


# -- the policy alone -----------------------------------------------------------
def test_hits_policy_takes_the_hottest_first_then_region_order_within_the_budget():
    policy = HitsReinsertion(hits_min=2)
    hits = np.array([0, 3, 2, 3, 5, 1], np.uint8)
    cost = np.full(6, 10)
    assert np.flatnonzero(policy.select(hits, cost, 25)).tolist() == [1, 4]  # 4 (5 hits), then 1 (3, before 3)
    assert np.flatnonzero(policy.select(hits, cost, 30)).tolist() == [1, 3, 4]
    assert np.flatnonzero(policy.select(hits, cost, 1000)).tolist() == [1, 2, 3, 4]
    assert not policy.select(hits, cost, 9).any()
    assert not NoReinsertion().select(hits, cost, 1000).any()
    assert isinstance(make_reinsertion(0), NoReinsertion) and make_reinsertion(3).hits_min == 3


def test_bad_hits_thresholds_are_refused():
    with pytest.raises(ValueError, match="hits_min"):
        HitsReinsertion(0)
    for bad in (-1, 256):
        with pytest.raises(ValueError, match="reinsertion_hits_min"):
            EngineConfig(device_paths=("a",), reinsertion_hits_min=bad)


# -- the engine ---------------------------------------------------------------
def test_without_the_policy_hot_blocks_are_evicted_with_their_region():
    engine, _, _ = hot_engine(hits_min=0)
    fill(engine, range(20))  # regions 0..3 hold 0-4, 5-9, 10-14, 15-19
    read(engine, 2, 5)
    fill(engine, [20])
    assert present(engine, range(21)) == list(range(5, 21))
    assert engine.statistics().reinsertions == 0
    engine.close()


def test_the_hottest_block_of_a_reclaimed_region_is_moved_in_exact_order():
    engine, _, _ = hot_engine(hits_min=2)
    fill(engine, range(20))
    read(engine, 2, 2)
    read(engine, 4, 3)
    read(engine, 1, 1)  # below the threshold
    old_seq = engine.block_info(key(4))["seq"]
    fill(engine, [20])  # reclaims region 0: room for one 200 KB block (a quarter of a region): the hottest, 4
    assert present(engine, range(21)) == [4] + list(range(5, 21))
    info = engine.block_info(key(4))
    assert info["region"] == 4 and info["seq"] > old_seq and not info["pinned"]  # compacted into the reserve
    assert info["seq"] < engine.block_info(key(20))["seq"]  # moved first, then the put that needed room
    assert same_block(engine.get(key(4)), block(4, PAYLOAD_5_PER_REGION))
    st = engine.statistics()
    assert (st.reinsertions, st.evicted_blocks, st.evicted_regions) == (1, 4, 1)
    engine.close()


def test_a_moved_block_stays_only_while_it_keeps_being_read():
    engine, _, _ = hot_engine(hits_min=2)
    fill(engine, range(20))
    read(engine, 3, 2)
    fill(engine, [20])  # region 0 -> 3 moved (its count is reset: the get above is not counted twice)
    fill(engine, range(21, 24))  # region 0 now holds 3, 20, 21, 22, 23
    read(engine, 7, 2)
    fill(engine, [24])  # region 1 (5-9) -> 7 moved into region 1
    assert present(engine, range(25)) == [3, 7] + list(range(10, 25))
    fill(engine, range(25, 28))  # region 1 holds 7, 24, 25, 26, 27
    read(engine, 12, 2)
    fill(engine, [28])  # region 2 (10-14) -> 12 moved
    fill(engine, range(29, 32))
    read(engine, 3, 1)  # one read since the move: not hot enough
    fill(engine, [32])  # region 3 (15-19) reclaimed, nothing moved
    fill(engine, range(33, 37))
    fill(engine, [37])  # region 0 (3, 20-23) reclaimed: 3 is dropped now
    assert present(engine, [3, 7, 12]) == [7, 12]
    assert engine.statistics().reinsertions == 3
    engine.close()


def test_pinned_and_hot_blocks_move_together_in_region_order_and_survive_a_restart():
    engine, cfg, devs = hot_engine(hits_min=1)
    fill(engine, range(20))
    assert engine.pin_many([key(3)]) == [True]
    read(engine, 1, 4)
    read(engine, 4, 1)  # hot too, but the budget holds one hot block: 1 (4 reads) wins
    fill(engine, [20])
    before = present(engine, range(21))
    assert before[:2] == [1, 3] and 4 not in before and before[-1] == 20
    one, three = engine.block_info(key(1)), engine.block_info(key(3))
    assert one["seq"] < three["seq"] and three["pinned"] and not one["pinned"]  # region order: 1 then 3
    assert engine.statistics().reinsertions == 2
    engine.close()
    engine = Engine.open(cfg, devices=devs)
    assert present(engine, range(21)) == before
    assert engine.block_info(key(3))["pinned"] and not engine.block_info(key(1))["pinned"]
    engine.close()


def test_hot_blocks_never_stop_a_reclaim_from_freeing_room():
    engine, _, _ = hot_engine(hits_min=1, regions=6)
    small = HEADER_SIZE + 20_000
    for i in range(600):
        engine.put(block(i, 20_000))
        engine.get(key(i))  # every block hot
    st = engine.statistics()
    assert st.evicted_regions > 0 and st.reinsertions > 0 and st.alloc_failures == 0
    moved_per_reclaim = st.reinsertions / st.evicted_regions
    assert moved_per_reclaim * (small + 64) <= engine._allocator.capacity_bytes * 0.25
    for i in range(600):
        got = engine.get(key(i))
        assert got is None or same_block(got, block(i, 20_000))
    engine.close()


def test_read_counts_cost_index_memory_only_with_the_policy():
    off, _, _ = hot_engine(hits_min=0)
    on, _, _ = hot_engine(hits_min=2)
    for engine in (off, on):
        fill(engine, range(3))
        read(engine, 1, 300)
    assert on._index.hits[on._index.find_many(*key_halves(1))][0] == 255  # saturates
    assert len(off._index.hits) == 0
    assert on.statistics().index_bytes == off.statistics().index_bytes * 33 // 32
    off.close()
    on.close()


def key_halves(i: int):
    k = key(i)
    return (np.array([int.from_bytes(k[:8], "little")], np.uint64), np.array([int.from_bytes(k[8:], "little")], np.uint64))
