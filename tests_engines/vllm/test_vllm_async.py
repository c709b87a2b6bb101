"""KVTierConnector's async paths against the real vLLM 0.33 classes and a real kvtierd:
async loads, write-behind saves (a full queue drops, shutdown drains), load errors,
O(new blocks) per step, and tenants the daemon tells apart."""
from __future__ import annotations

import json
import pickle
import signal
import time
import urllib.request

import pytest
import torch

from daemon_proc import start_kvtierd
from test_vllm_connector import config, fresh_prompt, plant_bad_block
from vllm_env import BLOCK_TOKENS, Engine, make_kv_cache_config, make_request, make_scheduler

from kvtier.client import BlockClient

STEP_WHILE_DAEMON_STOPPED_S_MAX = 5.0  # a step that waited for a PUT would hang for the client's 30 s timeout


def stored_prefix(kvtierd, model_dir, prompt, cache_salt=None, **extra) -> int:
    """Tokens a fresh scheduler reports as loadable for ``prompt``."""
    cfg = config(model_dir, kvtierd, **extra)
    sched = make_scheduler(cfg, make_kv_cache_config(cfg))
    try:
        matched, _ = sched.connector.get_num_new_matched_tokens(make_request("probe", prompt, cache_salt), 0)
        return matched
    finally:
        sched.connector.shutdown()


def step_until(engine: Engine, done, steps_max: int = 8):
    for _ in range(steps_max):
        out, _ = engine.step()
        if done(out):
            return out
    raise AssertionError(f"not done after {steps_max} steps")


def test_async_load_runs_between_steps(model_dir, kvtierd):
    prompt = fresh_prompt(3 * BLOCK_TOKENS + 10)
    a, b = Engine(config(model_dir, kvtierd)), Engine(config(model_dir, kvtierd, load_async=True))
    try:
        a.add(make_request("a1", prompt))
        a.step()
        a.settle()
        b.add(make_request("b1", prompt))
        out, errors = b.step()
        # the request waits for its KV; the step runs without it
        assert out.num_scheduled_tokens == {} and not out.has_sync_kv_loads and not errors
        assert [op.num_blocks for op in out.kv_connector_metadata.async_loads] == [3]
        assert out.kv_connector_metadata.loads == []
        assert b.worker.wait_loads_fetched(timeout_s=60)
        out = step_until(b, lambda o: "b1" in o.num_scheduled_tokens)
        assert b.finished_recving == {"b1"} and not b.load_errors
        assert out.num_scheduled_tokens == {"b1": 10}  # only the tail is computed
        ids = b.block_ids("b1")
        for i in range(3):
            assert torch.equal(b.page(ids[i]), b.expected_page(prompt, i)), f"block {i}"
        assert b.worker.statistics()["loaded_blocks"] == 3
        assert sum(s.data["loaded_blocks"] for s in b.stats if s is not None) == 3  # vLLM's connector stats
    finally:
        a.close()
        b.close()


def test_async_load_of_a_corrupt_block_is_a_load_error(model_dir, kvtierd):
    prompt = fresh_prompt(3 * BLOCK_TOKENS + 4)
    a, b = Engine(config(model_dir, kvtierd)), Engine(config(model_dir, kvtierd, load_async=True))
    try:
        a.add(make_request("a1", prompt))
        a.step()
        a.settle()
        plant_bad_block(a, kvtierd, prompt, 1)
        b.add(make_request("b1", prompt))
        b.step()
        assert b.worker.wait_loads_fetched(timeout_s=60)
        out, errors = b.step()  # reported finished, with its bad block, in the same step
        ids = b.block_ids("b1")
        assert b.finished_recving == {"b1"} and errors == {ids[1]}
        out = step_until(b, lambda o: "b1" in o.num_scheduled_tokens)
        assert out.num_scheduled_tokens == {"b1": len(prompt) - BLOCK_TOKENS}  # recomputed from block 1
        assert torch.equal(b.page(ids[0]), b.expected_page(prompt, 0))
        for i in range(3):
            assert torch.equal(b.page(ids[i]), b.expected_page(prompt, i)), f"block {i}"
        assert [(op.first_block, op.num_blocks) for op in out.kv_connector_metadata.saves] == [(1, 2)]
        b.settle()
        assert stored_prefix(kvtierd, model_dir, prompt) == 3 * BLOCK_TOKENS  # the bad block was replaced
    finally:
        a.close()
        b.close()


def test_full_save_queue_drops_and_counts_and_shutdown_drains(model_dir, kvtierd):
    """With the daemon frozen, a step's saves queue (or drop when the queue is full) and
    the step returns at once; shutdown waits for the queued save."""
    kept, dropped = fresh_prompt(2 * BLOCK_TOKENS + 3), fresh_prompt(3 * BLOCK_TOKENS + 3)
    a = Engine(config(model_dir, kvtierd, save_queue_bytes=1))  # one save in flight at most
    stopped = False
    try:
        a.add(make_request("kept", kept))
        a.add(make_request("dropped", dropped))

        def freeze():
            nonlocal stopped
            kvtierd.signal(signal.SIGSTOP)
            stopped = True

        started = time.monotonic()
        out, _ = a.step(before_save=freeze)
        elapsed_s = time.monotonic() - started
        assert [op.req_id for op in out.kv_connector_metadata.saves] == ["kept", "dropped"]
        assert elapsed_s < STEP_WHILE_DAEMON_STOPPED_S_MAX, elapsed_s
        stats = a.worker.statistics()
        assert (stats["saves_dropped"], stats["blocks_dropped"], stats["saves_done"]) == (1, 3, 0)
        reported = a.stats[-1].data
        assert (reported["saves_dropped"], reported["blocks_dropped"]) == (1, 3)
        kvtierd.signal(signal.SIGCONT)
        stopped = False
        a.close()  # drains the queued save
        stats = a.worker.statistics()
        assert (stats["saves_done"], stats["saves_failed"], stats["saves_dropped"]) == (1, 0, 1)
    finally:
        if stopped:
            kvtierd.signal(signal.SIGCONT)
        a.close()
    assert stored_prefix(kvtierd, model_dir, kept) == 2 * BLOCK_TOKENS
    assert stored_prefix(kvtierd, model_dir, dropped) == 0  # a later miss


def test_key_hashing_and_metadata_stay_per_new_block(model_dir, kvtierd, monkeypatch):
    """Over a long decode, each token is hashed once and a step's metadata does not
    grow with the request (O(new blocks) per step, not O(request))."""
    import kvtier.common.keys as keys

    hashed = []
    real = keys.tokens_as_uint32
    monkeypatch.setattr(keys, "tokens_as_uint32", lambda t: hashed.append(len(t)) or real(t))
    prompt = fresh_prompt(BLOCK_TOKENS + 5)
    a = Engine(config(model_dir, kvtierd, store="all"))
    sizes = []
    try:
        a.add(make_request("long", prompt, max_tokens=12 * BLOCK_TOKENS))
        for _ in range(12 * BLOCK_TOKENS - 8):
            out, _ = a.step()
            sizes.append(len(pickle.dumps(out.kv_connector_metadata)))
        total = len(a.requests["long"].all_token_ids)
        assert sum(hashed) <= total, (sum(hashed), total)  # every token at most once (TP=1)
        assert sum(hashed) >= (total // BLOCK_TOKENS - 1) * BLOCK_TOKENS
        with_saves = [s for s in sizes if s > min(sizes)]
        assert len(with_saves) >= 8
        assert max(sizes[len(sizes) // 2:]) <= max(sizes[:len(sizes) // 2]), sizes
    finally:
        a.close()


@pytest.fixture(scope="module")
def admin_kvtierd(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("kvtierd-admin"), admin="127.0.0.1:0")
    yield d
    assert d.stop() == 0, d.log_tail()


def _admin(daemon, method: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{daemon.admin_addr}{path}", data=data, method=method,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_tenants_are_separate_namespaces_in_the_daemon(model_dir, admin_kvtierd):
    """Two tenants (cache salts) storing the same prompt: their blocks carry their own
    namespace ids, are counted apart, and delete_namespace removes one tenant only."""
    d = admin_kvtierd
    prompt = fresh_prompt(3 * BLOCK_TOKENS + 7)
    a = Engine(config(model_dir, d))
    try:
        a.add(make_request("alice-1", prompt, cache_salt="alice"))
        a.add(make_request("bob-1", prompt, cache_salt="bob"))
        a.step()
        a.settle()
        ids = {t: a.worker.caches_namespace(t, None).id for t in ("alice", "bob")}
        with BlockClient(d.data_addr) as client:
            for tenant, ns_id in ids.items():
                keys = a.worker.key_namespace(tenant, None, 0).keys(prompt)
                info = [_admin(d, "GET", f"/v1/blocks/{k.hex()}") for k in keys]
                assert [i["ns_id"] for i in info] == [ns_id.hex()] * 3, tenant
                assert client.lookup(keys, ns_id=ns_id) == 3
    finally:
        a.close()
    for _ in range(2):
        assert stored_prefix(d, model_dir, prompt, "alice") == 3 * BLOCK_TOKENS
    assert stored_prefix(d, model_dir, prompt, "bob") == 3 * BLOCK_TOKENS
    namespaces = _admin(d, "GET", "/v1/stats")["namespaces"]
    alice, bob = namespaces[ids["alice"].hex()], namespaces[ids["bob"].hex()]
    assert alice["hits"] >= bob["hits"] + 3, (alice, bob)  # alice was looked up twice as often

    evicted = _admin(d, "POST", "/v1/evict", {"namespace_id": ids["alice"].hex()})
    assert evicted["evicted_blocks"] == 3
    assert stored_prefix(d, model_dir, prompt, "alice") == 0
    assert stored_prefix(d, model_dir, prompt, "bob") == 3 * BLOCK_TOKENS
