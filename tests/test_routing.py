"""The owner-of-a-key rule (kvtier.client.routing): pinned owners, the same
owners in every process and in any member order, stability when a member
goes, balance, ranked candidates; and KVCache and kvperf routing alike
against real daemons."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient
from kvtier.client.kvcache import KVCache
from kvtier.client.routing import Rendezvous, positions_by_owner
from kvtier.common.keys import KVLayout, Namespace, chain_keys
from kvtier.tools.kvperf.cli import EXIT_OK, run
from kvtier.tools.kvperf.connect import Connections
from kvtier.tools.kvperf.content import keyspace_ns_id
from kvtier.tools.kvperf.targets import parse_targets

MEMBERS = ("10.0.0.1:7410", "10.0.0.2:7410", "10.0.0.3:7410", "[fd00::4]:7410", "node-e:7410")


def random_keys(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [bytes(row) for row in rng.integers(0, 256, size=(n, 16), dtype=np.uint8)]


def test_owners_are_pinned():
    # every client of a cluster must compute the same owners: a change here re-homes stored blocks
    keys = [bytes([i]) * 16 for i in range(8)] + [bytes(range(16))]
    assert Rendezvous(MEMBERS).owners(keys).tolist() == [2, 2, 4, 0, 0, 2, 2, 0, 2]


def test_same_owners_in_another_process():
    keys = random_keys(500, seed=1)
    code = ("import json, sys; from kvtier.client.routing import Rendezvous; "
            "members, keys = json.load(sys.stdin); "
            "print(json.dumps(Rendezvous(members).owners([bytes.fromhex(k) for k in keys]).tolist()))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps([MEMBERS, [k.hex() for k in keys]]),
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "random"})
    assert json.loads(out.stdout) == Rendezvous(MEMBERS).owners(keys).tolist()


def test_member_order_does_not_change_owners():
    keys = random_keys(2000, seed=2)
    forward = Rendezvous(MEMBERS)
    backward = Rendezvous(MEMBERS[::-1])
    assert [forward.members[i] for i in forward.owners(keys)] == [backward.members[i] for i in backward.owners(keys)]


@pytest.mark.parametrize("gone", range(len(MEMBERS)))
def test_removing_a_member_moves_only_its_keys(gone):
    keys = random_keys(5000, seed=3)
    before = Rendezvous(MEMBERS)
    after = Rendezvous(MEMBERS[:gone] + MEMBERS[gone + 1:])
    owner_before = np.array(before.members)[before.owners(keys)]
    owner_after = np.array(after.members)[after.owners(keys)]
    moved = owner_before != owner_after
    assert (owner_before[moved] == MEMBERS[gone]).all()
    assert moved.sum() == (owner_before == MEMBERS[gone]).sum()  # every key it owned, and only those
    # they go where the ranking said: each key's second choice
    second = np.array(before.members)[before.ranked(keys, 2)[:, 1]]
    assert (owner_after[moved] == second[moved]).all()


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
def test_balance_is_about_one_over_n(n):
    keys = random_keys(40000, seed=4)
    shares = np.bincount(Rendezvous([f"10.1.0.{i}:7410" for i in range(n)]).owners(keys), minlength=n) / len(keys)
    assert np.abs(shares - 1 / n).max() < 0.1 / n + 0.005


def test_chained_keys_spread_too():
    ns_id = keyspace_ns_id("routing")
    keys = chain_keys(ns_id, list(range(16 * 4000)), 16)
    shares = np.bincount(Rendezvous(MEMBERS[:4]).owners(keys), minlength=4) / len(keys)
    assert np.abs(shares - 0.25).max() < 0.03


def test_ranked_is_an_ordering_that_starts_at_the_owner():
    keys = random_keys(3000, seed=5)
    r = Rendezvous(MEMBERS)
    ranked = r.ranked(keys, len(MEMBERS))
    assert (ranked[:, 0] == r.owners(keys)).all()
    assert (np.sort(ranked, axis=1) == np.arange(len(MEMBERS))).all()
    assert (r.ranked(keys, 2) == ranked[:, :2]).all()
    # dropping a member keeps the others in their order
    fewer = Rendezvous(MEMBERS[1:])
    names = np.array(MEMBERS)[ranked]
    kept = names[names != MEMBERS[0]].reshape(len(keys), len(MEMBERS) - 1)
    assert (np.array(fewer.members)[fewer.ranked(keys, len(MEMBERS) - 1)] == kept).all()


def test_ranked_by_argmax_is_the_stable_sort_order_ties_included():
    from kvtier.client.routing import RANK_BY_ARGMAX_MAX, _top

    rng = np.random.default_rng(9)
    scores = rng.integers(0, 2**64, size=(2000, 16), dtype=np.uint64)
    scores[:50] = 7  # every column tied
    scores[50:100, ::2] = 0  # ties at zero among half the columns
    scores[100:150] = 0
    scores[150:200, 3] = scores[150:200, 9] = np.uint64(2**64 - 1)  # a tie for first place
    for count in range(1, RANK_BY_ARGMAX_MAX + 2):
        want = np.argsort(~scores, axis=1, kind="stable")[:, :count]
        assert (_top(scores.copy(), count) == want).all(), count


def test_ranked_keeps_the_ranking_of_a_full_sort():
    from kvtier.client.routing import _key_hashes

    keys = random_keys(4096, seed=8)
    members = [f"node-{i:02d}" for i in range(16)]
    r = Rendezvous(members)
    full = np.argsort(~r._scores(_key_hashes(keys)), axis=1, kind="stable")
    for count in (1, 2, 3, 16):
        assert (r.ranked(keys, count) == full[:, :count]).all()


def test_groups_and_positions_by_owner():
    assert positions_by_owner(np.array([2, 0, 2, 1, 0])) == {0: [1, 4], 1: [3], 2: [0, 2]}
    assert positions_by_owner(np.array([], dtype=np.intp)) == {}
    keys = random_keys(50, seed=6)
    r = Rendezvous(MEMBERS)
    groups = r.groups(keys)
    owners = r.owners(keys)
    assert sorted(i for idx in groups.values() for i in idx) == list(range(50))
    assert all((owners[idx] == m).all() and idx == sorted(idx) for m, idx in groups.items())
    assert Rendezvous(["only:1"]).groups(keys) == {0: list(range(50))}
    assert Rendezvous(["only:1"]).ranked(keys, 1).tolist() == [[0]] * 50
    assert positions_by_owner(np.full(4, 3)) == {3: [0, 1, 2, 3]}
    assert Rendezvous(MEMBERS).owners([]).tolist() == []


def test_bad_input():
    with pytest.raises(ValueError, match="distinct"):
        Rendezvous([])
    with pytest.raises(ValueError, match="distinct"):
        Rendezvous(["a:1", "a:1"])
    with pytest.raises(ValueError, match="16 bytes"):
        Rendezvous(MEMBERS).owners([b"\x00" * 16, b"\x00" * 15])
    with pytest.raises(ValueError, match="16 bytes"):
        Rendezvous(["only:1"]).owners([b"short"])
    with pytest.raises(ValueError, match="16 bytes"):
        Rendezvous(["only:1"]).ranked([b"\x00" * 16, b"short"], 1)
    with pytest.raises(ValueError, match="count"):
        Rendezvous(MEMBERS).ranked(random_keys(2), len(MEMBERS) + 1)


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)


@pytest.fixture(scope="module")
def two_daemons(tmp_path_factory):
    a = start_kvtierd(tmp_path_factory.mktemp("route-a"))
    b = start_kvtierd(tmp_path_factory.mktemp("route-b"))
    yield a, b
    assert a.stop() == 0
    assert b.stop() == 0


def _holders(addrs, keys) -> list[int]:
    held = []
    for addr in addrs:
        with BlockClient(addr) as client:
            held.append([b is not None for b in client.get_many(keys)])
    held_np = np.array(held)
    assert (held_np.sum(axis=0) == 1).all()  # each block on exactly one daemon
    return held_np.argmax(axis=0).tolist()


def test_kvcache_and_kvperf_route_alike(two_daemons):
    addrs = [d.data_addr for d in two_daemons]
    tokens = list(range(20000, 20000 + 8 * 40))
    gen = torch.Generator().manual_seed(11)
    kv = [(torch.randn(1, 2, len(tokens), 16, generator=gen).half(),
           torch.randn(1, 2, len(tokens), 16, generator=gen).half()) for _ in range(2)]
    with KVCache(Namespace("routing-model", LAYOUT, "raw"), addrs, hot_pool_bytes=0) as cache:
        assert cache.store(tokens, kv) == 40
        keys = cache.keys_for(tokens)
    holders = _holders(addrs, keys)
    assert 0 < sum(holders) < 40
    conns = Connections(parse_targets(",".join(f"tcp://{a}" for a in addrs)), None, 1)
    assert conns.owners(keys).tolist() == holders
    assert Rendezvous(addrs).owners(keys).tolist() == holders


def test_kvperf_prefix_puts_blocks_on_their_owners(two_daemons, tmp_path, capsys):
    addrs = [d.data_addr for d in two_daemons]
    prompt = list(range(500, 500 + 16 * 24))
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(prompt) + "\n" + json.dumps(prompt) + "\n")
    code = run(["--output-format=json", f"--target={','.join(f'tcp://{a}' for a in addrs)}", "--name=p",
                "--rw=prefix", f"--trace={trace}", "--bs=4k", "--block_tokens=16", "--iodepth=1",
                "--keyspace=routing-prefix", "--verify=1"])
    doc = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK
    p = doc["jobs"][0]["prefix"]
    assert (p["requests"], p["blocks"], p["hit_blocks"]) == (2, 48, 24)  # the second prompt hits whole
    keys = chain_keys(keyspace_ns_id("routing-prefix"), prompt, 16)
    holders = _holders(addrs, keys)
    assert 0 < sum(holders) < 24
    assert Rendezvous(addrs).owners(keys).tolist() == holders
