"""An edge's pull-through from an etcd region that keeps replicas: each key is asked of its
rendezvous owners in order (the first ``REPLICAS`` by score, where the region's clients put
it), the next one where an owner is down, hung, lacks the block or sends a corrupt copy.

A real etcd, two real region daemons (``r1``, ``r2``, registered by ``kvtierd --cluster``) and
one member record (``r0``) whose address each test points at a closed port, a socket that
never answers, or a corrupting proxy in front of ``r1``: a member that died or hung while
its record lives on, the window a lease leaves open."""
from __future__ import annotations

import os
import socket
import urllib.request
import time
from dataclasses import dataclass

import pytest

from cluster_fixtures import start_member
from daemon_proc import start_kvtierd
from etcd_server import EtcdServer, etcd_missing_reason
from test_upstream import SLACK_S, admin_json, same_payload
from test_upstream_etcd_members import put, record
from upstream_proxy import FrameProxy
from kvtier.client import BlockClient
from kvtier.common.blockformat import encode_block
from kvtier.common.rendezvous import Rendezvous

PREFIX = "region"
NODES = ("r0", "r1", "r2")  # r0: a record whose daemon is not there (or not itself); r1, r2: daemons
LIVE = ("r1", "r2")
REPLICAS = 2  # copies of each block the region's clients place on etcd (KVCache's default)
TIMEOUT_MS = 1000  # the edge's --upstream-timeout-ms: time for a hung owner's share and its replica's
PAYLOAD_BYTES = 8 * 1024
KEYS_TRIED_MAX = 10_000  # random keys drawn to find enough with a wanted placement (1 in 3 or better)

pytestmark = pytest.mark.slow  # a real etcd behind the replicated region


@dataclass
class Region:
    etcd: EtcdServer
    members: dict  # node id -> KvtierdProcess

    def point_r0_at(self, address: str) -> None:
        """The record of member r0 (no lease: it stays until replaced) names ``address``."""
        put(self.etcd, f"/{PREFIX}/members/r0".encode(), record("r0", address))

    def store(self, keys, blocks, ns: bytes, on) -> None:
        """Each block put on the live members ``on(its owners)`` names."""
        for name in LIVE:
            mine = [(k, b) for k, b, o in zip(keys, blocks, owners_of(keys)) if name in on(o)]
            if mine:
                with BlockClient(self.members[name].data_addr) as c:
                    c.put_many(mine, ns_id=ns)

    def gets_served(self) -> dict[str, int]:
        out = {}
        for name in LIVE:
            with BlockClient(self.members[name].data_addr) as c:
                out[name] = c.stats()["server"]["requests"].get("get", 0)
        return out


@pytest.fixture(scope="module")
def region(tmp_path_factory):
    reason = etcd_missing_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("replicated-region")
    etcd = EtcdServer(base / "etcd")
    members = {}
    try:
        for name in LIVE:
            members[name] = start_member(base, etcd, name, prefix=PREFIX)
        yield Region(etcd, members)
    finally:
        for member in members.values():
            member.kill()
        etcd.stop()


def owners_of(keys) -> list[tuple[str, ...]]:
    """Each key's first REPLICAS owners among NODES, the first owner first."""
    return [tuple(NODES[j] for j in row) for row in Rendezvous(NODES).ranked(keys, REPLICAS)]


def chain(count: int, placed, ns: bytes):
    """``count`` keys (and their blocks) whose owners satisfy ``placed(owners)``."""
    keys = []
    for _ in range(KEYS_TRIED_MAX):
        key = os.urandom(16)
        if placed(owners_of([key])[0]):
            keys.append(key)
            if len(keys) == count:
                return keys, [encode_block(k, ns, 0, os.urandom(PAYLOAD_BYTES)) for k in keys]
    raise AssertionError(f"no {count} keys placed as wanted in {KEYS_TRIED_MAX}")


def closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        return f"127.0.0.1:{placeholder.getsockname()[1]}"  # closed when the block ends: refused after


def start_edge(tmp_path, region: Region):
    return start_kvtierd(tmp_path / "edge", "--upstream", region.etcd.url(PREFIX), "--upstream-timeout-ms",
                         str(TIMEOUT_MS), admin="127.0.0.1:0")


def upstream_stats(edge) -> dict:
    return admin_json(edge, "/v1/stats")["upstream"]


def test_a_block_its_first_owner_lacks_is_found_at_the_next(region, tmp_path):
    region.point_r0_at(closed_port())
    ns = os.urandom(16)
    keys, blocks = chain(16, lambda owners: "r0" not in owners, ns)
    region.store(keys, blocks, ns, on=lambda owners: owners[1:])  # the first owner lost its copies
    edge = start_edge(tmp_path, region)
    try:
        with BlockClient(edge.data_addr) as e:
            lookup_origins: list = []
            assert e.lookup(keys, ns_id=ns, origins=lookup_origins) == 16
            assert lookup_origins == [True] * 16
            origins: list = []
            got = e.get_many(keys, ns_id=ns, origins=origins)
            assert all(same_payload(g, b) for g, b in zip(got, blocks)) and origins == [True] * 16
        stats = upstream_stats(edge)
        assert (stats["fallbacks"], stats["fallback_hits"]) == (32, 32)  # each key, in the LOOKUP and the GET
        assert (stats["blocks_fetched"], stats["blocks_missed"], stats["negative_entries"]) == (16, 0, 0)
        with urllib.request.urlopen(f"http://{edge.admin_addr}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert "kvtier_upstream_fallbacks_total 32.0" in text and "kvtier_upstream_fallback_hits_total 32.0" in text
    finally:
        edge.stop()


@pytest.mark.parametrize("down", ["refused", "hung"])
def test_a_block_whose_first_owner_is_down_comes_from_the_next_in_time(region, tmp_path, down):
    with socket.create_server(("127.0.0.1", 0)) as mute:  # the kernel accepts; nobody ever answers HELLO
        region.point_r0_at(closed_port() if down == "refused" else f"127.0.0.1:{mute.getsockname()[1]}")
        ns = os.urandom(16)
        keys, blocks = chain(12, lambda owners: owners[0] == "r0", ns)
        region.store(keys, blocks, ns, on=lambda owners: owners)
        edge = start_edge(tmp_path, region)
        try:
            with BlockClient(edge.data_addr) as e:
                started = time.monotonic()
                assert e.lookup(keys, ns_id=ns) == 12
                assert time.monotonic() - started < TIMEOUT_MS / 1000 + SLACK_S
                started = time.monotonic()
                origins: list = []
                got = e.get_many(keys, ns_id=ns, origins=origins)
                assert time.monotonic() - started < TIMEOUT_MS / 1000 + SLACK_S
                assert all(same_payload(g, b) for g, b in zip(got, blocks)) and origins == [True] * 12
            stats = upstream_stats(edge)
            kind = "unavailable" if down == "refused" else "timeout"
            assert stats["failures"][kind] >= 1
            assert stats["failures"][kind] + stats["skipped_down"] == 2  # r0 failed, or was skipped in backoff
            assert (stats["fallbacks"], stats["fallback_hits"]) == (24, 24)
            assert (stats["blocks_missed"], stats["negative_entries"]) == (0, 0)
        finally:
            edge.stop()


def test_only_a_miss_at_every_owner_is_negative_cached(region, tmp_path):
    region.point_r0_at(closed_port())
    ns = os.urandom(16)
    nowhere, _ = chain(4, lambda owners: "r0" not in owners, ns)
    keys, blocks = chain(4, lambda owners: owners[1] == "r0", ns)
    edge = start_edge(tmp_path, region)
    try:
        with BlockClient(edge.data_addr) as e:
            assert e.get_many(nowhere, ns_id=ns) == [None] * 4
            before = region.gets_served()
            assert e.get_many(nowhere, ns_id=ns) == [None] * 4  # every owner said so: the negative cache answers
            assert region.gets_served() == before
            stats = upstream_stats(edge)
            assert (stats["blocks_missed"], stats["negative_entries"], stats["negative_hits"]) == (4, 4, 4)
            assert e.get_many(keys, ns_id=ns) == [None] * 4  # the first owner lacks them, the next is down
            stats = upstream_stats(edge)
            assert (stats["blocks_missed"], stats["negative_entries"]) == (4, 4)  # no news: not negative-cached
            assert stats["failures"]["unavailable"] == 1
            region.store(keys, blocks, ns, on=lambda owners: owners[:1])
            got = e.get_many(keys, ns_id=ns)  # inside NEGATIVE_TTL_S: asked again, and found
            assert all(same_payload(g, b) for g, b in zip(got, blocks))
    finally:
        edge.stop()


def test_a_corrupt_copy_at_the_first_owner_is_replaced_by_a_verified_one_from_the_next(region, tmp_path):
    proxy = FrameProxy(region.members["r1"].data_addr)  # r0's record names r1 behind a proxy that corrupts
    proxy.flip_get_payload = True  # the last byte of each GET reply: the last block of the chain
    region.point_r0_at(proxy.address)
    ns = os.urandom(16)
    keys, blocks = chain(3, lambda owners: owners[0] == "r0", ns)
    region.store(keys, blocks, ns, on=lambda owners: ("r1",) + owners[1:])
    edge = start_edge(tmp_path, region)
    try:
        with BlockClient(edge.data_addr) as e:
            origins: list = []
            got = e.get_many(keys, ns_id=ns, origins=origins)
            assert all(same_payload(g, b) for g, b in zip(got, blocks)) and origins == [True] * 3
            assert e.statistics().corrupt_blocks == 0
        stats = upstream_stats(edge)
        assert stats["failures"]["corrupt"] == 1 and proxy.get_replies == 2
        assert (stats["fallbacks"], stats["fallback_hits"], stats["blocks_fetched"]) == (1, 1, 3)
        assert stats["negative_entries"] == 0
    finally:
        edge.stop()
        proxy.close()
