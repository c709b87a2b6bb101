"""KVCache over an etcd cluster of 3 real kvtierd (loopback): replicas on rendezvous owners,
failover on kill -9, members dropped within the lease TTL, read-repair; a static list as before."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster_fixtures import LEASE_TTL_S, etcd, start_member, wait_members  # noqa: F401
from daemon_proc import start_kvtierd
from kvtier.client import BlockClient
from kvtier.client.kvcache import KVCache
from kvtier.client.owner_pool import WriteQuorumError
from kvtier.common.keys import KVLayout, Namespace

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)
NODES = ("node-a", "node-b", "node-c")
BLOCKS = 24
LOADS_AFTER_KILL = 12  # loads spread over the lease TTL: before and after the dead node leaves the view


def ns(name: str) -> Namespace:
    return Namespace(model=name, layout=LAYOUT, codec="raw")


def make_kv(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (1, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return [(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
            for _ in range(LAYOUT.num_layers)]


def prefix_equal(layers, kv, tokens: int) -> bool:
    return all(torch.equal(k, rk[:, :, :tokens]) and torch.equal(v, rv[:, :, :tokens])
               for (k, v), (rk, rv) in zip(layers, kv))


def held_by(address: str, keys: list[bytes]) -> list[bool]:
    with BlockClient(address) as client:
        return [b is not None for b in client.get_many(keys)]


@pytest.fixture
def cluster(etcd, tmp_path):  # noqa: F811
    daemons = {name: start_member(tmp_path, etcd, name) for name in NODES}
    yield etcd, daemons
    for d in daemons.values():
        if d.alive():
            assert d.stop() == 0, d.log_tail()


def placement_of(cache: KVCache, keys: list[bytes]):
    """(the cache's member view now, each key's two owners as indexes into it)."""
    with cache._warm.pool.batch() as batch:
        return batch.view, batch.placement(keys, 2)


def open_cache(etcd_server, name: str, as_list: bool = False, **kw) -> KVCache:
    target = [etcd_server.url()] if as_list else etcd_server.url()  # a list of one URL is the cluster too
    cache = KVCache(ns(name), target, hot_pool_bytes=0, timeout_s=5.0, **kw)
    wait_members(cache._warm.pool.members, lambda v: v.node_ids == NODES)
    return cache


def test_store_places_each_block_on_two_owners_and_survives_kill_9(cluster):
    etcd_server, daemons = cluster
    tokens = list(range(5000, 5000 + BLOCKS * 8))
    kv = make_kv(len(tokens), seed=1)
    with open_cache(etcd_server, "kill9") as cache:
        assert cache.store(tokens, kv) == BLOCKS
        keys = cache.keys_for(tokens)
        view, place = placement_of(cache, keys)
        held = np.array([held_by(daemons[n].data_addr, keys) for n in view.node_ids])
        expected = np.zeros_like(held)
        for i, row in enumerate(place):
            expected[row, i] = True
        assert (held == expected).all()  # exactly on its two rendezvous owners
        victim = view.node_ids[int(place[0, 0])]  # the first owner of the first block
        daemons[victim].kill()
        wrong = 0
        for n in range(LOADS_AFTER_KILL):
            assert cache.lookup(tokens) == len(tokens)
            loaded = cache.load(tokens)
            wrong += not (loaded.num_tokens == len(tokens) and prefix_equal(loaded.layers, kv, len(tokens)))
            if n == 0:
                assert cache.statistics().warm.failovers > 0
            cache._warm.pool.members.wait_changed(cache._warm.pool.members.current().version, LEASE_TTL_S / 4)
        assert wrong == 0
        view, waited_s = wait_members(cache._warm.pool.members, lambda v: victim not in v.node_ids)
        assert waited_s <= LEASE_TTL_S + 1, f"{victim} left the view {waited_s:.2f} s after kill -9"
        loaded = cache.load(tokens)
        assert loaded.num_tokens == len(tokens) and prefix_equal(loaded.layers, kv, len(tokens))
        view, place = placement_of(cache, keys)
        assert victim not in view.node_ids and len(view) == 2 and place.shape == (len(keys), 2)
        assert daemons[victim].data_addr not in [d.address for d in cache._warm.daemons]  # its connection closed
        st = cache.statistics()
        assert st.warm.failovers > 0 and st.as_dict()["warm"]["failovers"] == st.warm.failovers


def test_durable_put_needs_every_owner_and_buffered_one(cluster):
    etcd_server, daemons = cluster
    with open_cache(etcd_server, "quorum", as_list=True) as cache:
        assert cache._warm.replicas == 2  # the default on etcd
        keys = cache.keys_for(list(range(900, 900 + 16 * 8)))
        blocks = [torch.randn(LAYOUT.block_shape).half() for _ in keys]
        view, place = placement_of(cache, keys)
        victim = view.node_ids[int(place[0, 0])]
        daemons[victim].kill()  # still in the view until its lease expires
        assert cache.store_blocks(keys, blocks) == len(keys)  # buffered: one owner of each block is enough
        with pytest.raises(WriteQuorumError, match=victim):
            cache.store_blocks(keys, blocks, durable=True)
        got = cache.load_blocks(keys)
        assert all(g is not None and torch.equal(g, b) for g, b in zip(got, blocks))


def test_a_durable_put_with_fewer_live_members_than_replicas_is_refused_and_stores_nothing(cluster):
    etcd_server, daemons = cluster
    with open_cache(etcd_server, "quorum-members") as cache:
        keys = cache.keys_for(list(range(1200, 1200 + 4 * 8)))
        blocks = [torch.randn(LAYOUT.block_shape).half() for _ in keys]
        for name in NODES[1:]:
            assert daemons[name].stop() == 0  # they leave the view at once (their keys are deleted)
        wait_members(cache._warm.pool.members, lambda v: v.node_ids == NODES[:1])
        with pytest.raises(WriteQuorumError, match="needs 2 owners.*has 1 live members"):
            cache.store_blocks(keys, blocks, durable=True)
        assert held_by(daemons[NODES[0]].data_addr, keys) == [False] * len(keys)
        assert cache.store_blocks(keys, blocks) == len(keys)  # buffered: one owner is enough


def written_while_the_first_owner_was_away(name: str, view, place, keys, blocks, indexes) -> None:
    """Store blocks ``indexes`` on their second owner only (a static list of that one daemon)."""
    for i in indexes:
        with KVCache(ns(name), view.addresses[int(place[i, 1])], hot_pool_bytes=0, timeout_s=5.0) as second:
            assert second.store_blocks([keys[i]], [blocks[i]], durable=True) == 1


def test_read_repair_puts_a_block_back_on_its_first_owner(cluster):
    etcd_server, daemons = cluster
    with open_cache(etcd_server, "repair") as cache:
        keys = cache.keys_for(list(range(7000, 7000 + BLOCKS * 8)))
        blocks = [torch.randn(LAYOUT.block_shape, generator=torch.Generator().manual_seed(i)).half()
                  for i in range(len(keys))]
        view, place = placement_of(cache, keys)
        lost = [0, 5, 9]  # blocks the first owner lacks: it missed their writes
        written_while_the_first_owner_was_away("repair", view, place, keys, blocks, lost)
        kept = [i for i in range(len(keys)) if i not in lost]
        assert cache.store_blocks([keys[i] for i in kept], [blocks[i] for i in kept], durable=True) == len(kept)
        assert all(torch.equal(got, want) for got, want in zip(cache.load_blocks(keys), blocks))
        cache._warm.wait_repairs(timeout_s=10.0)
        assert cache.statistics().warm.repairs == len(lost)
        assert cache.statistics().warm.repairs_declined == 0
        assert cache.statistics().warm.failovers == 0  # every owner answered
        for i in lost:
            assert held_by(view.addresses[int(place[i, 0])], [keys[i]]) == [True]
        cache.load_blocks(keys)  # nothing left to repair
        cache._warm.wait_repairs(timeout_s=10.0)
        assert cache.statistics().warm.repairs == len(lost)


def test_read_repair_of_a_key_asked_twice_writes_it_back_once(cluster):
    etcd_server, daemons = cluster
    with open_cache(etcd_server, "repair-twice") as cache:
        keys = cache.keys_for(list(range(9100, 9100 + 2 * 8)))
        blocks = [torch.randn(LAYOUT.block_shape).half() for _ in keys]
        view, place = placement_of(cache, keys)
        written_while_the_first_owner_was_away("repair-twice", view, place, keys, blocks, [0])
        assert cache.store_blocks(keys[1:], blocks[1:], durable=True) == 1
        got = cache.load_blocks([keys[0], keys[1], keys[0]])
        assert torch.equal(got[0], blocks[0]) and torch.equal(got[2], blocks[0]) and torch.equal(got[1], blocks[1])
        cache._warm.wait_repairs(timeout_s=10.0)
        assert cache.statistics().warm.repairs == 1
        assert held_by(view.addresses[int(place[0, 0])], [keys[0]]) == [True]


def test_read_repair_does_not_bring_back_a_block_its_first_owner_deleted(cluster):
    """The second owner missed a delete: a load is served from it, but the first owner, which
    deleted the key, declines the repair; a client's own store of the key is taken as always."""
    etcd_server, daemons = cluster
    with open_cache(etcd_server, "repair-deleted") as cache:
        keys = cache.keys_for(list(range(9300, 9300 + 2 * 8)))
        blocks = [torch.randn(LAYOUT.block_shape).half() for _ in keys]
        assert cache.store_blocks(keys, blocks, durable=True) == 2
        view, place = placement_of(cache, keys)
        first_owner = view.addresses[int(place[0, 0])]
        with BlockClient(first_owner) as client:
            assert client.delete_many([keys[0]]) == [True]
        assert torch.equal(cache.load_blocks([keys[0]])[0], blocks[0])
        cache._warm.wait_repairs(timeout_s=10.0)
        warm = cache.statistics().warm
        assert (warm.repairs, warm.repairs_declined) == (0, 1)
        assert held_by(first_owner, [keys[0]]) == [False]
        assert cache.store_blocks(keys[:1], blocks[:1], durable=True) == 1
        assert held_by(first_owner, [keys[0]]) == [True]


def test_deleted_blocks_leave_every_owner_on_an_etcd_cluster(cluster):
    etcd_server, daemons = cluster
    with open_cache(etcd_server, "delete") as cache:
        keys = cache.keys_for(list(range(8000, 8000 + 12 * 8)))
        cache.store_blocks(keys, [torch.randn(LAYOUT.block_shape).half() for _ in keys], durable=True)
        view, _ = placement_of(cache, keys)
        assert sum(sum(held_by(a, keys)) for a in view.addresses) == 2 * len(keys)
        assert cache.delete_blocks_async(keys[:5]).result(30) == 2 * 5
        held = np.array([held_by(a, keys) for a in view.addresses])
        assert not held[:, :5].any() and (held[:, 5:].sum(axis=0) == 2).all()


def test_static_list_keeps_one_owner_per_block(tmp_path):
    daemons = [start_kvtierd(tmp_path / f"d{i}") for i in range(2)]
    try:
        tokens = list(range(3000, 3000 + 12 * 8))
        kv = make_kv(len(tokens), seed=3)
        addrs = ",".join(d.data_addr for d in daemons)
        with KVCache(ns("static"), addrs.split(","), hot_pool_bytes=0) as cache:
            assert cache._warm.replicas == 1
            assert cache.store(tokens, kv) == 12
            loaded = cache.load(tokens)
            assert loaded.num_tokens == len(tokens) and prefix_equal(loaded.layers, kv, len(tokens))
            keys = cache.keys_for(tokens)
        held = np.array([held_by(d.data_addr, keys) for d in daemons])
        assert (held.sum(axis=0) == 1).all()
        with KVCache(ns("static"), addrs.split(","), hot_pool_bytes=0, replicas=2) as cache:
            assert cache.store_blocks(keys, [torch.zeros(LAYOUT.block_shape).half()] * len(keys)) == len(keys)
        held = np.array([held_by(d.data_addr, keys) for d in daemons])
        assert (held.sum(axis=0) == 2).all()
    finally:
        for d in daemons:
            assert d.stop() == 0, d.log_tail()


def test_replicas_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="replicas"):
        KVCache(ns("bad"), "127.0.0.1:1", replicas=0)


class _FakeDaemon:
    def __init__(self, address: str, opened: list) -> None:
        self.address, self.reader, self.client, self.closed = address, None, self, False
        opened.append(address)

    def close(self) -> None:
        self.closed = True


class _Members:
    """A membership source the test changes by hand."""

    def __init__(self, *addresses: str) -> None:
        self.set(*addresses, version=1)

    def set(self, *addresses: str, version: int) -> None:
        from kvtier.client.cluster_members import Member, MemberView
        self.view = MemberView(tuple(Member(a, a) for a in sorted(addresses)), version, "etcd://test/kv")

    def current(self):
        return self.view

    def close(self) -> None:
        pass


def test_owner_pool_opens_on_join_closes_on_leave_after_the_batches_holding_it():
    from kvtier.client.owner_pool import OwnerPool

    opened: list[str] = []
    members = _Members("h1:1", "h2:1")
    pool = OwnerPool(members, lambda a: _FakeDaemon(a, opened))
    assert opened == []  # lazily: at the first batch
    with pool.batch() as batch:
        assert [d.address for d in batch.daemons] == ["h1:1", "h2:1"] and opened == ["h1:1", "h2:1"]
        h1 = batch.daemons[0]
        members.set("h2:1", "h3:1", version=2)
        with pool.batch() as later:
            assert [d.address for d in later.daemons] == ["h2:1", "h3:1"] and opened == ["h1:1", "h2:1", "h3:1"]
        assert not h1.closed  # the first batch still holds it
    assert h1.closed
    with pool.batch() as batch:
        assert opened == ["h1:1", "h2:1", "h3:1"]  # nothing reopened for an unchanged view
    pool.close()
    assert all(d.closed for d in batch.daemons)


def test_owner_pool_retries_a_member_it_could_not_open():
    from kvtier.client.owner_pool import OwnerPool
    from kvtier.wire import events as p

    refuse = {"h2:1"}
    opened: list[str] = []

    def open_daemon(address: str):
        if address in refuse:
            raise p.ConnectionLost(f"cannot connect to {address}")
        return _FakeDaemon(address, opened)
    pool = OwnerPool(_Members("h1:1", "h2:1"), open_daemon)
    with pool.batch() as batch:
        assert batch.daemons[1] is None and batch.daemons[0].address == "h1:1"
    refuse.clear()
    with pool.batch() as batch:
        assert [d.address for d in batch.daemons] == ["h1:1", "h2:1"]
    pool.close()
