"""KVTierHiCacheStorage against the real SGLang 0.5.23 classes on CPU and a real kvtierd."""
from __future__ import annotations

import random

import pytest
import torch

from sglang_env import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_LAYERS,
    PAGE_SIZE,
    attach_backend,
    fill_pages,
    make_host_pool,
    make_storage_config,
    page_keys,
    page_kv,
)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtier.client import BlockClient
from kvtier.common.blockformat import encode_block
from kvtier.client.engines.sglang import KVTierHiCacheStorage

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_seq = iter(range(10**9))


def fresh_tokens(n_pages: int) -> list[int]:
    """Tokens no other test stores (the daemon is shared by the session)."""
    rng = random.Random(next(_seq) * 104729 + 3)
    return [rng.randrange(1, 50000) for _ in range(n_pages * PAGE_SIZE)]


def test_dynamic_factory_builds_the_backend(kvtierd):
    pool = make_host_pool()
    backend = attach_backend(make_storage_config(kvtierd.data_addr, tp_rank=1, tp_size=2), pool)
    try:
        assert type(backend) is KVTierHiCacheStorage and isinstance(backend, HiCacheStorage)
        assert backend.mem_pool_host is pool
        layout = backend.namespace.layout
        assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_tokens) == (
            NUM_LAYERS, NUM_HEADS, HEAD_DIM, "float16", PAGE_SIZE)
        assert dict(backend.namespace.extra) == {}  # the tenant's namespace: what the daemon sees
        assert dict(backend.key_namespace.extra) == {"tp": "1/2"}  # the keys: this rank's shard
        assert backend.namespace.model == "tiny-llama-test"
    finally:
        backend.close()


@pytest.mark.parametrize("src_layout,dst_layout", [(l, l) for l in LAYOUTS] + [("layer_first", "page_first"),
                                                                            ("page_head", "page_first_direct")])
def test_v1_round_trip_through_host_pools(kvtierd, src_layout, dst_layout):
    keys = page_keys(fresh_tokens(3))
    src_pool, dst_pool = make_host_pool(src_layout), make_host_pool(dst_layout)
    src = attach_backend(make_storage_config(kvtierd.data_addr), src_pool)
    dst = attach_backend(make_storage_config(kvtierd.data_addr), dst_pool)
    try:
        src_idx = src_pool.alloc(3 * PAGE_SIZE)
        fill_pages(src_pool, src_idx, seed=1)
        assert src.batch_exists(keys) == 0
        assert src.batch_set_v1(keys, src_idx) == [True] * 3
        assert src.wait_saves_stored(timeout_s=60)
        assert dst.batch_exists(keys) == 3
        dst_pool.alloc(2 * PAGE_SIZE)  # land on different slots than the source used
        dst_idx = dst_pool.alloc(3 * PAGE_SIZE)
        assert dst.batch_get_v1(keys, dst_idx) == [True] * 3
        for s, d in zip(src_idx[::PAGE_SIZE].tolist(), dst_idx[::PAGE_SIZE].tolist()):
            assert torch.equal(page_kv(dst_pool, d), page_kv(src_pool, s))
        assert dst.get_stats().prefetch_pgs == [3] and dst.get_stats().prefetch_pgs == []
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_round_trip_with_flat_pages(kvtierd, layout):
    """The controller's generic path: get_data_page -> batch_set; batch_get ->
    set_from_flat_data_page (SGLang's own pool methods on both sides)."""
    keys = page_keys(fresh_tokens(2))
    src_pool, dst_pool = make_host_pool(layout), make_host_pool(layout)
    src = attach_backend(make_storage_config(kvtierd.data_addr, interface_v1=False), src_pool)
    dst = attach_backend(make_storage_config(kvtierd.data_addr, interface_v1=False), dst_pool)
    try:
        src_idx = src_pool.alloc(2 * PAGE_SIZE)
        fill_pages(src_pool, src_idx, seed=2)
        starts = src_idx[::PAGE_SIZE].tolist()
        assert src.batch_set(keys, [src_pool.get_data_page(s) for s in starts])
        assert src.wait_saves_stored(timeout_s=60)
        assert src.exists(keys[0]) and src.exists(keys[1])
        got = dst.batch_get(keys, [dst_pool.get_dummy_flat_data_page() for _ in keys])
        assert all(g is not None for g in got)
        dst_idx = dst_pool.alloc(2 * PAGE_SIZE)
        for d, page in zip(dst_idx[::PAGE_SIZE].tolist(), got):
            dst_pool.set_from_flat_data_page(d, page)
        for s, d in zip(starts, dst_idx[::PAGE_SIZE].tolist()):
            assert torch.equal(page_kv(dst_pool, d), page_kv(src_pool, s))
        single = dst.get(keys[1])
        assert torch.equal(single, src_pool.get_data_page(starts[1]))
        assert dst.get(page_keys(fresh_tokens(1))[0]) is None
        assert dst.set(keys[0], src_pool.get_data_page(starts[0]))
    finally:
        src.close()
        dst.close()


def test_batch_exists_counts_the_leading_pages(kvtierd):
    keys = page_keys(fresh_tokens(5))
    pool = make_host_pool()
    backend = attach_backend(make_storage_config(kvtierd.data_addr), pool)
    other_rank = attach_backend(make_storage_config(kvtierd.data_addr, tp_rank=1, tp_size=2), make_host_pool())
    other_model = attach_backend(make_storage_config(kvtierd.data_addr, model="another-model"), make_host_pool())
    try:
        idx = pool.alloc(5 * PAGE_SIZE)
        fill_pages(pool, idx, seed=3)
        stored = [0, 1, 3]
        page_idx = idx.view(5, PAGE_SIZE)[stored].flatten()
        assert backend.batch_set_v1([keys[i] for i in stored], page_idx) == [True] * 3
        assert backend.wait_saves_stored(timeout_s=60)
        assert backend.batch_exists(keys) == 2
        assert backend.batch_exists(keys[:2]) == 2
        assert backend.batch_exists(keys[1:]) == 1
        assert backend.batch_exists(keys[2:]) == 0
        assert backend.batch_exists(keys[3:4]) == 1
        assert backend.batch_exists([]) == 0
        assert other_rank.batch_exists(keys) == 0  # another TP rank's heads are another namespace
        assert other_model.batch_exists(keys) == 0
    finally:
        for b in (backend, other_rank, other_model):
            b.close()


def test_a_corrupt_page_reads_as_a_miss_and_is_not_written(kvtierd):
    keys = page_keys(fresh_tokens(3))
    src_pool, dst_pool = make_host_pool(), make_host_pool()
    src = attach_backend(make_storage_config(kvtierd.data_addr), src_pool)
    dst = attach_backend(make_storage_config(kvtierd.data_addr), dst_pool)
    try:
        src_idx = src_pool.alloc(3 * PAGE_SIZE)
        fill_pages(src_pool, src_idx, seed=4)
        assert src.batch_set_v1(keys, src_idx) == [True] * 3
        assert src.wait_saves_stored(timeout_s=60)
        # a well-formed frame (CRCs right) with a payload of the wrong size under page 1's key
        key1 = src.keys_of(keys)[1]
        with BlockClient(kvtierd.data_addr) as client:
            assert client.delete(key1)
            client.put(key1, encode_block(key1, src.namespace.id, src.cache.codec.codec_id, b"\1" * 32))
        assert dst.batch_exists(keys) == 3  # LOOKUP sees it; only loading can tell
        dst_idx = dst_pool.alloc(3 * PAGE_SIZE)
        sentinel = torch.full((2, NUM_LAYERS, PAGE_SIZE, NUM_HEADS, HEAD_DIM), 7.0, dtype=torch.float16)
        for d in dst_idx[::PAGE_SIZE].tolist():
            dst_pool.get_data_page(d, flat=False).copy_(sentinel)
        assert dst.batch_get_v1(keys, dst_idx) == [True, False, True]
        starts_src, starts_dst = src_idx[::PAGE_SIZE].tolist(), dst_idx[::PAGE_SIZE].tolist()
        assert torch.equal(page_kv(dst_pool, starts_dst[0]), page_kv(src_pool, starts_src[0]))
        assert torch.equal(page_kv(dst_pool, starts_dst[1]), sentinel)  # untouched
        assert torch.equal(page_kv(dst_pool, starts_dst[2]), page_kv(src_pool, starts_src[2]))
        assert dst.get(keys[1]) is None
        assert dst.counters["failed_pages"] == 2
    finally:
        src.close()
        dst.close()


def test_misaligned_host_indices_are_refused(kvtierd):
    pool = make_host_pool()
    backend = attach_backend(make_storage_config(kvtierd.data_addr), pool)
    try:
        idx = pool.alloc(2 * PAGE_SIZE)
        with pytest.raises(ValueError, match="aligned"):
            backend.batch_get_v1(page_keys(fresh_tokens(2)), idx + 1)
        with pytest.raises(ValueError, match="host indices"):
            backend.batch_set_v1(page_keys(fresh_tokens(2)), idx[:PAGE_SIZE])
    finally:
        backend.close()


def test_unreachable_daemon_is_a_miss_not_a_crash(tmp_path):
    pool = make_host_pool()
    backend = attach_backend(make_storage_config("127.0.0.1:9"), pool)  # nothing listens on port 9
    try:
        keys = page_keys(fresh_tokens(2))
        idx = pool.alloc(2 * PAGE_SIZE)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, idx) == [False, False]
        # write-behind: the save is queued at once; its PUT fails in the background and is counted
        assert backend.batch_set_v1(keys, idx) == [True, True]
        assert backend.wait_saves_stored(timeout_s=60)
        saves = backend.statistics()
        assert (saves.saves_failed, saves.saves_done) == (1, 0)
        assert backend.batch_set_v1(keys, idx) == [True, True]  # a failed save is sent again next time
        assert backend.counters["saved_pages"] == 4
    finally:
        backend.close()


def test_backup_skips_the_pages_already_stored(kvtierd):
    keys = page_keys(fresh_tokens(5))
    pool = make_host_pool("page_first")
    backend = attach_backend(make_storage_config(kvtierd.data_addr), pool)
    try:
        idx = pool.alloc(5 * PAGE_SIZE)
        fill_pages(pool, idx, seed=5)
        assert backend.batch_set_v1(keys[:3], idx[:3 * PAGE_SIZE]) == [True] * 3
        assert backend.counters["saved_pages"] == 3
        assert backend.batch_set_v1(keys, idx) == [True] * 5  # SGLang backs up the whole prefix again
        assert backend.counters["saved_pages"] == 5  # only the 2 new pages went out
        assert backend.wait_saves_stored(timeout_s=60)
        assert backend.batch_exists(keys) == 5
        assert backend.get_stats().backup_pgs == [3, 5]
    finally:
        backend.close()


def test_a_backup_naming_a_page_twice_stores_it_once(kvtierd):
    keys = page_keys(fresh_tokens(2))
    pool = make_host_pool("page_first")
    backend = attach_backend(make_storage_config(kvtierd.data_addr), pool)
    try:
        idx = pool.alloc(3 * PAGE_SIZE)
        fill_pages(pool, idx, seed=6)
        assert backend.batch_set_v1([keys[0], keys[1], keys[0]], idx) == [True] * 3
        assert backend.wait_saves_stored(timeout_s=60)
        assert backend.counters["saved_pages"] == 2
        assert backend.batch_exists(keys) == 2
        dst_pool = make_host_pool("page_first")
        dst = attach_backend(make_storage_config(kvtierd.data_addr), dst_pool)
        try:
            dst_idx = dst_pool.alloc(2 * PAGE_SIZE)
            assert dst.batch_get_v1(keys, dst_idx) == [True, True]
            for s, d in zip(idx[:2 * PAGE_SIZE:PAGE_SIZE].tolist(), dst_idx[::PAGE_SIZE].tolist()):
                assert torch.equal(page_kv(dst_pool, d), page_kv(pool, s))  # the first page under the key
        finally:
            dst.close()
    finally:
        backend.close()


def test_batch_exists_counts_pages_whose_save_is_in_flight(kvtierd):
    """A page backed up a moment ago (its PUT still queued) reads as present, so SGLang does
    not back it up twice; past the queued pages the daemon is asked for the rest."""
    import threading

    keys = page_keys(fresh_tokens(5))
    pool = make_host_pool("page_first")
    backend = attach_backend(make_storage_config(kvtierd.data_addr), pool)
    gate = threading.Event()
    try:
        idx = pool.alloc(5 * PAGE_SIZE)
        fill_pages(pool, idx, seed=8)
        assert backend.batch_set_v1(keys[:1], idx[:PAGE_SIZE]) == [True]
        assert backend.batch_set_v1(keys[3:4], idx[3 * PAGE_SIZE:4 * PAGE_SIZE]) == [True]
        assert backend.wait_saves_stored(timeout_s=60)
        backend.cache._saves.submit(0, 0, lambda: gate.wait(60) and 0)  # holds the save worker
        assert backend.batch_set_v1(keys[1:3], idx[PAGE_SIZE:3 * PAGE_SIZE]) == [True, True]  # queued behind it
        assert backend.cache.lookup_keys(backend.keys_of(keys)) == 1  # the daemon has not got them yet
        assert backend.batch_exists(keys) == 4  # stored 0, queued 1 and 2, stored 3
        assert backend.batch_exists(keys[1:3]) == 2
        assert backend.batch_set_v1(keys, idx) == [True] * 5  # SGLang backs up the whole prefix again
        assert backend.counters["saved_pages"] == 5  # the queued pages were not sent twice
        gate.set()
        assert backend.wait_saves_stored(timeout_s=60)
        assert backend.batch_exists(keys) == 5
        assert backend.cache.lookup_keys(backend.keys_of(keys)) == 5
    finally:
        gate.set()
        backend.close()


def test_in_flight_saves_count_until_they_finish():
    from concurrent.futures import Future

    from kvtier.client.engines.sglang.recent_saves import RecentSaves

    recent = RecentSaves()
    a, b = Future(), Future()
    recent.add([b"k1", b"k2"], a)
    recent.add([b"k2", b"k3"], b)
    assert recent.in_flight_from([b"k0", b"k1", b"k2", b"k3", b"k4"], 1) == 3
    assert recent.in_flight_from([b"k0", b"k1"], 0) == 0
    a.set_result(2)
    assert recent.in_flight_from([b"k1", b"k2", b"k3"], 0) == 0  # k1's save is done
    assert recent.in_flight_from([b"k1", b"k2", b"k3"], 1) == 2  # k2 is still in b
    b.set_exception(OSError("lost"))
    assert recent.in_flight_from([b"k2", b"k3"], 0) == 0
    assert recent.leading([b"k1", b"k2"]) == 1  # a failed save forgets its keys


def test_pages_the_daemon_lost_are_sent_again_by_a_backup_past_the_recent_ttl(kvtierd):
    keys = page_keys(fresh_tokens(3))
    pool = make_host_pool("page_first")
    backend = attach_backend(make_storage_config(kvtierd.data_addr), pool)
    now = [1000.0]
    backend._recent._clock = lambda: now[0]
    try:
        idx = pool.alloc(3 * PAGE_SIZE)
        fill_pages(pool, idx, seed=11)
        assert backend.batch_set_v1(keys, idx) == [True] * 3
        assert backend.wait_saves_stored(timeout_s=60) and backend.batch_exists(keys) == 3
        with BlockClient(kvtierd.data_addr) as client:  # evicted, or deleted by an operator
            assert client.delete_many(backend.keys_of(keys)) == [True] * 3
        now[0] += 1.0
        assert backend.batch_set_v1(keys, idx) == [True] * 3  # within the TTL: taken as stored, not sent
        assert backend.wait_saves_stored(timeout_s=60) and backend.batch_exists(keys) == 0
        now[0] += backend._recent.ttl_s  # checking the keys above did not renew them
        assert backend.batch_set_v1(keys, idx) == [True] * 3
        assert backend.wait_saves_stored(timeout_s=60) and backend.batch_exists(keys) == 3
    finally:
        backend.close()


def test_full_save_queue_drops_and_close_drains(kvtierd):
    """With the daemon frozen, a backup queues (or drops when the queue is full) and the
    call returns at once; close() waits for the queued save."""
    import signal
    import time

    kept, dropped = page_keys(fresh_tokens(2)), page_keys(fresh_tokens(2))
    pool = make_host_pool("page_first")
    backend = attach_backend(make_storage_config(kvtierd.data_addr, save_queue_bytes=1), pool)
    idx = pool.alloc(4 * PAGE_SIZE)
    fill_pages(pool, idx, seed=6)
    kvtierd.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert backend.batch_set_v1(kept, idx[:2 * PAGE_SIZE]) == [True, True]
        assert backend.batch_set_v1(dropped, idx[2 * PAGE_SIZE:]) == [False, False]  # the queue is full
        assert time.monotonic() - started < 5.0  # a wait for the daemon would take the 30 s timeout
        saves = backend.statistics()
        assert (saves.saves_dropped, saves.blocks_dropped, saves.saves_done) == (1, 2, 0)
        assert backend.counters["dropped_pages"] == 2
    finally:
        kvtierd.signal(signal.SIGCONT)
    backend.close()  # drains the queued save
    assert backend.cache is None
    probe = attach_backend(make_storage_config(kvtierd.data_addr), make_host_pool())
    try:
        assert probe.batch_exists(kept) == 2
        assert probe.batch_exists(dropped) == 0  # a later miss
    finally:
        probe.close()


def test_ranks_share_the_tenants_namespace_id_and_tenants_differ(kvtierd):
    """Every TP rank's pages carry the deployment tenant's namespace id (one
    delete_namespace removes them all); another tenant's id differs, and so do the keys."""
    from kvtier.common.blockformat import decode_header

    keys = page_keys(fresh_tokens(1))
    backends = [attach_backend(make_storage_config(kvtierd.data_addr, tp_rank=r, tp_size=2, tenant="acme"),
                               make_host_pool()) for r in range(2)]
    other = attach_backend(make_storage_config(kvtierd.data_addr, tenant="globex"), make_host_pool())
    try:
        ns_ids = set()
        with BlockClient(kvtierd.data_addr) as client:
            for b in backends + [other]:
                idx = b.mem_pool_host.alloc(PAGE_SIZE)
                fill_pages(b.mem_pool_host, idx, seed=7)
                assert b.batch_set_v1(keys, idx) == [True]
                assert b.wait_saves_stored(timeout_s=60)
                (kv_key,) = b.keys_of(keys)
                ns_ids.add((decode_header(client.get(kv_key)).ns_id, b.namespace.id))
        assert len({b.keys_of(keys)[0] for b in backends + [other]}) == 3  # shards and tenants: own keys
        acme, globex = backends[0].namespace.id, other.namespace.id
        assert backends[1].namespace.id == acme != globex
        assert ns_ids == {(acme, acme), (globex, globex)}
    finally:
        for b in backends + [other]:
            b.close()
