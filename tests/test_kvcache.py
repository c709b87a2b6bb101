"""KVCache against a real kvtierd: store / lookup / load, hot tier, statistics,
a second process, tenant separation, several daemons."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient
from kvtier.common.keys import KVLayout, Namespace
from kvtier.client.kvcache import KVCache

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("kvtierd"))
    yield d
    assert d.stop() == 0, d.log_tail()


def ns(name: str, salt: str = "", codec: str = "raw", layout: KVLayout = LAYOUT) -> Namespace:
    return Namespace(model=name, layout=layout, codec=codec, tenant_salt=salt)


def make_kv(tokens: int, seed: int = 0, layout: KVLayout = LAYOUT):
    g = torch.Generator().manual_seed(seed)
    shape = (1, layout.num_kv_heads, tokens, layout.head_dim)
    dt = getattr(torch, layout.dtype)
    return [(torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt))
            for _ in range(layout.num_layers)]


def prefix_equal(layers, kv, tokens: int) -> bool:
    return all(torch.equal(k, rk[:, :, :tokens]) and torch.equal(v, rv[:, :, :tokens])
               for (k, v), (rk, rv) in zip(layers, kv))


def check_adds_up(stats) -> None:
    assert stats.blocks_requested == stats.hot.hits + stats.hot.misses
    assert stats.hot.misses == stats.warm.hits + stats.warm.misses
    assert sum(stats.warm.transports.values()) == stats.warm.hits


def test_store_then_load_is_bitwise_and_skips_known_blocks(daemon):
    tokens = list(range(1000, 1045))  # 5 full blocks + 5 tokens of tail
    kv = make_kv(45)
    with KVCache(ns("roundtrip"), daemon.data_addr, hot_pool_bytes=0) as cache:
        assert cache.lookup(tokens) == 0
        assert cache.store(tokens, kv) == 5
        assert cache.store(tokens, kv) == 0  # all known after one lookup
        assert cache.lookup(tokens) == 40
        loaded = cache.load(tokens)
        assert loaded.num_tokens == 40 and loaded.blocks_warm == 5 and loaded.blocks_hot == 0
        assert loaded.transports == {"tcp": 5}
        assert prefix_equal(loaded.layers, kv, 40)
        assert loaded.layers[0][0].dtype == torch.float16 and loaded.layers[0][0].shape == (1, 2, 40, 16)
        # max_tokens rounds down to whole blocks
        assert cache.load(tokens, max_tokens=39).num_tokens == 32
        assert cache.load(tokens, max_tokens=0).num_tokens == 0
        # a longer prompt with the same prefix stores only its new blocks
        longer = tokens + list(range(7000, 7011))  # 56 tokens: 7 blocks
        assert cache.store(longer, make_kv(56, seed=0)) == 2
        check_adds_up(cache.statistics())


def test_load_stops_at_the_first_missing_block(daemon):
    tokens = list(range(2000, 2032))
    kv = make_kv(32, seed=1)
    with KVCache(ns("gap"), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(tokens, kv)
        keys = cache.keys_for(tokens)
        with BlockClient(daemon.data_addr) as client:
            assert client.delete(keys[2])
        assert cache.lookup(tokens) == 16
        loaded = cache.load(tokens)
        assert loaded.num_tokens == 16 and prefix_equal(loaded.layers, kv, 16)
        stats = cache.statistics()
        assert stats.warm.hits == 2 and stats.warm.misses == 2
        check_adds_up(stats)


def test_load_blocks_returns_none_per_missing_block(daemon):
    tokens = list(range(3000, 3024))
    kv = make_kv(24, seed=2)
    with KVCache(ns("blocks"), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(tokens, kv)
        keys = cache.keys_for(tokens)
        with BlockClient(daemon.data_addr) as client:
            client.delete(keys[1])
        got = cache.load_blocks([keys[0], keys[1], keys[2], b"\x01" * 16])
        assert got[1] is None and got[3] is None
        for i in (0, 2):
            b = LAYOUT.block_tokens
            assert got[i].shape == LAYOUT.block_shape
            for layer, (k, v) in enumerate(kv):
                assert torch.equal(got[i][layer, 0], k[0, :, i * b:(i + 1) * b])
                assert torch.equal(got[i][layer, 1], v[0, :, i * b:(i + 1) * b])
        # store_blocks puts them back under their keys
        assert cache.store_blocks([keys[1]], [cache.load_blocks([keys[0]])[0]]) == 1
        assert cache.load_blocks([keys[1]])[0] is not None


def test_hot_tier_serves_repeat_loads_and_statistics_add_up(daemon):
    tokens = list(range(4000, 4040))
    kv = make_kv(40, seed=3)
    with KVCache(ns("hot"), daemon.data_addr, hot_pool_bytes=64 * LAYOUT.block_raw_bytes) as cache:
        cache.store(tokens, kv)  # stored blocks are kept hot
        first = cache.load(tokens)
        assert first.blocks_hot == 5 and first.blocks_warm == 0
        assert prefix_equal(first.layers, kv, 40)
        stats = cache.statistics()
        assert stats.hot.hits == 5 and stats.hot.misses == 0 and stats.warm.lookups == 0
        assert stats.hot_blocks_resident == 5 and stats.hot_blocks_referenced == 0
        assert stats.blocks_stored == 5
        check_adds_up(stats)
    # a fresh process-local cache: first load from warm, second from hot
    with KVCache(ns("hot"), daemon.data_addr, hot_pool_bytes=64 * LAYOUT.block_raw_bytes) as cache:
        a = cache.load(tokens)
        b = cache.load(tokens)
        assert (a.blocks_warm, a.blocks_hot) == (5, 0) and (b.blocks_warm, b.blocks_hot) == (0, 5)
        assert prefix_equal(b.layers, kv, 40)
        stats = cache.statistics()
        assert (stats.hot.hits, stats.hot.misses, stats.warm.hits, stats.warm.misses) == (5, 5, 5, 0)
        assert stats.warm.bytes_read > 5 * LAYOUT.block_raw_bytes  # payload plus headers
        assert stats.hot.bytes_read == 5 * LAYOUT.block_raw_bytes
        assert stats.warm.latency_us_p50 > 0 and stats.warm.operations == 1
        check_adds_up(stats)
        assert json.dumps(stats.as_dict())


def test_small_hot_pool_evicts_only_unreferenced_blocks(daemon):
    tokens = list(range(5000, 5048))
    kv = make_kv(48, seed=4)
    with KVCache(ns("tiny-hot"), daemon.data_addr, hot_pool_bytes=2 * LAYOUT.block_raw_bytes) as cache:
        cache.store(tokens, kv)
        # 6 blocks through a 2-slot pool: the load holds what it placed, the rest is staged
        loaded = cache.load(tokens)
        assert loaded.num_tokens == 48 and prefix_equal(loaded.layers, kv, 48)
        stats = cache.statistics()
        assert stats.hot_capacity_blocks == 2 and stats.hot_blocks_referenced == 0
        check_adds_up(stats)


def test_prefetch_and_async_twins(daemon):
    tokens = list(range(6000, 6032))
    kv = make_kv(32, seed=5)
    with KVCache(ns("async"), daemon.data_addr, hot_pool_bytes=0) as cache:

        async def flow():
            assert await cache.astore(tokens, kv) == 4
            assert await cache.alookup(tokens) == 32
            assert await cache.alookup_keys(cache.keys_for(tokens)) == 4
            loaded = await cache.aload(tokens)
            blocks = await cache.aload_blocks(cache.keys_for(tokens)[:1])
            return loaded, blocks

        loaded, blocks = asyncio.run(flow())
        assert prefix_equal(loaded.layers, kv, 32) and blocks[0] is not None
        future = cache.prefetch(tokens)
        assert prefix_equal(future.result(timeout=30).layers, kv, 32)


SECOND_PROCESS = textwrap.dedent("""
    import json, sys, hashlib
    from kvtier.common.keys import KVLayout, Namespace
    from kvtier.client.kvcache import KVCache
    addr, model, salts, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    layout = KVLayout(**json.loads(sys.argv[5]))
    for salt in salts:
        with KVCache(Namespace(model, layout, tenant_salt=salt), addr, hot_pool_bytes=0) as cache:
            n = cache.lookup(tokens)
            loaded = cache.load(tokens)
            digest = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes()
                                             for pair in loaded.layers for t in pair)).hexdigest()
            print(json.dumps({"lookup": n, "loaded": loaded.num_tokens, "digest": digest}))
""")


def _other_process(addr, model, salts, tokens):
    """One fresh interpreter (torch imports are slow) that loads under each salt."""
    layout = {"num_layers": LAYOUT.num_layers, "num_kv_heads": LAYOUT.num_kv_heads,
              "head_dim": LAYOUT.head_dim, "dtype": LAYOUT.dtype, "block_tokens": LAYOUT.block_tokens}
    out = subprocess.run([sys.executable, "-c", SECOND_PROCESS, addr, model, json.dumps(salts), json.dumps(tokens),
                          json.dumps(layout)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"second process failed ({out.returncode}):\n{out.stderr[-3000:]}"
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(salts), f"unexpected output:\n{out.stdout}\n{out.stderr[-3000:]}"
    return [json.loads(line) for line in lines]


def test_second_process_hits_and_other_tenant_never_does(daemon):
    import hashlib

    tokens = list(range(8000, 8032))
    kv = make_kv(32, seed=6)
    with KVCache(ns("shared", salt="tenant-a"), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(tokens, kv)
    expected = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for pair in kv for t in pair)).hexdigest()
    same, other = _other_process(daemon.data_addr, "shared", ["tenant-a", "tenant-b"], tokens)
    assert same == {"lookup": 32, "loaded": 32, "digest": expected}
    assert other["lookup"] == 0 and other["loaded"] == 0


@pytest.mark.parametrize("codec", ["int8", "mixed"])
def test_quantized_namespace_loads_within_the_codec_bound(daemon, codec):
    tokens = list(range(9000, 9032))
    kv = make_kv(32, seed=7)
    with KVCache(ns(codec, codec=codec), daemon.data_addr, hot_pool_bytes=0) as cache:
        assert cache.store(tokens, kv) == 4
        loaded = cache.load(tokens)
    assert loaded.num_tokens == 32
    ref = torch.cat([torch.cat(p, 0) for p in kv]).float()
    got = torch.cat([torch.cat(p, 0) for p in loaded.layers]).float()
    rel = float((got - ref).norm() / ref.norm())
    assert 0 < rel <= 0.01  # the codecs issue's int8 bound (relative L2); mixed is int8 below 8 K tokens


def test_several_daemons_split_blocks_by_owner(daemon, tmp_path):
    second = start_kvtierd(tmp_path / "second")
    try:
        tokens = list(range(10000, 10160))  # 20 blocks
        kv = make_kv(160, seed=8)
        addrs = [daemon.data_addr, second.data_addr]
        with KVCache(ns("cluster"), addrs, hot_pool_bytes=0) as cache:
            assert cache.store(tokens, kv) == 20
            assert cache.lookup(tokens) == 160
            loaded = cache.load(tokens)
            assert loaded.num_tokens == 160 and prefix_equal(loaded.layers, kv, 160)
            keys = cache.keys_for(tokens)
        held = []
        for addr in addrs:
            with BlockClient(addr) as client:
                held.append([b is not None for b in client.get_many(keys)])
        held_np = np.array(held)
        assert (held_np.sum(axis=0) == 1).all()  # each block on exactly one owner
        assert held_np[0].any() and held_np[1].any()
        # a client with the addresses in the other order routes the same way
        with KVCache(ns("cluster"), addrs[::-1], hot_pool_bytes=0) as cache:
            assert cache.lookup(tokens) == 160
    finally:
        assert second.stop() == 0


def test_bad_input_is_a_clear_error(daemon):
    with pytest.raises(ValueError, match="transport"):
        KVCache(ns("bad"), daemon.data_addr, transport="rdma")
    with pytest.raises(ValueError, match="device_map"):
        KVCache(ns("bad"), daemon.data_addr, transport="direct")
    with pytest.raises(ValueError, match="addresses"):
        KVCache(ns("bad"), [])
    with KVCache(ns("bad"), daemon.data_addr, hot_pool_bytes=0) as cache:
        kv = make_kv(16)
        with pytest.raises(ValueError, match="layers"):
            cache.store(list(range(16)), kv[:2])
        with pytest.raises(ValueError, match="float16"):
            cache.store(list(range(16)), [(k.float(), v.float()) for k, v in kv])
        with pytest.raises(ValueError, match="covers 16 tokens"):
            cache.store(list(range(8)), kv)
        with pytest.raises(ValueError, match="shape"):
            cache.store_blocks([b"\x00" * 16], [torch.zeros(3, 3)])
        with pytest.raises(ValueError, match="max_tokens"):
            cache.load([1, 2, 3], max_tokens=-1)


def test_concurrent_loads_of_one_prefix_share_the_hot_pool(daemon):
    tokens = list(range(11000, 11064))
    kv = make_kv(64, seed=9)
    with KVCache(ns("concurrent"), daemon.data_addr, hot_pool_bytes=0) as writer:
        writer.store(tokens, kv)
    with KVCache(ns("concurrent"), daemon.data_addr, hot_pool_bytes=16 * LAYOUT.block_raw_bytes) as cache:
        futures = [cache.prefetch(tokens) for _ in range(4)]
        results = [f.result(timeout=60) for f in futures]
        for loaded in results:
            assert loaded.num_tokens == 64 and prefix_equal(loaded.layers, kv, 64)
        stats = cache.statistics()
        assert stats.hot_blocks_resident == 8 and stats.hot_blocks_referenced == 0  # held once, all released
        check_adds_up(stats)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_device_pool_loads_the_same_kv(daemon):
    tokens = list(range(12000, 12032))
    kv = make_kv(32, seed=10)
    with KVCache(ns("cuda"), daemon.data_addr, hot_pool_bytes=8 * LAYOUT.block_raw_bytes, device="cuda") as cache:
        cache.store(tokens, [(k.cuda(), v.cuda()) for k, v in kv])
        for _ in range(2):  # from the hot pool in HBM, then again
            loaded = cache.load(tokens)
            assert loaded.layers[0][0].is_cuda
            assert prefix_equal([(k.cpu(), v.cpu()) for k, v in loaded.layers], kv, 32)
    with KVCache(ns("cuda"), daemon.data_addr, hot_pool_bytes=0, device="cuda") as cache:
        loaded = cache.load(tokens)  # warm, decoded on the device
        assert prefix_equal([(k.cpu(), v.cpu()) for k, v in loaded.layers], kv, 32)


class _DecodeFault(RuntimeError):
    pass


class _FailingDecode:
    """The cache's own codec, except that decoding raises (fault injection)."""

    def __init__(self, codec):
        self._codec = codec

    def __getattr__(self, name):
        return getattr(self._codec, name)

    def decode(self, data, out):
        raise _DecodeFault("injected decode failure")


def test_a_decode_that_raises_leaves_no_hot_pool_reservation_behind(daemon):
    """A decode failing with anything (a CUDA error, a bug) - not only the codec's
    ValueError - must give the reserved hot-pool slot back: otherwise that key could
    never become hot again and the slot is lost."""
    tokens = list(range(9000, 9016))
    kv = make_kv(16, seed=11)
    with KVCache(ns("decode-fault"), daemon.data_addr, hot_pool_bytes=0) as writer:
        assert writer.store(tokens, kv) == 2
    with KVCache(ns("decode-fault"), daemon.data_addr, hot_pool_bytes=8 * LAYOUT.block_raw_bytes) as cache:
        real_codec = cache._decoder.codec
        cache._decoder.codec = _FailingDecode(real_codec)
        try:
            with pytest.raises(_DecodeFault):
                cache.load(tokens)
        finally:
            cache._decoder.codec = real_codec
        pool = cache.statistics()
        assert pool.hot_blocks_resident == 0 and pool.hot_blocks_referenced == 0
        again = cache.load(tokens)  # the same keys decode into the pool now
        assert again.num_tokens == 16 and prefix_equal(again.layers, kv, 16)
        assert cache.load(tokens).blocks_hot == 2


def test_write_behind_store_copies_out_then_saves_in_the_background(daemon):
    tokens = list(range(7000, 7040))
    kv = make_kv(40, seed=7)
    original = [(k.clone(), v.clone()) for k, v in kv]
    with KVCache(ns("write-behind"), daemon.data_addr, hot_pool_bytes=0) as cache:
        future = cache.store_async(tokens, kv)
        for k, v in kv:  # the engine reuses its memory at once: the save holds its own copy
            k.zero_()
            v.zero_()
        assert future.result(30) == 5
        assert cache.store_async(tokens, original).result(30) == 0  # known: the background LOOKUP skips them
        loaded = cache.load(tokens)
        assert loaded.num_tokens == 40 and prefix_equal(loaded.layers, original, 40)
        saves = cache.statistics().saves
        assert (saves.saves_done, saves.saves_dropped, saves.bytes_queued) == (2, 0, 0)


def test_write_behind_drops_and_counts_when_full_and_close_drains(daemon):
    import threading

    block_bytes = LAYOUT.block_raw_bytes
    cache = KVCache(ns("write-behind-full"), daemon.data_addr, hot_pool_bytes=0, save_queue_bytes=5 * block_bytes)
    first = cache.store_async(list(range(0, 16)), make_kv(16, seed=0))
    assert first.result(30) == 2
    gate = threading.Event()
    cache._saves.submit(2 * block_bytes, 0, lambda: gate.wait(30) and 0)  # holds the worker and 2 blocks of room
    later = [cache.store_async(list(range(i * 100, i * 100 + 16)), make_kv(16, seed=i)) for i in range(1, 4)]
    assert [f.done() for f in later] == [False, True, True]  # one more fits; the rest are dropped at once
    saves = cache.statistics().saves
    assert (saves.saves_dropped, saves.blocks_dropped) == (2, 4)
    gate.set()
    cache.close()  # drains what was accepted
    assert [f.result(0) for f in later] == [2, 0, 0]
    saves = cache.statistics().saves
    assert (saves.saves_done, saves.saves_queued, saves.bytes_queued) == (3, 0, 0)
    with KVCache(ns("write-behind-full"), daemon.data_addr, hot_pool_bytes=0) as check:
        assert [check.lookup(list(range(i * 100, i * 100 + 16))) for i in range(4)] == [16, 16, 0, 0]


def test_store_blocks_refuses_a_wrong_dtype(daemon):
    with KVCache(ns("dtype"), daemon.data_addr, hot_pool_bytes=0) as cache:
        keys = cache.keys_for(list(range(8)))
        with pytest.raises(ValueError, match="float32, the namespace layout is float16"):
            cache.store_blocks(keys, [torch.zeros(LAYOUT.block_shape, dtype=torch.float32)])



def test_store_blocks_refuses_a_key_named_twice_and_stores_nothing(daemon):
    with KVCache(ns("twice"), daemon.data_addr, hot_pool_bytes=0) as cache:
        keys = cache.keys_for(list(range(16)))
        blocks = [torch.randn(LAYOUT.block_shape).half() for _ in range(3)]
        for store in (cache.store_blocks, cache.store_blocks_async):
            with pytest.raises(ValueError, match=f"items 0 and 2 name the same key {keys[0].hex()}"):
                store([keys[0], keys[1], keys[0]], blocks)
        assert cache.load_blocks(keys[:2]) == [None, None]

GROUPED = KVLayout(num_layers=5, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8, layer_groups=3)


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_layer_groups_store_and_load_whole_blocks(daemon, codec):
    tokens = list(range(9000, 9040))
    kv = make_kv(40, seed=3, layout=GROUPED)
    with KVCache(ns(f"groups-{codec}", codec=codec, layout=GROUPED), daemon.data_addr, hot_pool_bytes=0) as cache:
        assert cache.store(tokens, kv) == 5
        assert cache.lookup(tokens) == 40
        loaded = cache.load(tokens)
        assert loaded.num_tokens == 40 and loaded.transports == {"tcp": 5}
        if codec == "raw":
            assert prefix_equal(loaded.layers, kv, 40)
        streamed = cache.start_load(tokens)
        streamed.wait(30)
        assert streamed.num_tokens == 40 and streamed.valid_tokens == 40
        for (k, v), (sk, sv) in zip(loaded.layers, streamed.layers):
            assert torch.equal(k, sk) and torch.equal(v, sv)
        blocks = cache.load_blocks(cache.keys_for(tokens))
        assert all(b is not None and tuple(b.shape) == GROUPED.block_shape for b in blocks)
        stats = cache.statistics()
        assert stats.warm.hits == 3 * 5 and stats.warm.transports == {"tcp": 15}  # load, start_load, load_blocks
        check_adds_up(stats)


def test_a_block_missing_one_layer_group_is_a_miss(daemon):
    from kvtier.common.keys import layer_group_key

    tokens = list(range(9100, 9140))
    namespace = ns("groups-missing", layout=GROUPED)
    kv = make_kv(40, seed=4, layout=GROUPED)
    with KVCache(namespace, daemon.data_addr, hot_pool_bytes=0) as cache:
        assert cache.store(tokens, kv) == 5
        keys = cache.keys_for(tokens)
        with BlockClient(daemon.data_addr) as client:
            assert client.delete_many([layer_group_key(keys[3], 2)]) == [True]  # the last group of block 3
        assert cache.lookup(tokens) == 24
        assert cache.load(tokens).num_tokens == 24
        assert [b is None for b in cache.load_blocks(keys)] == [False, False, False, True, False]
        assert cache.store(tokens, kv) == 2  # blocks 3 and 4 again: a chain is stored from its first gap


def test_a_streaming_load_hands_each_group_over_and_reports_a_shrunk_prefix(daemon):
    from kvtier.client.prefix_load import PrefixShortened
    from kvtier.common.keys import layer_group_key

    tokens = list(range(9200, 9240))
    kv = make_kv(40, seed=5, layout=GROUPED)
    with KVCache(ns("groups-stream", layout=GROUPED), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(tokens, kv)
        load = cache.start_load(tokens)
        for layer in range(GROUPED.num_layers):
            load.wait_layer(layer, 30)
            k, v = load.layers[layer]
            assert torch.equal(k, kv[layer][0]) and torch.equal(v, kv[layer][1])
        keys = cache.keys_for(tokens)
        # a later group disappears between the LOOKUP and its GET: the prefix shrinks, the waits say so
        original_lookup = cache._warm.lookup
        with BlockClient(daemon.data_addr) as client:
            cache._warm.lookup = lambda ks: (original_lookup(ks), client.delete_many([layer_group_key(keys[2], 1)]))[0]
            shrunk = cache.start_load(tokens)
            with pytest.raises(PrefixShortened) as err:
                shrunk.wait(30)
        assert (err.value.valid_tokens, err.value.promised_tokens) == (16, 40)
        assert shrunk.valid_tokens == 16
        with pytest.raises(PrefixShortened):
            shrunk.wait_layer(4, 30)


def test_layer_groups_reject_the_mixed_codec(daemon):
    with pytest.raises(ValueError, match="layer_groups=1"):
        KVCache(ns("groups-mixed", codec="mixed", layout=GROUPED), daemon.data_addr)


def test_a_raw_load_makes_no_block_sized_copies(daemon):
    """From the reply buffers straight into the output tensors: after a warm-up, a load of
    8 blocks of 1 MiB allocates (Python and NumPy heaps) far less than one block."""
    import tracemalloc

    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=128, dtype="float16", block_tokens=256)
    tokens = list(range(20_000, 20_000 + 8 * 256))
    with KVCache(ns("no-copies", layout=layout), daemon.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
        cache.store(tokens, make_kv(len(tokens), layout=layout))
        cache.load(tokens)  # warms the connections' reply buffers
        tracemalloc.start()
        try:
            loaded = cache.load(tokens)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert loaded.num_tokens == len(tokens)
    # what is allocated: the receive chunks and, per block, the scatter list's views (one
    # ~190-byte memoryview per (layer, K|V, head) row it lands in): no copy of a block
    assert peak < layout.block_raw_bytes // 6, f"{peak} bytes allocated while loading"


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_load_blocks_into_strided_targets(daemon, codec):
    tokens = list(range(30_000, 30_032))
    kv = make_kv(32, seed=9)
    with KVCache(ns(f"into-{codec}", codec=codec), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(tokens, kv)
        keys = cache.keys_for(tokens) + [bytes(16)]
        reference = cache.load_blocks(keys[:4])
        shape = LAYOUT.block_shape
        pool = torch.full((5, *shape[:-1], 2 * shape[-1]), -1.0, dtype=torch.float16)  # interleaved, strided views
        targets = [pool[i, ..., 0::2] for i in range(5)]
        assert not targets[0].is_contiguous()
        assert cache.load_blocks_into(keys, targets) == [True, True, True, True, False]
        for i in range(4):
            assert torch.equal(targets[i], reference[i])
        assert bool((pool[..., 1::2] == -1).all()) and bool((pool[4] == -1).all())  # nothing outside the targets
        with pytest.raises(ValueError, match="targets"):
            cache.load_blocks_into(keys, targets[:2])
