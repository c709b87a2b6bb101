"""Re-replication after deletes: the plan never copies a key one of its owners deleted lately
and deletes it where it is still held (pure), and ``kvtier cluster repair`` against a real etcd
and kvtierd: blocks deleted while one replica was away are not brought back when it returns."""
from __future__ import annotations

import json
import urllib.request

import numpy as np

from cluster_fixtures import etcd, start_member, wait_members  # noqa: F401
from kvtier.client.kvcache import KVCache
from kvtier.client.routing import Rendezvous
from kvtier.common.keys import Namespace
from kvtier.tools.cluster_repair import ClusterRepairer
from kvtier.tools.cluster_repair_plan import plan_repairs

from test_cluster_repair import LAYOUT, NODES, held, k, make_blocks, wait_repairer_view

BLOCKS = 48


def joined(keys) -> bytes:
    return b"".join(keys)


def test_a_key_an_owner_deleted_is_deleted_where_held_and_never_copied():
    ids = ("a", "b", "c")
    keys = [k(i) for i in range(60)]
    owners = Rendezvous(ids).ranked(keys, 2)
    listings = [joined(key for key, row in zip(keys, owners) if j in row) for j in range(3)]
    gone_on_a = [key for key, row in zip(keys, owners) if 0 in row][:10]  # a deleted them; its co-owner did not
    listings[0] = joined(key for key, row in zip(keys, owners) if 0 in row and key not in gone_on_a)
    plan = plan_repairs(ids, listings, 2, batch_keys=4, deleted=[joined(gone_on_a), b"", b""])
    assert plan.transfers == ()  # nothing else is missing, and the deleted keys are not copied back to a
    assert plan.keys_deleted == 10 and plan.copies_missing == 0
    to_delete: dict[int, list[bytes]] = {}
    for d in plan.deletions:
        assert 1 <= len(d.keys) <= 4
        to_delete.setdefault(d.target, []).extend(d.keys)
    co_owner = {key: int(next(o for o in row if o != 0)) for key, row in zip(keys, owners)}
    assert {t: sorted(v) for t, v in to_delete.items()} == \
        {t: sorted(key for key in gone_on_a if co_owner[key] == t) for t in set(co_owner[key] for key in gone_on_a)}


def test_a_delete_logged_by_a_non_owner_or_by_an_owner_that_holds_the_key_changes_nothing():
    ids = ("a", "b", "c")
    keys = [k(i) for i in range(30)]
    owners = Rendezvous(ids).ranked(keys, 2)
    listings = [joined(key for key, row in zip(keys, owners) if j in row and j != 1) for j in range(3)]
    not_owner = [joined(key for key, row in zip(keys, owners) if j not in row) for j in range(3)]
    plan = plan_repairs(ids, listings, 2, deleted=not_owner)  # b lost its copies; the others' deletes are not b's
    assert plan.keys_deleted == 0 and plan.deletions == ()
    assert plan.copies_to(1) == plan.copies_missing == int((owners == 1).any(axis=1).sum())
    holders = [joined(key for key, row in zip(keys, owners) if j in row) for j in range(3)]
    plan = plan_repairs(ids, holders, 2, deleted=holders)  # stored again after the delete: it holds them
    assert plan.transfers == () and plan.deletions == () and plan.keys_deleted == 0


def test_blocks_deleted_while_a_replica_was_away_are_not_brought_back(etcd, tmp_path):  # noqa: F811
    daemons = {n: start_member(tmp_path, etcd, n, admin="127.0.0.1:0") for n in NODES}
    try:
        namespace = Namespace(model="repair-deletes", layout=LAYOUT, codec="raw")
        keys = namespace.keys(list(range(BLOCKS * LAYOUT.block_tokens)))
        owners = Rendezvous(NODES).ranked(keys, 2)
        away = owners == 2  # node-c's copies
        with KVCache(namespace, etcd.url(), hot_pool_bytes=0, timeout_s=5.0) as cache:
            wait_members(cache._warm.pool.members, lambda v: v.node_ids == NODES)
            assert cache.store_blocks(keys, make_blocks(BLOCKS, 7), durable=True) == BLOCKS
            assert daemons["node-c"].stop() == 0  # away: it keeps its copies on its devices
            wait_members(cache._warm.pool.members, lambda v: v.node_ids == NODES[:2])
            cache.delete_blocks_async(keys).result(timeout=30)
        assert not held(daemons["node-a"].data_addr, keys).any() and not held(daemons["node-b"].data_addr, keys).any()
        daemons["node-c"] = start_member(tmp_path, etcd, "node-c", admin="127.0.0.1:0")  # back, same devices
        back = held(daemons["node-c"].data_addr, keys)
        assert back.sum() == away.any(axis=1).sum() > 0
        with urllib.request.urlopen(f"http://{daemons['node-a'].admin_addr}/v1/keys/deleted?limit=4") as reply:
            page = json.loads(reply.read())
        assert len(page["keys"]) == 4 and page["next_cursor"] == 4
        repairer = ClusterRepairer(etcd.url(), rate_bytes_s=64 << 20)
        try:
            view = wait_repairer_view(repairer, NODES)
            figures = repairer.run_pass(view)
            assert figures.blocks_copied == 0 and figures.copies_missing == 0  # nothing copied back
            assert figures.keys_deleted == figures.blocks_deleted == int(back.sum())
            assert figures.blocks_failed == 0
            for name in NODES:
                assert not held(daemons[name].data_addr, keys).any(), name
            again = repairer.run_pass(view)
            assert again.blocks_copied == again.blocks_deleted == again.keys_listed == 0
        finally:
            repairer.close()
    finally:
        for d in daemons.values():
            if d.alive():
                assert d.stop() == 0, d.log_tail()
