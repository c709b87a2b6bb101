"""Re-replication: the plan (pure), the rate limit (fake clock), ``GET /v1/keys`` paging, and
``kvtier cluster repair`` against a real etcd and kvtierd: a 4th node receives only its
share, a second pass copies nothing, a clean leave is refilled from the replicas."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from cluster_fixtures import etcd, start_member, wait_members  # noqa: F401
from kvtier.client import BlockClient
from kvtier.client.kvcache import KVCache
from kvtier.client.routing import Rendezvous
from kvtier.common.keys import KVLayout, Namespace
from kvtier.tools.admin_cli import EXIT_OK, main as kvtier_main
from kvtier.tools.cluster_repair import ByteRate, ClusterRepairer, list_keys
from kvtier.tools.cluster_repair_plan import holdings_matrix, placement_change, plan_repairs

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)
NODES = ("node-a", "node-b", "node-c")
BLOCKS = 96


def k(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8


def test_holdings_dedupe_in_first_seen_order():
    keys, holds = holdings_matrix([k(3) + k(1), b"", k(1) + k(2)])
    assert [bytes(r) for r in keys] == [k(3), k(1), k(2)]
    assert holds.tolist() == [[True, False, False], [True, False, True], [False, False, True]]
    with pytest.raises(ValueError, match="listing 1: 17 bytes"):
        holdings_matrix([b"", b"x" * 17])


def test_plan_copies_each_missing_key_from_its_first_owner_that_holds_it():
    ids = ("a", "b", "c", "d")
    keys = [k(i) for i in range(40)]
    owners = Rendezvous(ids).ranked(keys, 2)
    old = Rendezvous(ids[:3]).ranked(keys, 2)  # where they were before d joined
    listings = [b"".join(key for key, row in zip(keys, old) if j in row) for j in range(3)] + [b""]
    plan = plan_repairs(ids, listings, 2, batch_keys=4)
    want: dict[tuple[int, int], list[bytes]] = {}
    for key, row, was in zip(keys, owners, old):
        for t in row:
            if t not in was:
                src = next((int(o) for o in row if o in was), int(min(was)))
                want.setdefault((src, int(t)), []).append(key)
    got: dict[tuple[int, int], list[bytes]] = {}
    for tr in plan.transfers:
        assert 1 <= len(tr.keys) <= 4
        got.setdefault((tr.source, tr.target), []).extend(tr.keys)
    assert {pair: sorted(v) for pair, v in got.items()} == want  # keys in listing order; compared as sets
    assert all(t == 3 for _, t in got)  # only the joiner receives
    assert plan.copies_missing == sum(len(v) for v in want.values()) == plan.copies_to(3)
    assert plan.keys_listed == 40
    full = [b"".join(key for key, row in zip(keys, owners) if j in row) for j in range(4)]
    assert plan_repairs(ids, full, 2).transfers == ()  # all in place: nothing to do


def test_plan_refills_a_lost_replica_from_the_survivor_only():
    ids = ("a", "b", "c")
    keys = [k(i) for i in range(30)]
    owners = Rendezvous(ids).ranked(keys, 2)
    listings = [b"".join(key for key, row in zip(keys, owners) if j in row and j != 1) for j in range(3)]
    plan = plan_repairs(ids, listings, 2)  # b lost its copies (a restart on empty devices)
    assert {(t.source, t.target) for t in plan.transfers} <= {(0, 1), (2, 1)}
    assert plan.copies_to(1) == int((owners == 1).any(axis=1).sum())


def test_plan_bad_input():
    with pytest.raises(ValueError, match="2 listings and 3 deleted lists for 3 members"):
        plan_repairs(("a", "b", "c"), [b"", b""], 2)
    with pytest.raises(ValueError, match="replicas"):
        plan_repairs(("a",), [b""], 0)
    assert plan_repairs(("a", "b"), [b"", b""], 2).transfers == ()


def test_placement_change_of_a_fourth_node_is_about_a_quarter():
    keys = [bytes(r) for r in np.random.default_rng(1).integers(0, 256, (20000, 16), dtype=np.uint8)]
    change = placement_change(keys, ["a", "b", "c"], ["a", "b", "c", "d"], 2)
    assert abs(change.first_owner_changed - 0.25) < 0.02
    assert abs(change.copies_moved - 0.25) < 0.02
    assert abs(change.owner_set_changed - 0.5) < 0.02  # d is one of a key's two owners half the time


def test_byte_rate_spaces_sends():
    now = [0.0]
    rate = ByteRate(2 << 20, lambda: now[0])
    assert rate.delay_s(1 << 20) == 0.0
    assert rate.delay_s(1 << 20) == pytest.approx(0.5)
    now[0] = 5.0  # idle time is not saved up
    assert rate.delay_s(1 << 20) == 0.0
    with pytest.raises(ValueError, match="under the minimum"):
        ByteRate(10, lambda: 0.0)


def make_blocks(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYOUT.block_shape, generator=g).half() for _ in range(n)]


def held(address: str, keys: list[bytes]) -> np.ndarray:
    with BlockClient(address) as c:
        return np.array([b is not None for b in c.get_many(keys)])


def test_a_joining_node_gets_its_share_and_a_clean_leave_is_refilled(etcd, tmp_path, capsys):  # noqa: F811
    daemons = {n: start_member(tmp_path, etcd, n, admin="127.0.0.1:0") for n in NODES}
    try:
        namespace = Namespace(model="repair", layout=LAYOUT, codec="raw")
        keys = namespace.keys(list(range(BLOCKS * LAYOUT.block_tokens)))
        blocks = make_blocks(BLOCKS, 5)
        with KVCache(namespace, etcd.url(), hot_pool_bytes=0, timeout_s=5.0) as cache:
            wait_members(cache._warm.pool.members, lambda v: v.node_ids == NODES)
            assert cache.store_blocks(keys, blocks) == BLOCKS
        with BlockClient(daemons["node-a"].data_addr) as c:
            block_bytes = max(len(bytes(b)) for b in c.get_many(keys) if b is not None)
        listed = list_keys(daemons["node-a"].admin_addr, None)
        assert len(listed) % 16 == 0 and set(listed[i:i + 16] for i in range(0, len(listed), 16)) == \
            {key for key, h in zip(keys, held(daemons["node-a"].data_addr, keys)) if h}

        daemons["node-d"] = start_member(tmp_path, etcd, "node-d", admin="127.0.0.1:0")
        repairer = ClusterRepairer(etcd.url(), rate_bytes_s=64 << 20)
        try:
            view = repairer.view_now()
            assert view.node_ids == (*NODES, "node-d")
            owners = Rendezvous(view.node_ids).ranked(keys, 2)
            mine = (owners == 3).any(axis=1)
            figures = repairer.run_pass()
            assert figures.copies_missing == figures.blocks_copied == int(mine.sum())
            assert figures.blocks_failed == 0 and figures.nodes_unlisted == 0
            assert set(figures.bytes_moved_to) == {"node-d"}  # nobody else receives anything
            assert 0.35 < mine.mean() < 0.65  # half the keys have d as one of two owners: a quarter of the copies
            assert (held(daemons["node-d"].data_addr, keys) == mine).all()
            assert figures.bytes_moved == block_bytes * int(mine.sum())  # every block is the same size
            again = repairer.run_pass()
            assert again.copies_missing == again.blocks_copied == 0  # nothing left

            assert kvtier_main(["--json", "cluster", "status", "--cluster", etcd.url()]) == EXIT_OK
            doc = json.loads(capsys.readouterr().out)
            assert doc["repair"]["passes"] == 2 and doc["repair"]["bytes_moved"] == figures.bytes_moved
            by_node = {n["node_id"]: n for n in doc["members"]}
            assert by_node["node-d"]["repair_bytes_received"] == figures.bytes_moved
            assert by_node["node-a"]["repair_bytes_received"] == 0
            assert by_node["node-a"]["figures"]["members_seen"] >= 3
            with urllib.request.urlopen(f"http://{daemons['node-d'].admin_addr}/v1/stats") as resp:
                stats = json.loads(resp.read())
            received = stats["server"]["repair_bytes_in"]
            assert figures.bytes_moved <= received < figures.bytes_moved + 4096 * (figures.blocks_copied // 256 + 1)
            assert stats["cluster"]["node_id"] == "node-d" and stats["cluster"]["state"] == "registered"
            with urllib.request.urlopen(f"http://{daemons['node-d'].admin_addr}/metrics") as resp:
                metrics = resp.read().decode()
            assert f"kvtier_cluster_repair_received_bytes_total {float(received)}" in metrics
            with urllib.request.urlopen(f"http://{daemons['node-a'].admin_addr}/v1/stats") as resp:
                assert json.loads(resp.read())["server"]["repair_bytes_in"] == 0  # a source only

            assert daemons["node-a"].stop() == 0  # a clean leave: it hands nothing off
            left = wait_repairer_view(repairer, ("node-b", "node-c", "node-d"))
            owners_after = Rendezvous(left.node_ids).ranked(keys, 2)
            before = np.array([held(daemons[name].data_addr, keys) for name in left.node_ids])  # [node, key]
            lacking = int((~before[owners_after, np.arange(len(keys))[:, None]]).sum())
            assert 0 < lacking <= int((owners == 0).any(axis=1).sum())  # at most one copy per key node-a owned
            figures = repairer.run_pass(left)
            assert figures.blocks_failed == 0 and figures.blocks_copied == lacking
            for j, name in enumerate(left.node_ids):
                assert (held(daemons[name].data_addr, keys) >= (owners_after == j).any(axis=1)).all()
        finally:
            repairer.close()
    finally:
        for d in daemons.values():
            if d.alive():
                assert d.stop() == 0, d.log_tail()


def wait_repairer_view(repairer: ClusterRepairer, node_ids: tuple[str, ...]):
    from kvtier.client.cluster_members import open_members

    with open_members(repairer.url.text) as members:
        view, _ = wait_members(members, lambda v: v.node_ids == node_ids)
    return view


def test_keys_listing_pages_and_refuses_bad_limits(etcd, tmp_path):  # noqa: F811
    d = start_member(tmp_path, etcd, "node-k", admin="127.0.0.1:0")
    try:
        keys = [k(i) for i in range(1, 12)]
        blocks = []
        from kvtier.common.blockformat import encode_block
        for key in keys:
            blocks.append((key, memoryview(encode_block(key, b"\x00" * 16, 0, b"\x01" * 64))))
        with BlockClient(d.data_addr) as c:
            c.put_many(blocks)
        seen, cursor, pages = [], 0, 0
        while True:
            with urllib.request.urlopen(f"http://{d.admin_addr}/v1/keys?cursor={cursor}&limit=4") as resp:
                page = json.loads(resp.read())
            assert len(page["keys"]) <= 4
            seen += page["keys"]
            pages += 1
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert sorted(seen) == sorted(key.hex() for key in keys) and pages == 3
        for bad in ("limit=0", "limit=65537", "cursor=-1", "cursor=x"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://{d.admin_addr}/v1/keys?{bad}")
            assert err.value.code == 422
            assert json.loads(err.value.read())  # a JSON error naming the parameter
    finally:
        assert d.stop() == 0, d.log_tail()


def test_the_watching_repairer_fills_a_node_that_joins(etcd, tmp_path):  # noqa: F811
    import threading

    daemons = {n: start_member(tmp_path, etcd, n, admin="127.0.0.1:0") for n in NODES[:2]}
    repairer = ClusterRepairer(etcd.url(), rate_bytes_s=64 << 20)
    thread = threading.Thread(target=repairer.run, kwargs={"interval_s": 600.0})
    try:
        namespace = Namespace(model="watch", layout=LAYOUT, codec="raw")
        keys = namespace.keys(list(range(48 * LAYOUT.block_tokens)))
        with KVCache(namespace, etcd.url(), hot_pool_bytes=0, timeout_s=5.0) as cache:
            wait_members(cache._warm.pool.members, lambda v: v.node_ids == NODES[:2])
            assert cache.store_blocks(keys, make_blocks(48, 6)) == 48
        thread.start()
        assert repairer.wait_passes(1, 30.0).passes == 1  # the pass at start: both members hold everything
        assert repairer.total.blocks_copied == 0
        daemons["node-c"] = start_member(tmp_path, etcd, "node-c", admin="127.0.0.1:0")
        total = repairer.wait_passes(2, 30.0)  # the join is a membership change: a pass, not the 600 s interval
        assert total.passes >= 2
        owners = Rendezvous(NODES).ranked(keys, 2)
        assert total.blocks_copied == int((owners == 2).any(axis=1).sum())
        assert (held(daemons["node-c"].data_addr, keys) == (owners == 2).any(axis=1)).all()
    finally:
        repairer.stop()
        if thread.is_alive():
            thread.join(30.0)
        repairer.close()
        for d in daemons.values():
            if d.alive():
                assert d.stop() == 0, d.log_tail()


def test_repair_command_once_and_its_errors(etcd, tmp_path, capsys):  # noqa: F811
    a = start_member(tmp_path, etcd, "node-a", admin="127.0.0.1:0")
    b = start_member(tmp_path, etcd, "node-b")  # no admin API: its keys cannot be listed
    try:
        assert kvtier_main(["cluster", "repair", "--cluster", etcd.url(), "--rate", "10"]) == 2
        assert "rate 10 B/s is under the minimum" in capsys.readouterr().err
        assert kvtier_main(["--json", "cluster", "repair", "--cluster", etcd.url(), "--once"]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert doc["passes"] == 1 and doc["nodes_unlisted"] == 1 and doc["blocks_copied"] == 0
        assert b.stop() == 0
        from kvtier.client.cluster_members import open_members
        with open_members(etcd.url()) as members:
            wait_members(members, lambda v: v.node_ids == ("node-a",))
        assert kvtier_main(["cluster", "repair", "--cluster", etcd.url(), "--once"]) == EXIT_OK
        assert "repair pass: 0 keys listed" in capsys.readouterr().out
    finally:
        for d in (a, b):
            if d.alive():
                assert d.stop() == 0, d.log_tail()
