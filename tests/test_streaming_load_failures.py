"""A streaming load (several layer groups) whose block fails part-way, against a real kvtierd:
the prefix it reports holds that prompt's KV in every layer, and nothing lands in the output
once the load has answered."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient
from kvtier.client.kvcache import KVCache
from kvtier.client.prefix_load import PrefixShortened
from kvtier.common.keys import KVLayout, Namespace, layer_group_key

THREE_GROUPS = KVLayout(num_layers=5, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8, layer_groups=3)
# blocks of 1 MiB a group, so TCP replies land in the caller's tensor
TWO_GROUPS = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=64, layer_groups=2)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("kvtierd"))
    yield d
    assert d.stop() == 0, d.log_tail()


def make_kv(layout: KVLayout, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (1, layout.num_kv_heads, tokens, layout.head_dim)
    return [(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
            for _ in range(layout.num_layers)]


def wrong_layers(layers, kv, tokens: int) -> list[int]:
    def same(a, b) -> bool:
        return torch.equal(a[:, :, :tokens], b[:, :, :tokens])
    return [i for i, ((k, v), (rk, rv)) in enumerate(zip(layers, kv)) if not (same(k, rk) and same(v, rv))]


def deleting_after_lookup(cache: KVCache, client: BlockClient, objects: list[bytes]):
    """The warm tier's LOOKUP, after which ``objects`` disappear (evicted before their GET)."""
    lookup = cache._warm.lookup
    return lambda keys: (lookup(keys), client.delete_many(objects))[0]


@pytest.mark.parametrize("failed_group", [0, 1, 2])
def test_a_block_failing_in_any_group_shortens_to_blocks_whose_every_layer_is_in(daemon, failed_group):
    layout = THREE_GROUPS
    prompt_a, prompt_b = list(range(100, 140)), list(range(500 + failed_group * 100, 540 + failed_group * 100))
    kv_a, kv_b = make_kv(layout, 40, 1), make_kv(layout, 40, 2)
    with KVCache(Namespace(f"stream-fail-{failed_group}", layout), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(prompt_a, kv_a)
        cache.store(prompt_b, kv_b)
        assert cache.load(prompt_a).num_tokens == 40  # its pooled output, given back, holds prompt A's KV
        keys_b = cache.keys_for(prompt_b)
        with BlockClient(daemon.data_addr) as client:
            cache._warm.lookup = deleting_after_lookup(cache, client, [layer_group_key(keys_b[2], failed_group)])
            loaded = cache.load(prompt_b)
        assert loaded.num_tokens == 16
        assert wrong_layers(loaded.layers, kv_b, 16) == []


def test_a_started_load_says_it_shrank_only_once_the_good_blocks_are_in_every_layer(daemon):
    layout = THREE_GROUPS
    tokens, kv = list(range(2000, 2040)), make_kv(layout, 40, 3)
    with KVCache(Namespace("stream-fail-started", layout), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(tokens, kv)
        keys = cache.keys_for(tokens)
        with BlockClient(daemon.data_addr) as client:
            cache._warm.lookup = deleting_after_lookup(cache, client, [layer_group_key(keys[3], 0)])
            load = cache.start_load(tokens)
            with pytest.raises(PrefixShortened) as shrank:
                load.wait_layer(0, 30)
        assert (shrank.value.valid_tokens, shrank.value.promised_tokens) == (24, 40)
        assert wrong_layers(load.layers, kv, 24) == []


def slowed_group(cache: KVCache, group: int, delay_s: float) -> threading.Event:
    """The warm tier's fetches of ``group`` take ``delay_s`` longer; the event is set as the last one ends."""
    fetch, ended = cache._warm.fetch, threading.Event()

    def slow(keys, prefix_only, transports, groups=None, **kw):
        if groups != [group]:
            return fetch(keys, prefix_only, transports, groups, **kw)
        ended.clear()
        time.sleep(delay_s)
        try:
            return fetch(keys, prefix_only, transports, groups, **kw)
        finally:
            ended.set()
    cache._warm.fetch = slow
    return ended


def test_a_load_into_the_callers_tensor_returns_only_after_every_group_fetch_ended(daemon):
    layout, b = TWO_GROUPS, TWO_GROUPS.block_tokens
    tokens, kv = list(range(100, 100 + 5 * b)), make_kv(TWO_GROUPS, 5 * b, 4)
    with KVCache(Namespace("stream-fail-out", layout), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(tokens, kv)
        keys = cache.keys_for(tokens)
        ended = slowed_group(cache, 1, 0.5)  # group 1 is still on its way when group 0's block 2 fails
        out = torch.zeros((4, 2, 1, 8, 5 * b, 128), dtype=torch.float16)
        with BlockClient(daemon.data_addr) as client:
            cache._warm.lookup = deleting_after_lookup(cache, client, [keys[2]])
            loaded = cache.load(tokens, out=out)
        assert ended.is_set(), "load() answered while a group fetch could still land bytes in the caller's tensor"
        assert loaded.num_tokens == 2 * b and wrong_layers(loaded.layers, kv, 2 * b) == []
        assert loaded.transports == {"tcp": 2}


def test_a_load_that_fails_answers_only_after_every_group_fetch_ended(daemon):
    layout = TWO_GROUPS
    tokens, kv = list(range(900, 900 + 3 * layout.block_tokens)), make_kv(layout, 3 * layout.block_tokens, 5)
    with KVCache(Namespace("stream-fail-error", layout), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(tokens, kv)
        ended = slowed_group(cache, 1, 0.5)

        def broken(*args, **kwargs):
            raise RuntimeError("decoder fault")
        cache._decoder.decode_into_tokens = broken
        load = cache.start_load(tokens)
        with pytest.raises(RuntimeError, match="decoder fault"):
            load.wait_layer(0, 30)
        assert ended.is_set(), "the load failed while a group fetch could still land bytes in its output"
