"""The compact index and the region eviction policies (pure bookkeeping)."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.engine.eviction import FifoPolicy, LruPolicy, make_policy
from kvtier.daemon.engine.index import CAPACITY_MIN, PINNED_BIT, SLOT_BYTES, BlockIndex
from kvtier.daemon.engine.regions import RegionTable


def keys(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False),
            rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False))


def test_scalar_insert_find_remove():
    idx = BlockIndex()
    slot = idx.insert(5, 6, 4096, 100, 7 | PINNED_BIT)
    assert idx.find(5, 6) == slot and idx.find(5, 7) == -1 and len(idx) == 1
    assert (int(idx.addr[slot]), int(idx.length[slot]), int(idx.meta[slot])) == (4096, 100, 7 | PINNED_BIT)
    idx.remove([slot])
    assert idx.find(5, 6) == -1 and len(idx) == 0
    with pytest.raises(AssertionError, match="free slot"):
        idx.remove([slot])


def same_home_keys(idx: BlockIndex, home: int, n: int) -> list[tuple[int, int]]:
    """``n`` keys whose home slot in ``idx`` is ``home``, found by trying random ones."""
    k0, k1 = keys(64 * n * idx.capacity, seed=home)
    at = np.nonzero(idx._home_many(k0, k1) == home)[0][:n]
    assert len(at) == n
    return [(int(k0[i]), int(k1[i])) for i in at]


def test_colliding_home_slots_probe_past_each_other_and_past_deleted_ones():
    idx = BlockIndex()
    same_home = same_home_keys(idx, CAPACITY_MIN - 3, 10)  # all land on the third-last slot
    slots = [idx.insert(k0, k1, i, 64, 0) for i, (k0, k1) in enumerate(same_home)]
    assert slots == [(CAPACITY_MIN - 3 + i) % CAPACITY_MIN for i in range(10)]  # probing wraps around
    idx.remove([slots[3]])
    assert [idx.find(k0, k1) for k0, k1 in same_home] == slots[:3] + [-1] + slots[4:]
    found = idx.find_many(np.array([k for k, _ in same_home], np.uint64), np.array([k for _, k in same_home], np.uint64))
    assert found.tolist() == slots[:3] + [-1] + slots[4:]
    idx.insert(*same_home[3], 3, 64, 0)  # reuses the deleted slot
    assert idx.find(*same_home[3]) == slots[3]


def longest_occupied_run(idx: BlockIndex) -> int:
    occupied = np.concatenate([[0], (idx.length != 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(occupied))
    return int((edges[1::2] - edges[::2]).max()) if len(edges) else 0


def test_keys_that_count_up_spread_over_the_table():
    """Home slots come from a seeded mix of both halves: keys whose first 8 bytes count up
    (a client's own scheme, not kvtier's digests) do not pile into one run of slots, which
    made every absent-key probe walk the whole run. Two tables get different seeds."""
    idx = BlockIndex()
    n = 30_000
    k0, k1 = np.arange(n, dtype=np.uint64), np.full(n, 0x6B65796B65796B65, np.uint64)
    idx.insert_many(k0, k1, np.arange(n, dtype=np.uint64), np.full(n, 64, np.uint32), np.zeros(n, np.uint32))
    assert longest_occupied_run(idx) < 200  # uniform placement at this load: a few dozen
    assert np.all(idx.find_many(k0, k1) >= 0)
    absent = np.arange(n, 2 * n, dtype=np.uint64)
    assert np.all(idx.find_many(absent, k1) == -1)
    assert not np.array_equal(idx._home_many(k0[:64], k1[:64]), BlockIndex()._home_many(k0[:64], k1[:64]))


def test_bulk_insert_grows_and_matches_a_dict():
    k0, k1 = keys(50_000)
    idx = BlockIndex()
    idx.insert_many(k0[:20_000], k1[:20_000], np.arange(20_000, dtype=np.uint64), np.full(20_000, 64, np.uint32),
                    np.zeros(20_000, np.uint32))
    for i in range(20_000, 20_500):  # scalar inserts on top
        idx.insert(int(k0[i]), int(k1[i]), i, 64, 0)
    assert len(idx) == 20_500 and idx.capacity >= 20_500 / 0.75
    found = idx.find_many(k0, k1)
    assert np.all(found[:20_500] >= 0) and np.all(found[20_500:] == -1)
    assert np.array_equal(idx.addr[found[:20_500]], np.arange(20_500, dtype=np.uint64))
    idx.remove(found[:10_000])
    found = idx.find_many(k0, k1)
    assert np.all(found[:10_000] == -1) and np.all(found[10_000:20_500] >= 0)
    assert idx.slots_in_range(15_000, 15_010).size == 10


def test_rehash_drops_deleted_markers_without_growing():
    idx = BlockIndex()
    k0, k1 = keys(5000, seed=1)
    for round_ in range(5):  # insert/delete churn at a steady size
        part = slice(round_ * 1000, (round_ + 1) * 1000)
        idx.insert_many(k0[part], k1[part], np.zeros(1000, np.uint64), np.full(1000, 64, np.uint32),
                        np.zeros(1000, np.uint32))
        idx.remove(idx.find_many(k0[part], k1[part]))
    assert len(idx) == 0 and idx.capacity <= 1024 * 1.5 ** 2


def test_memory_per_block_is_within_budget():
    k0, k1 = keys(300_000, seed=2)
    idx = BlockIndex()
    idx.insert_many(k0, k1, np.zeros(len(k0), np.uint64), np.full(len(k0), 64, np.uint32), np.zeros(len(k0), np.uint32))
    assert idx.nbytes == idx.capacity * SLOT_BYTES
    assert idx.nbytes / len(idx) <= 64


def test_fifo_and_lru_orders():
    fifo, lru = FifoPolicy(), LruPolicy()
    for policy in (fifo, lru):
        for region in (3, 1, 2):
            policy.track(region)
        policy.touch(3)
    assert list(fifo.candidates()) == [3, 1, 2]
    assert list(lru.candidates()) == [1, 2, 3]
    lru.remove(2)
    assert list(lru.candidates()) == [1, 3] and len(lru) == 2
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("random")


def test_region_table_skips_regions_with_too_many_pinned_bytes():
    table = RegionTable(4, 1000, "fifo")
    for region in range(3):
        assert table.take_free() == region
        table.open(region, region * 10 + 1, 0.0)
        table.add_block(region, 600, pinned=(region == 0))
        table.seal(region, region * 10 + 5, 700)
    assert table.victims()[0] == 1  # region 0 holds 600 pinned bytes > half of 1000
    table.set_pinned(0, 600, False)
    assert table.victims()[0] == 0


def test_a_probe_without_the_lock_is_right_or_refuses_while_the_table_changes():
    """find_many_unlocked against a writer that inserts (growing the table many times) and removes:
    every answer it gives is right (the always-present keys present, the never-inserted absent), and
    it refuses (None) rather than guess while a change overlaps it."""
    import threading

    rng = np.random.default_rng(11)
    always = rng.integers(1, 1 << 62, (2, 64), dtype=np.uint64)
    never = rng.integers(1 << 62, 1 << 63, (2, 64), dtype=np.uint64)  # a disjoint range: never inserted
    index = BlockIndex()
    ones = np.ones(64, np.uint32)
    index.insert_many(always[0], always[1], np.zeros(64, np.uint64), ones, np.zeros(64, np.uint32))
    stop, answers, refusals = threading.Event(), [0], [0]
    wrong: list[str] = []

    def probe():
        k0, k1 = np.concatenate([always[0], never[0]]), np.concatenate([always[1], never[1]])
        while not stop.is_set():
            slots = index.find_many_unlocked(k0, k1)
            if slots is None:
                refusals[0] += 1
                continue
            answers[0] += 1
            if not (slots[:64] >= 0).all() or (slots[64:] >= 0).any():
                wrong.append(f"present {int((slots[:64] >= 0).sum())}/64, never-inserted found {int((slots[64:] >= 0).sum())}")

    t = threading.Thread(target=probe)
    t.start()
    try:
        for round_ in range(60):
            n = 2000
            k0 = rng.integers(1, 1 << 62, n, dtype=np.uint64)
            k1 = rng.integers(1, 1 << 62, n, dtype=np.uint64)
            k0 = k0[~np.isin(k0, always[0])]
            k1 = k1[:len(k0)]
            index.insert_many(k0, k1, np.zeros(len(k0), np.uint64), np.ones(len(k0), np.uint32),
                              np.zeros(len(k0), np.uint32))
            if round_ % 3 == 2:
                index.remove(index.find_many(k0[: len(k0) // 2], k1[: len(k1) // 2]))
    finally:
        stop.set()
        t.join()
    assert not wrong, wrong[:3]
    assert answers[0] > 0 and index.capacity > 4 * 1024  # it answered, and the table grew under it
