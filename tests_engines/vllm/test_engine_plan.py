"""The connectors' framework-free parts: namespaces, page keys, the vLLM load/save plan."""
from __future__ import annotations

import pytest

from kvtier.client.engines.namespaces import key_namespace, page_key, request_namespace, shard_namespace
from kvtier.client.engines.vllm.scheduler_plan import (RequestState, block_op, interleaved_keys, load_range,
                                                       save_range)
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


def test_load_and_save_ranges():
    st = RequestState("r", "salt", None, prompt_len=14, hit_blocks=3)
    assert load_range(st, 4, local_tokens=4, external_tokens=7, block_tokens=B) == (1, 3)
    assert load_range(st, 1, 0, 0, B) is None
    with pytest.raises(ValueError):
        load_range(st, 4, local_tokens=2, external_tokens=4, block_tokens=B)
    with pytest.raises(ValueError):
        load_range(st, 2, local_tokens=4, external_tokens=7, block_tokens=B)
    # saves start past the hit; prompt policy stops at the prompt
    assert save_range(st, 14, 14, B, "prompt") is None
    st.hit_blocks = 1
    assert save_range(st, 20, 20, B, "prompt") == (1, 3)
    assert save_range(st, 20, 20, B, "prompt") is None
    assert save_range(st, 20, 20, B, "all") == (3, 5)
    assert save_range(RequestState("q", None, None, 8), 8, 8, B, "none") is None
    with pytest.raises(ValueError):
        save_range(st, 4, 4, B, "sometimes")


def test_block_ops_carry_only_this_steps_keys():
    shard = key_namespace(request_namespace(BASE, "salt", None), 0, 1)
    st = RequestState("r", "salt", None, prompt_len=14, chains=(shard.key_chain(),))
    tokens = list(range(14))
    st.extend_keys(tokens)
    op = block_op(st, 1, [11, 12], st.keys_of(1, 3))
    assert (op.first_block, op.block_ids, op.cache_salt, op.tenant) == (1, (11, 12), "salt", ("salt", None))
    assert op.keys == (tuple(shard.keys(tokens)[1:3]),)
    with pytest.raises(ValueError):
        block_op(st, 1, [11], st.keys_of(1, 3))


def test_tenant_namespace_ids_leave_the_shard_to_the_key():
    """The daemon sees one namespace id per tenant (all shards); keys still differ per shard."""
    tenant = request_namespace(BASE, "alice", "lora-x")
    assert dict(tenant.extra) == {"lora": "lora-x"}
    k0, k1 = key_namespace(tenant, 0, 2), key_namespace(tenant, 1, 2)
    assert k0.id != k1.id != tenant.id
    assert k0.keys(list(range(8))) != k1.keys(list(range(8)))
    assert request_namespace(BASE, "bob", "lora-x").id != tenant.id
    assert k0 == shard_namespace(tenant, 0, 2) == request_namespace(shard_namespace(BASE, 0, 2), "alice", "lora-x")


def test_tenant_caches_open_once_and_close_the_least_recently_used():
    from kvtier.client.engines.vllm.tenant_caches import TenantCaches
    from kvtier.client.save_queue import SaveQueueStatistics

    class FakeCache:
        def __init__(self, ns):
            self.namespace, self.closed = ns, False

        def close(self):
            self.closed = True

        def statistics(self):
            class S:
                saves = SaveQueueStatistics(0, 0, 1, 0, 2, 5)
            return S()

    opened = []
    caches = TenantCaches(BASE, lambda ns: opened.append(FakeCache(ns)) or opened[-1], limit=2)
    a = caches.get("alice", None)
    assert caches.get("alice", None) is a and a.namespace == request_namespace(BASE, "alice", None)
    b = caches.get(None, "lora-x")
    caches.get("alice", None)  # alice is now the most recently used
    caches.get("carol", None)  # closes the lora's cache
    assert len(caches) == 2 and caches.get("alice", None) is a and not a.closed
    assert caches.get(None, "lora-x") is not b  # reopened: it had been closed
    caches.close()
    assert [c.closed for c in opened] == [True] * 4 and b is opened[1]
    assert caches.saves() == SaveQueueStatistics(0, 0, 4, 0, 8, 20)


def test_one_lookup_of_interleaved_rank_keys_counts_the_blocks_every_rank_holds():
    chains = [BASE.with_extra(tp=f"{r}/3").key_chain() for r in range(3)]
    tokens = list(range(5 * B))
    for chain in chains:
        chain.extend(tokens)
    keys = interleaved_keys(chains, 1)
    assert keys == [chains[r].keys[b] for b in range(1, 5) for r in range(3)]
    held = {0: 4, 1: 2, 2: 3}  # leading blocks (from block 1) each rank holds
    present = [chains[r].keys[b] for r in range(3) for b in range(1, 1 + held[r])]
    leading = next((i for i, k in enumerate(keys) if k not in present), len(keys))
    assert leading // len(chains) == min(held.values())
