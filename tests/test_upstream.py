"""Pull-through from the upstream with real daemons: an edge kvtierd (``--upstream``) in front
of a region kvtierd, on loopback; faults come from a frame-aware TCP proxy between them
(``upstream_proxy.FrameProxy``). The WAN-shaped variant (network namespaces, tbf) is
``test_upstream_wan.py``."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from daemon_proc import start_kvtierd
from upstream_proxy import FrameProxy
from kvtier.client import BlockClient
from kvtier.wire.events import ClientError
from kvtier.common.blockformat import encode_block

TIMEOUT_MS = 400
SLACK_S = 1.0  # a miss comes back within the timeout plus this (process, proxy and scheduling on a loaded CI box)


def make_blocks(count: int, payload_bytes: int = 32 * 1024, ns: bytes | None = None):
    ns = ns or os.urandom(16)
    keys = [os.urandom(16) for _ in range(count)]
    return ns, keys, [encode_block(k, ns, 0, os.urandom(payload_bytes)) for k in keys]


def same_payload(got, sent) -> bool:
    return got is not None and bytes(got[64:]) == sent[64:] and bytes(got[12:48]) == sent[12:48]


def admin_json(daemon, path: str) -> dict:
    with urllib.request.urlopen(f"http://{daemon.admin_addr}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def metrics_text(daemon) -> str:
    with urllib.request.urlopen(f"http://{daemon.admin_addr}/metrics", timeout=10) as resp:
        return resp.read().decode()


@pytest.fixture
def region(tmp_path):
    d = start_kvtierd(tmp_path / "region")
    yield d
    d.kill()


def start_edge(tmp_path, upstream: str, *extra: str):
    return start_kvtierd(tmp_path / "edge", "--upstream", upstream, "--upstream-timeout-ms", str(TIMEOUT_MS),
                         *extra, admin="127.0.0.1:0")


def test_cold_get_then_warm_with_origins(region, tmp_path):
    ns, keys, blocks = make_blocks(16)
    edge = start_edge(tmp_path, region.data_addr)
    try:
        with BlockClient(region.data_addr) as r, BlockClient(edge.data_addr) as e:
            r.put_many(list(zip(keys, blocks)), ns_id=ns)
            assert e.has_upstream or e.server_info()["features"].count("upstream") == 1
            lookup_origins: list = []
            assert e.lookup(keys, ns_id=ns, origins=lookup_origins) == 16  # leading blocks anywhere
            assert lookup_origins == [True] * 16
            origins: list = []
            got = e.get_many(keys, ns_id=ns, origins=origins)
            assert all(same_payload(g, b) for g, b in zip(got, blocks))
            assert origins == [True] * 16
            again: list = []
            got = e.get_many(keys, ns_id=ns, origins=again)  # from the store queue or the engine: local
            assert all(same_payload(g, b) for g, b in zip(got, blocks))
            assert again == [False] * 16
            stats = admin_json(edge, "/v1/stats")["upstream"]
            assert stats["blocks_fetched"] == 16 and stats["bytes_fetched"] == sum(len(b) for b in blocks)
            assert stats["prefix_blocks_upstream"] == 16 and stats["prefix_hit_ratio"]["upstream"] == 1.0
            deadline = time.monotonic() + 10
            while admin_json(edge, "/v1/stats")["upstream"]["store"]["stored_blocks"] < 16:
                assert time.monotonic() < deadline, "the fetched blocks never reached the edge's engine"
                time.sleep(0.05)
            lookup_origins = []
            assert e.lookup(keys, ns_id=ns, origins=lookup_origins) == 16
            assert lookup_origins == [False] * 16  # stored at the edge now
            text = metrics_text(edge)
            assert 'kvtier_upstream_prefix_blocks_total{tier="upstream"} 16.0' in text
            assert "kvtier_upstream_fetch_duration_seconds_bucket" in text
            assert 'kvtier_upstream_failures_total{kind="corrupt"} 0.0' in text
    finally:
        edge.stop()


def test_second_request_served_warm(region, tmp_path):
    """A short benchmark: 200 prefixes of 4 blocks, each asked twice in a row at the edge."""
    ns = os.urandom(16)
    edge = start_edge(tmp_path, region.data_addr)
    try:
        with BlockClient(region.data_addr) as r, BlockClient(edge.data_addr) as e:
            chains = []
            for _ in range(200):
                _, keys, blocks = make_blocks(4, 16 * 1024, ns)
                r.put_many(list(zip(keys, blocks)), ns_id=ns)
                chains.append(keys)
            cold_first = warm_second = 0
            for keys in chains:
                first: list = []
                assert all(b is not None for b in e.get_many(keys, ns_id=ns, origins=first))
                cold_first += all(first)
                second: list = []
                assert all(b is not None for b in e.get_many(keys, ns_id=ns, origins=second))
                warm_second += not any(second)
            assert cold_first == 200
            assert warm_second / 200 >= 0.99, warm_second
    finally:
        edge.stop()


def test_kvcache_counts_cold_and_warm(region, tmp_path):
    torch = pytest.importorskip("torch")
    from kvtier.client.kvcache import KVCache
    from kvtier.common.keys import KVLayout, Namespace

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=16)
    namespace = Namespace(model="upstream-test", layout=layout)
    tokens = list(range(16 * 6))
    kv = [(torch.randn(1, 2, len(tokens), 8), torch.randn(1, 2, len(tokens), 8)) for _ in range(2)]
    edge = start_edge(tmp_path, region.data_addr)
    try:
        with KVCache(namespace, region.data_addr) as at_region:
            assert at_region.store(tokens, kv) == 6
            assert at_region.statistics().cold.hits == 0  # a daemon without an upstream
        with KVCache(namespace, edge.data_addr, hot_pool_bytes=0) as at_edge:
            loaded = at_edge.load(tokens)
            assert loaded.num_tokens == len(tokens)
            assert torch.equal(loaded.layers[1][0], kv[1][0])
            stats = at_edge.statistics()
            assert stats.cold.hits == 6 and stats.cold.misses == 0
            assert stats.cold.bytes_read > 6 * layout.block_raw_bytes * 0.9 and stats.cold.operations == 1
            assert stats.cold.latency_us_max > 0
            assert stats.warm.hits == 0 and stats.warm.misses == 6
            again = at_edge.load(tokens)
            assert again.num_tokens == len(tokens)
            stats = at_edge.statistics()
            assert stats.cold.hits == 6 and stats.warm.hits == 6  # the second load: the edge held them
            assert stats.as_dict()["cold"]["transports"] == {"upstream": 6}
    finally:
        edge.stop()


def test_kvcache_with_direct_reads_fetches_what_only_the_upstream_holds(region, tmp_path):
    torch = pytest.importorskip("torch")
    from daemon_proc import device_map_of
    from kvtier.client.kvcache import KVCache
    from kvtier.common.keys import KVLayout, Namespace

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=16)
    namespace = Namespace(model="upstream-direct", layout=layout)
    tokens = list(range(16 * 4))
    kv = [(torch.randn(1, 2, len(tokens), 8), torch.randn(1, 2, len(tokens), 8)) for _ in range(2)]
    edge = start_edge(tmp_path, region.data_addr)
    try:
        with KVCache(namespace, region.data_addr) as at_region:
            assert at_region.store(tokens, kv) == 4
        with KVCache(namespace, edge.data_addr, hot_pool_bytes=0, device_map=device_map_of(edge)) as at_edge:
            assert at_edge.direct_enabled
            cold = at_edge.load(tokens)  # no locations at the edge: TCP, and the edge fetches
            assert cold.num_tokens == len(tokens) and cold.transports == {"upstream": 4}
            assert torch.equal(cold.layers[0][1], kv[0][1])
            assert admin_json(edge, "/v1/stats")["upstream"]["blocks_fetched"] == 4
            stats = at_edge.statistics()
            assert (stats.cold.hits, stats.warm.hits) == (4, 0)
    finally:
        edge.stop()


def test_absent_everywhere_is_a_miss_and_negative_cached(region, tmp_path):
    ns, keys, _ = make_blocks(3)
    edge = start_edge(tmp_path, region.data_addr)
    try:
        with BlockClient(region.data_addr) as r, BlockClient(edge.data_addr) as e:
            before = r.stats()["server"]["requests"].get("get", 0)
            for _ in range(5):
                origins: list = []
                assert e.get_many(keys, ns_id=ns, origins=origins) == [None] * 3
                assert origins == [False] * 3
            assert r.stats()["server"]["requests"].get("get", 0) - before == 1  # the rest: negative cache
            stats = admin_json(edge, "/v1/stats")["upstream"]
            assert stats["blocks_missed"] == 3 and stats["negative_hits"] == 12 and stats["negative_entries"] == 3
            assert stats["requests"] == 1
            time.sleep(2.2)  # NEGATIVE_TTL_S: asked again after it
            assert e.get_many(keys, ns_id=ns) == [None] * 3
            assert admin_json(edge, "/v1/stats")["upstream"]["requests"] == 2  # (answered or, on a loaded
            # machine, timed out: either way the edge asked again)
    finally:
        edge.stop()


def test_an_upstream_that_failed_to_answer_is_asked_again_once_it_is_back(region, tmp_path):
    """A LOOKUP the upstream could not answer is a miss, not a negative entry: once the upstream
    is back (past DOWN_BACKOFF_S, inside NEGATIVE_TTL_S) the chain is found there."""
    from kvtier.daemon.upstream.negative_cache import NEGATIVE_TTL_S
    from kvtier.daemon.upstream.pull_through import DOWN_BACKOFF_S

    ns, keys, blocks = make_blocks(4)
    proxy = FrameProxy(region.data_addr)
    edge = start_edge(tmp_path, proxy.address)
    try:
        with BlockClient(region.data_addr) as r, BlockClient(edge.data_addr) as e:
            r.put_many(list(zip(keys, blocks)), ns_id=ns)
            proxy.delay_s = 2 * TIMEOUT_MS / 1000  # the upstream answers later than the timeout
            assert e.lookup(keys, ns_id=ns) == 0
            failed_at = time.monotonic()
            proxy.delay_s = 0
            time.sleep(DOWN_BACKOFF_S + 0.1)
            assert time.monotonic() - failed_at < NEGATIVE_TTL_S
            assert e.lookup(keys, ns_id=ns) == 4
            assert admin_json(edge, "/v1/stats")["upstream"]["negative_hits"] == 0
    finally:
        edge.stop()
        proxy.close()


def test_corrupt_block_from_upstream_is_neither_served_nor_stored(region, tmp_path):
    ns, keys, blocks = make_blocks(1)
    proxy = FrameProxy(region.data_addr)
    proxy.flip_get_payload = True
    edge = start_edge(tmp_path, proxy.address)
    try:
        with BlockClient(region.data_addr) as r, BlockClient(edge.data_addr) as e:
            r.put_many(list(zip(keys, blocks)), ns_id=ns)
            assert e.get_many(keys, ns_id=ns) == [None]
            assert proxy.get_replies == 2  # asked once more without READER_VERIFIES: corrupt again
            assert e.statistics().corrupt_blocks == 0  # the edge never sent it on
            stats = admin_json(edge, "/v1/stats")["upstream"]
            assert stats["failures"]["corrupt"] == 1 and stats["blocks_fetched"] == 0
            assert stats["store"]["queued_blocks"] == 0
            proxy.flip_get_payload = False
            assert same_payload(e.get_many(keys, ns_id=ns)[0], blocks[0])  # not negative-cached: fetched now
            assert "event=upstream_block_corrupt" in edge.log_tail(20000)
    finally:
        edge.stop()
        proxy.close()


def test_wrong_upstream_token_is_logged_counted_and_a_miss(tmp_path):
    (tmp_path / "region-token").write_text("the-region-secret\n")
    (tmp_path / "wrong-token").write_text("not-the-secret\n")
    region = start_kvtierd(tmp_path / "region", "--token-file", str(tmp_path / "region-token"))
    ns, keys, blocks = make_blocks(2)
    edge = start_edge(tmp_path, region.data_addr, "--upstream-token-file", str(tmp_path / "wrong-token"))
    try:
        with BlockClient(region.data_addr, token="the-region-secret") as r, BlockClient(edge.data_addr) as e:
            r.put_many(list(zip(keys, blocks)), ns_id=ns)
            started = time.monotonic()
            assert e.get_many(keys, ns_id=ns) == [None, None]
            assert e.lookup(keys, ns_id=ns) == 0
            assert time.monotonic() - started < TIMEOUT_MS / 1000 + SLACK_S
            stats = admin_json(edge, "/v1/stats")["upstream"]
            assert stats["failures"]["auth"] >= 1
            assert 'kvtier_upstream_failures_total{kind="auth"}' in metrics_text(edge)
        assert "event=upstream_auth_failed" in edge.log_tail(20000)
    finally:
        edge.stop()
        region.kill()


@pytest.mark.parametrize("fault", ["slow", "stall", "cut"])
def test_upstream_slow_or_failing_mid_transfer_is_a_prompt_miss(region, tmp_path, fault):
    ns, keys, blocks = make_blocks(8, 256 * 1024)
    proxy = FrameProxy(region.data_addr)
    if fault == "slow":
        proxy.delay_s = 2 * TIMEOUT_MS / 1000  # every reply (HELLO's too) later than the timeout
    elif fault == "stall":
        proxy.stall_get = True  # slower than the timeout: the reply header, then nothing
    else:
        proxy.cut_get_after = 100_000  # the connection drops mid-payload
    edge = start_edge(tmp_path, proxy.address)
    try:
        with BlockClient(region.data_addr) as r, BlockClient(edge.data_addr) as e:
            r.put_many(list(zip(keys, blocks)), ns_id=ns)
            started = time.monotonic()
            assert e.get_many(keys, ns_id=ns) == [None] * 8
            assert time.monotonic() - started < TIMEOUT_MS / 1000 + SLACK_S
            kind = "unavailable" if fault == "cut" else "timeout"
            assert admin_json(edge, "/v1/stats")["upstream"]["failures"][kind] == 1
            assert e.ping() < 1.0  # the edge serves on
    finally:
        edge.stop()
        proxy.close()


def test_upstream_killed_is_a_prompt_miss_and_backed_off(region, tmp_path):
    ns, keys, blocks = make_blocks(4)
    edge = start_edge(tmp_path, region.data_addr)
    try:
        with BlockClient(region.data_addr) as r, BlockClient(edge.data_addr) as e:
            r.put_many(list(zip(keys, blocks)), ns_id=ns, durable=True)
            assert e.lookup(keys[:1], ns_id=ns) == 1  # a pooled upstream connection is open now
            region.kill()
            for _ in range(3):
                started = time.monotonic()
                assert e.get_many(keys, ns_id=ns) == [None] * 4
                assert e.lookup(keys, ns_id=ns) == 0
                assert time.monotonic() - started < TIMEOUT_MS / 1000 + SLACK_S
            stats = admin_json(edge, "/v1/stats")["upstream"]
            assert stats["failures"]["unavailable"] >= 1
            assert stats["skipped_down"] >= 1  # asked again only after the backoff, not per request
    finally:
        edge.stop()


def test_edge_restarted_while_warming(region, tmp_path):
    """SIGKILL the edge while a client streams cold GETs through it (each batch fetched from the
    region and being stored behind): after a restart what it acknowledged is intact, and every
    block it serves is whole and verified."""
    ns, keys, blocks = make_blocks(600, 64 * 1024)
    _, own_keys, own_blocks = make_blocks(8, 16 * 1024, ns)
    edge = start_edge(tmp_path, region.data_addr)
    with BlockClient(region.data_addr) as r:
        r.put_many(list(zip(keys, blocks)), ns_id=ns)
    batches_done = threading.Event()
    answered: list[int] = []
    wrong: list[int] = []  # batches served with a block that was not the region's

    def stream_gets() -> None:
        with BlockClient(edge.data_addr, timeout_s=5.0) as c:
            for start in range(0, len(keys), 20):
                try:
                    got = c.get_many(keys[start:start + 20], ns_id=ns)
                except ClientError:
                    return  # the edge was killed
                if not all(same_payload(g, b) for g, b in zip(got, blocks[start:start + 20])):
                    wrong.append(start)
                answered.append(start)
                if len(answered) == 5:
                    batches_done.set()
        batches_done.set()

    with BlockClient(edge.data_addr) as e:
        e.put_many(list(zip(own_keys, own_blocks)), durable=True, ns_id=ns)
    streamer = threading.Thread(target=stream_gets)
    streamer.start()
    assert batches_done.wait(30)
    edge.signal(signal.SIGKILL)
    streamer.join(30)
    edge.kill()
    assert 5 <= len(answered) < len(keys) // 20, "the edge was not killed mid-stream"
    assert not wrong
    region.kill()  # what the edge serves now is what it stored itself
    edge.start()
    try:
        with BlockClient(edge.data_addr) as e:
            assert all(same_payload(g, b) for g, b in zip(e.get_many(own_keys, ns_id=ns), own_blocks))
            got = e.get_many(keys, ns_id=ns)
            served = [g for g in got if g is not None]
            assert all(same_payload(g, b) for g, b in zip(got, blocks) if g is not None)
            assert e.statistics().corrupt_blocks == 0
            # every block the restarted edge indexes is one it serves whole: nothing half-stored survived
            assert e.stats()["engine"]["blocks"] == len(served) + len(own_keys)
    finally:
        edge.stop()


@pytest.mark.slow
def test_etcd_upstream_asks_each_key_of_its_rendezvous_owner(tmp_path):
    from cluster_fixtures import members_of, start_member
    from etcd_server import EtcdServer, etcd_missing_reason
    from kvtier.common.rendezvous import Rendezvous

    reason = etcd_missing_reason()
    if reason:
        pytest.skip(reason)
    etcd = EtcdServer(tmp_path / "etcd")
    nodes = {}
    edge = None
    try:
        nodes = {name: start_member(tmp_path, etcd, name, prefix="region") for name in ("r1", "r2", "r3")}
        assert set(members_of(etcd.url("region"))) == {"r1", "r2", "r3"}
        ns, keys, blocks = make_blocks(48, 8 * 1024)  # each member owns some (all but surely)
        owners = Rendezvous(["r1", "r2", "r3"]).owners(keys)
        for j, name in enumerate(["r1", "r2", "r3"]):
            mine = [(k, b) for k, b, o in zip(keys, blocks, owners) if o == j]
            with BlockClient(nodes[name].data_addr) as c:
                c.put_many(mine, ns_id=ns)
        edge = start_edge(tmp_path, etcd.url("region"))
        with BlockClient(edge.data_addr) as e:
            assert e.lookup(keys[:1], ns_id=ns) == 1
            origins: list = []
            got = e.get_many(keys, ns_id=ns, origins=origins)
            assert all(same_payload(g, b) for g, b in zip(got, blocks)) and all(origins)
        for name, node in nodes.items():  # each member was asked only for the keys it owns
            with BlockClient(node.data_addr) as c:
                assert c.stats()["server"]["requests"].get("get", 0) == 1, name
        assert admin_json(edge, "/v1/stats")["upstream"]["target"] == etcd.url("region")
    finally:
        if edge is not None:
            edge.stop()
        for node in nodes.values():
            node.kill()
        etcd.stop()


def test_two_daemons_naming_each_other_do_not_forward_in_a_loop(tmp_path):
    from ports import free_port

    port_a, port_b = free_port(), free_port()
    a = start_kvtierd(tmp_path / "a", "--listen", f"127.0.0.1:{port_a}", "--upstream", f"127.0.0.1:{port_b}",
                      "--upstream-timeout-ms", str(TIMEOUT_MS))
    b = start_kvtierd(tmp_path / "b", "--listen", f"127.0.0.1:{port_b}", "--upstream", f"127.0.0.1:{port_a}",
                      "--upstream-timeout-ms", str(TIMEOUT_MS))
    ns, keys, blocks = make_blocks(2)
    try:
        with BlockClient(a.data_addr) as at_a, BlockClient(b.data_addr) as at_b:
            at_b.put_many([(keys[0], blocks[0])], ns_id=ns)
            got = at_a.get_many(keys, ns_id=ns)  # key 0 from b (one hop); key 1 nowhere: a miss
            assert same_payload(got[0], blocks[0]) and got[1] is None
            assert at_a.stats()["server"]["requests"].get("get", 0) == 1  # b never asked a back
            assert at_b.stats()["server"]["requests"].get("get", 0) == 1
    finally:
        a.stop()
        b.stop()
