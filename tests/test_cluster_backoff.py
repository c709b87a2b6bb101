"""Per-node backoff: the bookkeeping on a fake clock, the owner order it gives, the probe
thread, and a real cluster (etcd, 3 kvtierd) where a kill -9'd node stops getting requests
at its first failure, long before its lease ends."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cluster_fixtures import LEASE_TTL_S, etcd, start_member, wait_members  # noqa: F401
from kvtier.client.cluster_members import Member, MemberView
from kvtier.client.kvcache import KVCache
from kvtier.client.node_backoff import BACKOFF_S_MAX, BACKOFF_S_MIN, NodeBackoff, owners_backed_off_last
from kvtier.client.owner_pool import OwnerPool
from kvtier.common.keys import KVLayout, Namespace
from kvtier.wire import events as p

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)
NODES = ("node-a", "node-b", "node-c")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_to_its_bound_and_a_success_ends_it():
    clock = FakeClock()
    b = NodeBackoff(clock)
    assert b.failed("n1") == BACKOFF_S_MIN
    assert b.backed_off(["n0", "n1"]).tolist() == [False, True]
    assert b.due_probes() == []  # not yet due
    waits = []
    for _ in range(8):
        clock.now = b.next_due_s()
        assert b.due_probes() == ["n1"]
        assert b.next_due_s() is None and b.due_probes() == []  # probing: not handed out twice
        before = waits[-1] if waits else BACKOFF_S_MIN
        assert b.failed("n1") == before  # a request failing while the probe is out: the probe decides
        waits.append(b.probe_failed("n1"))
    assert waits == [min(BACKOFF_S_MAX, BACKOFF_S_MIN * 2 ** k) for k in range(1, 9)]
    assert waits[-1] == BACKOFF_S_MAX
    assert b.backed_off(["n1"]).tolist() == [True]  # still skipped until an answer
    b.succeeded("n1")
    assert b.backed_off(["n1"]) is None  # none skipped: no array to build on every batch
    assert b.failed("n1") == BACKOFF_S_MIN  # a new run of failures starts small again
    st = b.statistics()
    assert (st.backed_off, st.probes, st.probes_failed, st.recoveries) == (("n1",), 8, 8, 1)


def test_forget_drops_nodes_that_left_the_view():
    b = NodeBackoff(FakeClock())
    b.failed("gone")
    b.failed("kept")
    b.forget(["kept", "other"])
    assert b.statistics().backed_off == ("kept",) and b.statistics().forgotten == 1
    assert b.probe_failed("gone") == 0.0  # a probe that ends after the node left changes nothing


def test_sending_is_counted_per_node_with_the_time():
    clock = FakeClock()
    b = NodeBackoff(clock)
    b.sending("n1")
    clock.now = 105.0
    b.sending("n1")
    assert b.statistics().sent == {"n1": 2} and b.statistics().last_sent_s == {"n1": 105.0}


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="backoff bounds"):
        NodeBackoff(FakeClock(), backoff_s_min=2.0, backoff_s_max=1.0)


def test_backed_off_owners_go_last_in_a_stable_order():
    place = np.array([[0, 1, 2], [1, 2, 0], [2, 0, 1], [1, 0, 2]])
    down = np.array([False, True, False])
    assert owners_backed_off_last(place, down).tolist() == [[0, 2, 1], [2, 0, 1], [2, 0, 1], [0, 2, 1]]
    assert owners_backed_off_last(place, np.zeros(3, dtype=bool)) is place
    both = np.array([True, True, False])
    assert owners_backed_off_last(place, both).tolist() == [[2, 0, 1], [2, 1, 0], [2, 0, 1], [2, 1, 0]]


class _Client:
    def __init__(self, owner: "_Daemon") -> None:
        self.owner = owner

    def ping(self) -> float:
        self.owner.pings += 1
        if self.owner.down:
            raise p.ConnectionLost(f"{self.owner.address} is down")
        return 0.0

    def close(self) -> None:
        pass


class _Daemon:
    def __init__(self, address: str) -> None:
        self.address, self.reader, self.down, self.pings = address, None, False, 0
        self.client = _Client(self)


class _Members:
    def __init__(self, *ids: str) -> None:
        self.view = MemberView(tuple(Member(i, f"{i}:1") for i in sorted(ids)), 1, "etcd://test/kv")

    def current(self):
        return self.view

    def close(self) -> None:
        pass


def test_owner_pool_probes_a_failed_node_until_it_answers():
    daemons: dict[str, _Daemon] = {}

    def open_daemon(address: str) -> _Daemon:
        return daemons.setdefault(address, _Daemon(address))
    backoff = NodeBackoff(time.monotonic, backoff_s_min=0.02, backoff_s_max=0.05)
    pool = OwnerPool(_Members("a", "b", "c"), open_daemon, backoff)
    try:
        with pool.batch() as batch:
            daemons["b:1"].down = True
            with pytest.raises(p.ConnectionLost):
                batch.call(1, lambda d: d.client.ping())
        with pool.batch() as batch:
            assert batch.skipped(1) and not batch.skipped(0)
            place = batch.placement([bytes([i]) * 16 for i in range(64)], 3)
            assert (place[:, 2] == 1).all()  # last for every key
        deadline = time.monotonic() + 5.0
        while daemons["b:1"].pings < 3 and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert daemons["b:1"].pings >= 3 and backoff.statistics().probes_failed >= 2
        daemons["b:1"].down = False
        deadline = time.monotonic() + 5.0
        while backoff.statistics().backed_off and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert backoff.statistics().backed_off == () and backoff.statistics().recoveries == 1
        with pool.batch() as batch:
            assert batch.backed_off is None
    finally:
        pool.close()


def make_kv(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (1, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return [(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
            for _ in range(LAYOUT.num_layers)]


def test_a_killed_node_gets_no_requests_after_its_first_failure(etcd, tmp_path):  # noqa: F811
    daemons = {name: start_member(tmp_path, etcd, name) for name in NODES}
    try:
        tokens = list(range(11000, 11000 + 32 * 8))
        kv = make_kv(len(tokens), seed=4)
        with KVCache(Namespace(model="backoff", layout=LAYOUT, codec="raw"), etcd.url(), hot_pool_bytes=0,
                     timeout_s=5.0) as cache:
            members = cache._warm.pool.members
            wait_members(members, lambda v: v.node_ids == NODES)
            assert cache.store(tokens, kv) == 32
            keys = cache.keys_for(tokens)
            with cache._warm.pool.batch() as batch:
                victim = batch.view.node_ids[int(batch.placement(keys, 2)[0, 0])]
            backoff = cache._warm.pool.backoff
            daemons[victim].kill()
            killed_at = time.monotonic()
            wrong = loads = 0
            while victim in members.current().node_ids:
                loaded = cache.load(tokens)
                loads += 1
                wrong += not (loaded.num_tokens == len(tokens) and all(
                    torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(loaded.layers, kv)))
                assert cache.store_blocks(keys[:4], cache.load_blocks(keys[:4])) == 4  # buffered: skips the victim
                assert time.monotonic() - killed_at < LEASE_TTL_S + 5, "the victim never left the view"
            left_s = time.monotonic() - killed_at
            st = backoff.statistics()
            last_sent_s = st.last_sent_s[victim] - killed_at
            assert wrong == 0 and loads >= 3
            assert st.sent[victim] >= 1 and st.failures >= 1 and st.probes >= 1  # probed while in the view
            assert last_sent_s < 1.0, f"requests went to {victim} {last_sent_s:.2f} s after kill -9"
            assert left_s <= LEASE_TTL_S + 1, f"{victim} left the view {left_s:.2f} s after kill -9"
            view, _ = wait_members(members, lambda v: victim not in v.node_ids)
            cache.load(tokens)  # a batch on the new view: the victim is forgotten, no more probes
            assert victim not in backoff.statistics().backed_off
            assert cache.statistics().warm.failovers >= 1
            figures = cache.cluster_statistics()
            assert figures.members.leaves == 1 and figures.members.members == 2
            assert figures.backoff.failures >= 1 and figures.backoff.forgotten == 1
            assert figures.connections_open == 2 and figures.as_dict()["backoff"]["sent"][victim] >= 1
    finally:
        for d in daemons.values():
            if d.alive():
                assert d.stop() == 0, d.log_tail()
