"""KVTierConnector against the real vLLM 0.33 classes on CPU and a real kvtierd."""
from __future__ import annotations

import random

import pytest
import torch

from vllm_env import (
    BLOCK_TOKENS,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    Engine,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorBase_V1, KVConnectorRole

from kvtier.common.blockformat import encode_block
from kvtier.client.engines.vllm import KVTierConnector
from kvtier.client.kvcache import KVCache
from kvtier.client import BlockClient

_seq = iter(range(10**9))


def fresh_prompt(n_tokens: int) -> list[int]:
    """A prompt no other test stores (the daemon is shared by the session)."""
    rng = random.Random(next(_seq) * 7919 + 17)
    return [rng.randrange(1, 1000) for _ in range(n_tokens)]


def config(model_dir, kvtierd, **extra):
    return make_vllm_config(model_dir, {"address": kvtierd.data_addr, **extra})


def store_random_blocks(connector: KVTierConnector, tokens, n_blocks: int, cache_salt=None, rank: int = 0) -> None:
    """Put ``n_blocks`` leading blocks of ``tokens`` for one TP shard (random KV), as the
    connector does: keys from the shard's key namespace, under the tenant's namespace id."""
    keys = connector.key_namespace(cache_salt, None, rank).keys(tokens)[:n_blocks]
    tenant = connector.caches_namespace(cache_salt, None)
    blocks = [torch.randn(tenant.layout.block_shape).to(torch.float16) for _ in keys]
    with KVCache(tenant, connector.settings.addresses[0], hot_pool_bytes=0) as cache:
        assert cache.store_blocks(keys, blocks) == n_blocks


def test_factory_builds_both_roles_from_module_path(model_dir, kvtierd):
    cfg = config(model_dir, kvtierd)
    kv_cfg = make_kv_cache_config(cfg)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = KVConnectorFactory.create_connector(cfg, role, kv_cfg)
        try:
            assert type(conn) is KVTierConnector and isinstance(conn, KVConnectorBase_V1)
            assert conn.role == role
            layout = conn.base_namespace.layout
            assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_tokens) == (
                NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "float16", BLOCK_TOKENS)
            assert dict(conn.key_namespace(None, None, 0).extra) == {"engine_page": "vllm-cpu", "tp": "0/1"}
            assert dict(conn.caches_namespace(None, None).extra) == {"engine_page": "vllm-cpu"}
        finally:
            conn.shutdown()


def test_scheduler_reports_stored_prefix(model_dir, kvtierd):
    cfg = config(model_dir, kvtierd)
    sched = make_scheduler(cfg, make_kv_cache_config(cfg))
    conn = sched.connector
    assert isinstance(conn, KVTierConnector)
    partial, full, cold = fresh_prompt(100), fresh_prompt(3 * BLOCK_TOKENS), fresh_prompt(70)
    store_random_blocks(conn, partial, 2)  # 2 of its 3 full blocks
    store_random_blocks(conn, full, 3)  # every block: vLLM still computes the last token
    for rid, toks in (("partial", partial), ("full", full), ("cold", cold)):
        sched.add_request(make_request(rid, toks))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"partial": 100 - 64, "full": 1, "cold": 70}
    loads = {op.req_id: op for op in out.kv_connector_metadata.loads}
    assert sorted(loads) == ["full", "partial"]
    assert loads["partial"].first_block == 0 and loads["partial"].num_blocks == 2
    assert loads["full"].num_blocks == 3
    assert list(loads["partial"].block_ids) == list(sched.kv_cache_manager.get_block_ids("partial")[0][:2])
    conn.shutdown()


def test_cache_salt_and_lora_separate_namespaces(model_dir, kvtierd):
    from vllm.lora.request import LoRARequest

    cfg = config(model_dir, kvtierd)
    sched = make_scheduler(cfg, make_kv_cache_config(cfg))
    conn = sched.connector
    toks = fresh_prompt(80)
    store_random_blocks(conn, toks, 2, cache_salt="alice")
    assert conn.get_num_new_matched_tokens(make_request("a", toks, cache_salt="alice"), 0) == (64, False)
    assert conn.get_num_new_matched_tokens(make_request("b", toks, cache_salt="bob"), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(make_request("c", toks), 0) == (0, False)
    lora = LoRARequest("adapter-x", 1, "/nonexistent/adapter-x")
    assert conn.get_num_new_matched_tokens(make_request("d", toks, cache_salt="alice", lora_request=lora), 0) == (0, False)
    conn.shutdown()


def test_a_lora_name_re_pointed_at_other_weights_is_another_namespace(model_dir, kvtierd):
    from vllm.lora.request import LoRARequest

    cfg = config(model_dir, kvtierd)
    conn = make_scheduler(cfg, make_kv_cache_config(cfg)).connector
    toks = fresh_prompt(80)
    v1, v2 = LoRARequest("sql", 1, "/adapters/sql-v1"), LoRARequest("sql", 2, "/adapters/sql-v2")
    assert conn.get_num_new_matched_tokens(make_request("v1", toks, lora_request=v1), 0) == (0, False)
    state = conn._requests["v1"]
    tenant = conn.caches_namespace(state.cache_salt, state.lora_name)
    keys = conn.key_namespace(state.cache_salt, state.lora_name, 0).keys(toks)[:2]
    with KVCache(tenant, kvtierd.data_addr, hot_pool_bytes=0) as cache:
        assert cache.store_blocks(keys, [torch.randn(tenant.layout.block_shape).half() for _ in keys]) == 2
    assert conn.get_num_new_matched_tokens(make_request("v1-again", toks, lora_request=v1), 0) == (64, False)
    assert conn.get_num_new_matched_tokens(make_request("v2", toks, lora_request=v2), 0) == (0, False)
    conn.shutdown()


def test_prompts_given_partly_as_embeddings_are_neither_loaded_nor_saved(model_dir, kvtierd):
    cfg = config(model_dir, kvtierd)
    conn = make_scheduler(cfg, make_kv_cache_config(cfg)).connector
    toks = fresh_prompt(80)
    store_random_blocks(conn, toks, 2)
    assert conn.get_num_new_matched_tokens(make_request("ids", toks), 0) == (64, False)
    mixed = make_request("mixed", toks)
    mixed.prompt_embeds = torch.randn(len(toks), 256)  # what vLLM sets for a mixed prompt-embeds request
    assert conn.get_num_new_matched_tokens(mixed, 0) == (0, False)
    assert "mixed" not in conn._requests
    conn.shutdown()


def test_revision_and_quantization_enter_the_namespace(model_dir, kvtierd):
    cfg = config(model_dir, kvtierd)
    plain = make_scheduler(cfg, make_kv_cache_config(cfg)).connector
    cfg.model_config.revision = "v2"
    revised = make_scheduler(cfg, make_kv_cache_config(cfg)).connector
    try:
        assert dict(revised.base_namespace.extra)["revision"] == "v2"
        assert "revision" not in dict(plain.base_namespace.extra)
        assert revised.base_namespace.id != plain.base_namespace.id
    finally:
        plain.shutdown()
        revised.shutdown()


def test_local_hit_is_not_looked_up_again(model_dir, kvtierd):
    """Blocks vLLM computed itself count; the LOOKUP covers only the rest."""
    cfg = config(model_dir, kvtierd)
    sched = make_scheduler(cfg, make_kv_cache_config(cfg))
    conn = sched.connector
    toks = fresh_prompt(4 * BLOCK_TOKENS + 5)
    keys = conn.key_namespace(None, None, 0).keys(toks)
    tenant = conn.caches_namespace(None, None)
    blocks = [torch.randn(tenant.layout.block_shape).to(torch.float16) for _ in keys]
    with KVCache(tenant, kvtierd.data_addr, hot_pool_bytes=0) as cache:
        cache.store_blocks(keys[2:4], blocks[2:4])  # blocks 0, 1 only in vLLM's own cache
    assert conn.get_num_new_matched_tokens(make_request("x", toks), 2 * BLOCK_TOKENS) == (64, False)
    assert conn.get_num_new_matched_tokens(make_request("y", toks), 0) == (0, False)
    conn.shutdown()


def test_tensor_parallel_ranks_agree_on_the_minimum(model_dir, kvtierd):
    from vllm.config import ParallelConfig

    cfg = config(model_dir, kvtierd)
    try:
        cfg.parallel_config = ParallelConfig(tensor_parallel_size=2)
    except Exception as exc:  # pragma: no cover - depends on vLLM's CPU validation
        pytest.skip(f"vLLM refuses a TP=2 config on this machine: {exc}")
    kv_cfg = make_kv_cache_config(cfg)
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cfg)
    assert [dict(conn.key_namespace(None, None, r).extra)["tp"] for r in range(2)] == ["0/2", "1/2"]
    toks = fresh_prompt(4 * BLOCK_TOKENS)
    store_random_blocks(conn, toks, 3, rank=0)
    store_random_blocks(conn, toks, 2, rank=1)
    lookups = _daemon_lookups(kvtierd)
    assert conn.get_num_new_matched_tokens(make_request("tp", toks), 0) == (2 * BLOCK_TOKENS, False)
    assert _daemon_lookups(kvtierd) == lookups + 1  # one LOOKUP asks for both ranks' blocks
    other = fresh_prompt(2 * BLOCK_TOKENS)
    store_random_blocks(conn, other, 2, rank=0)  # rank 1 holds none of this prompt: nothing counts
    assert conn.get_num_new_matched_tokens(make_request("tp-other", other), 0) == (0, False)
    conn.shutdown()


def _daemon_lookups(kvtierd) -> int:
    with BlockClient(kvtierd.data_addr) as client:
        return client.stats()["server"]["requests"].get("lookup", 0)


def test_worker_save_then_load_is_byte_exact(model_dir, kvtierd):
    """Engine A computes and saves a prompt; engine B (another vLLM) loads it."""
    prompt = fresh_prompt(3 * BLOCK_TOKENS + 10)
    a, b = Engine(config(model_dir, kvtierd)), Engine(config(model_dir, kvtierd))
    try:
        a.add(make_request("a1", prompt))
        out, errors = a.step()
        assert out.num_scheduled_tokens == {"a1": len(prompt)} and not errors
        assert [op.num_blocks for op in out.kv_connector_metadata.saves] == [3]
        a_ids = a.block_ids("a1")
        assert a.worker.statistics()["saved_blocks"] == 3
        a.settle()

        b.add(make_request("b1", prompt))
        out, errors = b.step()
        assert not errors
        assert out.num_scheduled_tokens == {"b1": 10}
        assert [op.num_blocks for op in out.kv_connector_metadata.loads] == [3]
        assert out.kv_connector_metadata.saves == []  # loaded blocks are not stored again
        b_ids = b.block_ids("b1")
        for i in range(3):
            assert torch.equal(b.page(b_ids[i]), a.page(a_ids[i])), f"block {i} differs"
            assert torch.equal(b.page(b_ids[i]), b.expected_page(prompt, i))
        assert b.worker.statistics()["loaded_blocks"] == 3
    finally:
        a.close()
        b.close()


def test_corrupt_block_is_reported_and_recomputed(model_dir, kvtierd):
    prompt = fresh_prompt(3 * BLOCK_TOKENS + 4)
    a, b = Engine(config(model_dir, kvtierd)), Engine(config(model_dir, kvtierd))
    try:
        a.add(make_request("a1", prompt))
        a.step()
        a.settle()
        key1 = plant_bad_block(a, kvtierd, prompt, 1)
        ns = a.worker.key_namespace(None, None, 0)

        b.add(make_request("b1", prompt))
        out, errors = b.step()
        b_ids = b.block_ids("b1")
        assert [op.num_blocks for op in out.kv_connector_metadata.loads] == [3]
        assert errors == {b_ids[1]}
        assert b.worker.statistics()["failed_blocks"] == 1
        assert torch.equal(b.page(b_ids[0]), b.expected_page(prompt, 0))  # block 0 loaded
        # vLLM truncated the request at the failed block and recomputes from there
        req = b.requests["b1"]
        assert req.num_computed_tokens == BLOCK_TOKENS
        out, errors = b.step()
        assert out.num_scheduled_tokens == {"b1": len(prompt) - BLOCK_TOKENS} and not errors
        for i in range(3):
            assert torch.equal(b.page(b_ids[i]), b.expected_page(prompt, i)), f"block {i}"
        # the recomputed block was saved again, replacing the bad one
        assert [(op.first_block, op.num_blocks) for op in out.kv_connector_metadata.saves] == [(1, 2)]
        b.settle()
        with KVCache(a.worker.caches_namespace(None, None), kvtierd.data_addr, hot_pool_bytes=0) as cache:
            got = cache.load_blocks(ns.keys(prompt)[:3])
            with BlockClient(kvtierd.data_addr) as client:
                lens = [len(x) if x else None for x in client.get_many(ns.keys(prompt)[:3])]
            assert [blk is not None for blk in got] == [True] * 3, (lens, b.worker.counters)
    finally:
        a.close()
        b.close()


def test_a_step_whose_load_failed_saves_nothing_until_it_is_recomputed(model_dir, kvtierd):
    """Blocks computed in the step of a failed load ran over a page the block never reached: none
    is stored under its key (the daemon keeps the first), and the recompute's blocks are."""
    prompt = fresh_prompt(4 * BLOCK_TOKENS + 4)
    a, b = Engine(config(model_dir, kvtierd)), Engine(config(model_dir, kvtierd))
    try:
        a.add(make_request("a1", prompt[:2 * BLOCK_TOKENS + 4]))
        a.step()
        a.settle()
        plant_bad_block(a, kvtierd, prompt, 1)
        keys = a.worker.key_namespace(None, None, 0).keys(prompt)[:4]

        b.add(make_request("b1", prompt))
        out, errors = b.step()
        b_ids = b.block_ids("b1")
        assert errors == {b_ids[1]}
        assert [(op.first_block, op.num_blocks) for op in out.kv_connector_metadata.saves] == [(2, 2)]
        b.settle()
        with BlockClient(kvtierd.data_addr) as client:
            assert client.get_many(keys[2:]) == [None, None]
        assert b.worker.statistics()["skipped_saves"] == 2
        assert sum(s.data["skipped_saves"] for s in b.stats if s is not None) == 2

        out, errors = b.step()  # vLLM recomputes from the failed block; those blocks are saved
        assert not errors
        assert [(op.first_block, op.num_blocks) for op in out.kv_connector_metadata.saves] == [(1, 3)]
        b.settle()
        for i in range(4):
            assert torch.equal(b.page(b_ids[i]), b.expected_page(prompt, i)), f"block {i}"
        with KVCache(a.worker.caches_namespace(None, None), kvtierd.data_addr, hot_pool_bytes=0) as cache:
            assert all(block is not None for block in cache.load_blocks(keys))
    finally:
        a.close()
        b.close()


def plant_bad_block(engine: Engine, kvtierd, prompt, index: int) -> bytes:
    """Replace stored block ``index`` of ``prompt`` by a well-formed frame (CRCs correct)
    whose payload is cut short - what a torn or foreign write would leave. LOOKUP still
    sees it. Returns its key."""
    w = engine.worker
    key = w.key_namespace(None, None, 0).keys(prompt)[index]
    tenant = w.caches_namespace(None, None)
    with BlockClient(kvtierd.data_addr) as client:
        assert client.get(key) is not None and client.delete(key)
        bad = encode_block(key, tenant.id, w.caches.get(None, None).codec.codec_id, b"\0" * 64)
        client.put(key, bad)
        assert len(client.get(key)) == len(bad)  # the daemon only stamps its sequence
    return key


def test_store_all_saves_generated_blocks_and_prompt_does_not(model_dir, kvtierd):
    prompt = fresh_prompt(BLOCK_TOKENS + 8)
    a = Engine(config(model_dir, kvtierd, store="all"))
    b = Engine(config(model_dir, kvtierd, store="prompt"))
    try:
        a.add(make_request("a1", prompt, max_tokens=40))
        saves = []
        for _ in range(25):  # the prompt, then decode until token 63's KV exists
            out, _ = a.step()
            saves += [(op.first_block, op.num_blocks) for op in out.kv_connector_metadata.saves]
        assert saves == [(0, 1), (1, 1)]
        a.settle()
        tokens = list(a.requests["a1"].all_token_ids)[:2 * BLOCK_TOKENS]
        assert tokens[len(prompt):] == [7] * (2 * BLOCK_TOKENS - len(prompt))  # block 1 ends in generated tokens

        follow_up = tokens + fresh_prompt(5)  # the next chat turn starts with the whole history
        b.add(make_request("b1", follow_up, max_tokens=40))
        out, errors = b.step()
        assert out.num_scheduled_tokens == {"b1": 5} and not errors
        b_ids = b.block_ids("b1")
        for i in range(2):
            assert torch.equal(b.page(b_ids[i]), b.expected_page(follow_up, i))
        for _ in range(30):  # decoding past a block boundary: the prompt policy stores nothing more
            out, _ = b.step()
            assert out.kv_connector_metadata.saves == []
    finally:
        a.close()
        b.close()


def test_unknown_setting_is_refused(model_dir, kvtierd):
    cfg = make_vllm_config(model_dir, {"adress": kvtierd.data_addr})
    with pytest.raises(ValueError, match="adress"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, make_kv_cache_config(cfg))
