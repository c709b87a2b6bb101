"""The connectors' framework-free parts: namespaces, page keys, the vLLM load/save plan."""
from __future__ import annotations

import pytest

from kvtier.client.engines.namespaces import page_key, request_namespace, shard_namespace
from kvtier.client.engines.vllm.scheduler_plan import RequestState, load_op, save_op
from kvtier.common.keys import KVLayout, Namespace

B = 4
BASE = Namespace("m", KVLayout(2, 2, 8, "float16", B), "raw", "tenant-a")


def test_request_namespaces_separate_salts_adapters_and_shards():
    shard = shard_namespace(BASE, 0, 2)
    ids = {
        request_namespace(shard, None, None).id,
        request_namespace(shard, "s1", None).id,
        request_namespace(shard, "s2", None).id,
        request_namespace(shard, None, "lora-x").id,
        request_namespace(shard, "s1", "lora-x").id,
        request_namespace(shard_namespace(BASE, 1, 2), None, None).id,
        request_namespace(shard_namespace(BASE, 0, 1), None, None).id,
    }
    assert len(ids) == 7
    assert request_namespace(shard, None, None) is shard
    assert dict(shard_namespace(BASE, 1, 4, 2, 3).extra) == {"tp": "1/4", "pp": "2/3"}
    with pytest.raises(ValueError):
        shard_namespace(BASE, 2, 2)


def test_page_keys_depend_on_the_namespace():
    a, b = shard_namespace(BASE, 0, 2), shard_namespace(BASE, 1, 2)
    assert page_key(a.id, "abc") == page_key(a.id, "abc")
    assert len({page_key(a.id, "abc"), page_key(b.id, "abc"), page_key(a.id, "abd")}) == 3
    with pytest.raises(ValueError):
        page_key(a.id, "")


def test_matched_tokens_leave_the_last_token_to_compute():
    st = RequestState("r", None, None, prompt_len=12, hit_blocks=3)
    assert st.matched_tokens(num_tokens=12, local_tokens=0, block_tokens=B) == 11
    assert st.matched_tokens(num_tokens=13, local_tokens=4, block_tokens=B) == 8
    assert RequestState("r", None, None, 12, hit_blocks=1).matched_tokens(12, 4, B) == 0


def test_load_and_save_ops():
    st = RequestState("r", "salt", None, prompt_len=14, hit_blocks=3)
    tokens = list(range(14))
    op = load_op(st, tokens, [10, 11, 12, 13], local_tokens=4, external_tokens=7, block_tokens=B)
    assert (op.first_block, op.block_ids, op.tokens, op.cache_salt) == (1, (11, 12), tuple(range(12)), "salt")
    assert load_op(st, tokens, [10], 0, 0, B) is None
    with pytest.raises(ValueError):
        load_op(st, tokens, [10, 11, 12, 13], local_tokens=2, external_tokens=4, block_tokens=B)
    # saves start past the hit; prompt policy stops at the prompt
    assert save_op(st, tokens, [10, 11, 12, 13], 14, 14, B, "prompt") is None
    st.hit_blocks = 1
    op = save_op(st, tokens + [99] * 6, [10, 11, 12, 13, 14], 20, 20, B, "prompt")
    assert (op.first_block, op.block_ids) == (1, (11, 12))
    assert save_op(st, tokens + [99] * 6, [10, 11, 12, 13, 14], 20, 20, B, "prompt") is None
    op = save_op(st, tokens + [99] * 6, [10, 11, 12, 13, 14], 20, 20, B, "all")
    assert (op.first_block, op.block_ids) == (3, (13, 14))
    assert save_op(RequestState("q", None, None, 8), tokens, [1, 2], 8, 8, B, "none") is None
    with pytest.raises(ValueError):
        save_op(st, tokens, [1], 4, 4, B, "sometimes")
