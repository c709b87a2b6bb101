"""Pull-through across a shaped WAN: the region in its own network namespace behind a veth
pair with tbf at 1 Gbit/s on both ends, 20 ms added by a delay proxy (``wan_link``); the edge
on the host. Needs root and ``ip netns``; skipped otherwise."""
from __future__ import annotations

import time

import pytest

from daemon_proc import start_kvtierd
from test_cluster_partition import _ip, netns  # noqa: F401  (the fixture)
from test_upstream import SLACK_S, make_blocks, same_payload
from wan_link import REGION_TOKEN, WAN_DELAY_S, start_wan_region
from kvtier.client import BlockClient
from kvtier.daemon.upstream.pull_through import DOWN_BACKOFF_S

TIMEOUT_MS = 1000


@pytest.fixture
def wan(netns, tmp_path):  # noqa: F811
    link = start_wan_region(netns, tmp_path / "region", tmp_path / "region-token")
    yield netns, link
    link.close()


def start_edge(tmp_path, upstream: str):
    return start_kvtierd(tmp_path / "edge", "--upstream", upstream, "--upstream-token-file",
                         str(tmp_path / "region-token"), "--upstream-timeout-ms", str(TIMEOUT_MS),
                         "--device-size", "256m", "--region-size", "8m")


@pytest.mark.root
def test_cold_over_the_wan_then_warm_at_the_edge(wan, tmp_path):
    _, link = wan
    ns, keys, blocks = make_blocks(32, 256 * 1024)  # 8 MiB: about 70 ms on the wire at 1 Gbit/s
    edge = start_edge(tmp_path, link.proxy.address)
    try:
        with BlockClient(link.address, token=REGION_TOKEN) as r, BlockClient(edge.data_addr) as e:
            r.put_many(list(zip(keys, blocks)), ns_id=ns)
            e.ping()
            started = time.perf_counter()
            origins: list = []
            got = e.get_many(keys, ns_id=ns, origins=origins)
            cold_s = time.perf_counter() - started
            assert all(same_payload(g, b) for g, b in zip(got, blocks)) and all(origins)
            started = time.perf_counter()
            again: list = []
            got = e.get_many(keys, ns_id=ns, origins=again)
            warm_s = time.perf_counter() - started
            assert all(same_payload(g, b) for g, b in zip(got, blocks)) and not any(again)
            assert cold_s >= WAN_DELAY_S  # it crossed the WAN
            assert warm_s < cold_s
    finally:
        edge.stop()


@pytest.mark.root
def test_wan_link_down_is_a_miss_within_the_timeout(wan, tmp_path):
    (_, host_if, _, _), link = wan
    ns, keys, blocks = make_blocks(4, 64 * 1024)
    edge = start_edge(tmp_path, link.proxy.address)
    try:
        with BlockClient(link.address, token=REGION_TOKEN) as r, BlockClient(edge.data_addr) as e:
            r.put_many(list(zip(keys, blocks)), ns_id=ns)
            assert e.lookup(keys[:1], ns_id=ns) == 1  # connected across the WAN
            _ip("link", "set", host_if, "down")
            try:
                started = time.monotonic()
                assert e.get_many(keys[2:], ns_id=ns) == [None, None]
                assert TIMEOUT_MS / 1000 <= time.monotonic() - started < TIMEOUT_MS / 1000 + SLACK_S
            finally:
                _ip("link", "set", host_if, "up")
            time.sleep(DOWN_BACKOFF_S + 0.1)  # past the edge's backoff after the timeout
            got = e.get_many(keys[2:], ns_id=ns)
            assert all(same_payload(g, b) for g, b in zip(got, blocks[2:]))  # the link is back: fetched
    finally:
        edge.stop()
