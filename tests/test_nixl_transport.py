"""The nixl transport end to end: a real kvtierd with its NIXL agent, this process's real client
agent, UCX on loopback; GETs written into registered buffers, verified, counted as ``nixl``."""
from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

nixl_api = pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

import torch  # noqa: E402

from daemon_proc import start_kvtierd  # noqa: E402
from nixl_daemon import LOOPBACK_ENV, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client import nixl_setup  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.client.nixl_setup import NixlSetup  # noqa: E402
from kvtier.client.nixl_transport import ControlChannel, NixlTransport, NixlUnavailable  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
from kvtier.wire import events as m  # noqa: E402

os.environ.update(LOOPBACK_ENV)  # this process's client agent, before it exists: loopback only
NS = b"\x07" * 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_nixl_daemon(tmp_path_factory.mktemp("kvtierd-nixl"))
    yield d
    assert d.stop() == 0, d.log_tail()


def put_blocks(addr: str, count: int, payload_bytes: int, seed: int):
    keys = [bytes([seed, i]) * 8 for i in range(count)]
    blocks = [encode_block(k, NS, 0, os.urandom(payload_bytes)) for k in keys]
    with BlockClient(addr) as client:
        client.put_many(list(zip(keys, blocks)), ns_id=NS)
        _, locations = client.lookup_locations(keys, ns_id=NS)
    return keys, blocks, locations


def test_get_many_writes_the_blocks_into_registered_buffers(daemon):
    keys, blocks, locations = put_blocks(daemon.data_addr, 12, (2 << 20) - 64, seed=1)  # 24 MiB: deferred once
    transport = NixlTransport(daemon.data_addr)
    try:
        got = transport.get_many(keys, [loc.length for loc in locations], [loc.seq for loc in locations], NS)
        assert [bytes(g)[64:] for g in got] == [b[64:] for b in blocks]
        assert all(g.readonly for g in got)
        stats = transport.statistics()
        assert stats.blocks == 12 and stats.bytes == sum(loc.length for loc in locations)
        assert stats.requests >= 2 and stats.refused == stats.corrupt_blocks == 0  # 12 blocks > one arena
        assert stats.transport == "sm"
    finally:
        transport.close()


def test_a_block_the_daemon_lacks_is_none_and_the_rest_arrive(daemon):
    keys, blocks, locations = put_blocks(daemon.data_addr, 2, 10_000, seed=2)
    absent = b"\xaa" * 16
    transport = NixlTransport(daemon.data_addr)
    try:
        got = transport.get_many([keys[0], absent, keys[1]], [locations[0].length, 4096, locations[1].length],
                                 [locations[0].seq, 0, locations[1].seq], NS)
        assert got[1] is None and bytes(got[0]) == bytes(encode_block(keys[0], NS, 0, blocks[0][64:],
                                                                      locations[0].seq))
        assert bytes(got[2])[64:] == blocks[1][64:]
    finally:
        transport.close()


def test_a_wrong_expected_sequence_is_a_miss(daemon):
    keys, _, locations = put_blocks(daemon.data_addr, 1, 5000, seed=3)
    transport = NixlTransport(daemon.data_addr)
    try:
        assert transport.get_many(keys, [locations[0].length], [locations[0].seq + 1], NS) == [None]
        assert transport.statistics().corrupt_blocks == 1
    finally:
        transport.close()


def wait_nixl_ready(cache: KVCache, timeout_s: float = 10.0) -> None:
    """Until every daemon's NIXL transport is set up (in the background; loads use TCP before)."""
    deadline = time.monotonic() + timeout_s
    while not all(d.nixl.ready() is not None for d in cache._warm.daemons):
        assert time.monotonic() < deadline, [d.nixl.statistics() for d in cache._warm.daemons]
        time.sleep(0.01)


def _namespace(name: str) -> Namespace:
    return Namespace(model=name, layout=LAYOUT, codec="raw")


def _kv(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (1, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return [(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
            for _ in range(LAYOUT.num_layers)]


@pytest.mark.parametrize("transport", ["nixl", "auto"])
def test_kvcache_loads_through_nixl_and_counts_it(daemon, transport):
    tokens = list(range(5000, 5000 + 16 * 6))
    kv = _kv(len(tokens), seed=4)
    with KVCache(_namespace(f"nixl-{transport}"), daemon.data_addr, hot_pool_bytes=0, transport=transport) as cache:
        assert cache.store(tokens, kv) == 6
        wait_nixl_ready(cache)
        loaded = cache.load(tokens)
        assert loaded.num_tokens == len(tokens) and loaded.transports == {"nixl": 6}
        for (k, v), (rk, rv) in zip(loaded.layers, kv):
            assert torch.equal(k, rk) and torch.equal(v, rv)
        warm = cache.statistics().warm
        assert warm.transports == {"nixl": 6} and warm.fallbacks == 0


def test_a_load_into_the_callers_tensor_is_written_there_by_the_daemon(daemon):
    """Raw blocks of the expected size are scattered by the daemon's WRITE straight into the output
    tensor's rows (its memory lent to NIXL for the load); only their heads land in our buffers."""
    tokens = list(range(7000, 7000 + 16 * 5))
    kv = _kv(len(tokens), seed=6)
    with KVCache(_namespace("nixl-in-place"), daemon.data_addr, hot_pool_bytes=0, transport="nixl") as cache:
        cache.store(tokens, kv)
        wait_nixl_ready(cache)
        out = torch.zeros(LAYOUT.num_layers, 2, 1, LAYOUT.num_kv_heads, len(tokens), LAYOUT.head_dim,
                          dtype=torch.float16)
        loaded = cache.load(tokens, out=out)
        assert loaded.num_tokens == len(tokens) and loaded.transports == {"nixl": 5}
        for layer, (k, v) in enumerate(kv):
            assert torch.equal(out[layer, 0, 0], k[0]) and torch.equal(out[layer, 1, 0], v[0])
        (d,) = cache._warm.daemons
        transport = d.nixl.ready()
        assert transport.statistics().blocks_in_place == 5
        assert not transport.agent._lent  # the tensor's memory is no longer registered


def test_blocks_nixl_does_not_deliver_fall_back_to_tcp_and_are_counted(daemon):
    """A destination buffer is a view the transport may refuse to hand out (every buffer
    in use): the blocks then come over TCP, counted as fallbacks."""
    tokens = list(range(9000, 9000 + 16 * 4))
    kv = _kv(len(tokens), seed=5)
    with KVCache(_namespace("nixl-fallback"), daemon.data_addr, hot_pool_bytes=0, transport="nixl") as cache:
        cache.store(tokens, kv)
        wait_nixl_ready(cache)
        (d,) = cache._warm.daemons
        held = []
        agent = d.nixl.ready().agent
        while (buf := agent.take_buffer(1)) is not None:  # take every destination buffer there may be
            held.append(buf)
        loaded = cache.load(tokens)
        assert loaded.transports == {"tcp": 4}
        assert cache.statistics().warm.fallbacks == 4
        del held
        assert cache.load(tokens).transports == {"nixl": 4}


def test_transport_nixl_needs_a_daemon_that_offers_it(tmp_path):
    d = start_kvtierd(tmp_path / "plain")  # --nixl off
    try:
        with BlockClient(d.data_addr) as client:
            assert "nixl" not in client.server_info()["features"]
        with pytest.raises(ValueError, match="does not offer the nixl transport"):
            KVCache(_namespace("x"), d.data_addr, transport="nixl")
        with pytest.raises(NixlUnavailable, match="does not offer"):
            NixlTransport(d.data_addr)
        with KVCache(_namespace("x"), d.data_addr, transport="auto", hot_pool_bytes=0) as cache:
            tokens = list(range(16))
            cache.store(tokens, _kv(16, seed=6))
            assert cache.load(tokens).transports == {"tcp": 1}
    finally:
        assert d.stop() == 0, d.log_tail()


def test_auto_daemon_offers_nixl_and_creates_its_agent_on_first_use(tmp_path):
    d = start_nixl_daemon(tmp_path / "auto", "--nixl", "auto")
    try:
        with BlockClient(d.data_addr) as client:
            assert "nixl" in client.server_info()["features"]
        assert "event=nixl_on" not in d.log_tail(100_000)
        keys, blocks, locations = put_blocks(d.data_addr, 2, 3000, seed=7)
        transport = NixlTransport(d.data_addr)
        try:
            got = transport.get_many(keys, [loc.length for loc in locations], [loc.seq for loc in locations], NS)
            assert [bytes(g)[64:] for g in got] == [b[64:] for b in blocks]
        finally:
            transport.close()
        assert "event=nixl_on" in d.log_tail(100_000)
    finally:
        assert d.stop() == 0, d.log_tail()


def test_concurrent_gets_each_get_their_own_buffer(daemon):
    from concurrent.futures import ThreadPoolExecutor

    sets = [put_blocks(daemon.data_addr, 3, 300_000 + 1000 * s, seed=20 + s) for s in range(4)]
    transport = NixlTransport(daemon.data_addr, pool_size=4)
    try:
        def fetch(s: int) -> bool:
            keys, blocks, locations = sets[s]
            ok = True
            for _ in range(5):
                got = transport.get_many(keys, [loc.length for loc in locations], [loc.seq for loc in locations], NS)
                ok &= [bytes(g)[64:] for g in got] == [b[64:] for b in blocks]
                del got  # its buffer is free again: four threads need four buffers, not eight
            return ok
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(fetch, range(4)))
        assert transport.statistics().corrupt_blocks == 0
    finally:
        transport.close()


SETUP_TIMEOUT_S = 0.5  # the tests' NIXL_SETUP_TIMEOUT_S
STALL_SLACK_S = 1.0  # a busy machine's scheduling on top of a bounded wait
RETRY_S = 1.0  # the tests' NIXL_SETUP_RETRY_S
LOAD_S_MAX = 5.0  # a load over TCP from a daemon that just resumed (a stalled NIXL setup would take timeout_s)


def _wait_setup_ended(setup: NixlSetup, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := setup.statistics().state) == "pending":
        assert time.monotonic() < deadline, "the NIXL setup outlived its timeouts"
        time.sleep(0.01)
    return state


def test_a_silent_daemon_fails_the_setup_within_its_timeout():
    """A listener that accepts and never answers: NixlTransport gives up within the setup timeout;
    NixlSetup never waits, fails (counted) and leaves the caller on TCP."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises((OSError, m.ClientError), match="timed out|no reply"):
            NixlTransport(addr, setup_timeout_s=SETUP_TIMEOUT_S)
        assert time.monotonic() - started < SETUP_TIMEOUT_S + STALL_SLACK_S
        started = time.monotonic()
        setup = NixlSetup(addr, setup_timeout_s=SETUP_TIMEOUT_S, retry_s=60.0)
        try:
            assert setup.ready() is None and time.monotonic() - started < 0.2
            assert _wait_setup_ended(setup, SETUP_TIMEOUT_S + STALL_SLACK_S) == "failed"
            stats = setup.statistics()
            assert (stats.attempts, stats.failures) == (1, 1) and "timed out" in stats.last_error
            assert setup.ready() is None and setup.offered
            assert setup.statistics().attempts == 1  # not retried before retry_s
        finally:
            setup.close()


@pytest.mark.parametrize("transport", ["auto", "nixl"])
@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_stopped_daemon_stalls_neither_kvcache_nor_its_loads(tmp_path, monkeypatch, transport):
    """The daemon frozen (SIGSTOP) while a cache opens: the cache opens at once (``nixl``: within
    the setup timeout, not refused), the setup times out and is counted, the loads after the
    daemon resumes go over TCP (counted as fallbacks) until a later setup brings NIXL in."""
    monkeypatch.setattr(nixl_setup, "NIXL_SETUP_TIMEOUT_S", SETUP_TIMEOUT_S)
    monkeypatch.setattr(nixl_setup, "NIXL_SETUP_RETRY_S", RETRY_S)
    d = start_nixl_daemon(tmp_path / "kvtierd")
    tokens = list(range(7000, 7000 + 16 * 3))
    kv = _kv(len(tokens), seed=8)
    stopped = False
    try:
        with KVCache(_namespace(f"stopped-{transport}"), d.data_addr, hot_pool_bytes=0, transport="tcp") as tcp:
            assert tcp.store(tokens, kv) == 3
        d.signal(signal.SIGSTOP)
        stopped = True
        started = time.monotonic()
        cache = KVCache(_namespace(f"stopped-{transport}"), d.data_addr, hot_pool_bytes=0, transport=transport)
        try:
            opened_s = time.monotonic() - started
            assert opened_s < (STALL_SLACK_S if transport == "auto" else SETUP_TIMEOUT_S + STALL_SLACK_S), opened_s
            (daemon,) = cache._warm.daemons
            assert daemon.nixl.ready() is None
            assert _wait_setup_ended(daemon.nixl, 3 * SETUP_TIMEOUT_S + STALL_SLACK_S) == "failed"
            d.signal(signal.SIGCONT)
            stopped = False
            started = time.monotonic()
            loaded = cache.load(tokens)
            assert time.monotonic() - started < LOAD_S_MAX
            assert loaded.num_tokens == len(tokens) and loaded.transports == {"tcp": 3}
            for (k, v), (rk, rv) in zip(loaded.layers, kv):
                assert torch.equal(k, rk) and torch.equal(v, rv)
            assert cache.statistics().warm.fallbacks == 3
            assert daemon.nixl.statistics().failures == 1
            time.sleep(RETRY_S)
            assert cache.load(tokens).transports == {"tcp": 3}  # its ready() starts the second setup
            wait_nixl_ready(cache)
            assert cache.load(tokens).transports == {"nixl": 3}
            assert daemon.nixl.statistics().attempts == 2
        finally:
            if stopped:
                d.signal(signal.SIGCONT)
                stopped = False
            cache.close()
    finally:
        if stopped:
            d.signal(signal.SIGCONT)
        assert d.stop() == 0, d.log_tail()


STOPPED_AGENT = """
import os, signal
from kvtier.client.nixl_transport import ClientAgent
agent = ClientAgent.shared(loopback_only=True)
agent.take_buffer(1 << 20)
print(agent.metadata().hex(), repr(agent.regions()), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
os._exit(0)
"""


def _nixl_peers(addr: str) -> int:
    with BlockClient(addr) as client:
        return client.stats()["nixl"]["peers"]


def test_the_metadata_of_a_stopped_client_holds_no_daemon_thread(daemon):
    """NIXL_METADATA naming the agent of a stopped process: the daemon loads it and answers at
    once, unloads it when the connection closes, and serves the next client."""
    child = subprocess.Popen([sys.executable, "-c", STOPPED_AGENT], stdout=subprocess.PIPE,
                             env={**os.environ, **LOOPBACK_ENV})
    try:
        metadata_hex, regions = child.stdout.readline().decode().split(" ", 1)
        peers = _nixl_peers(daemon.data_addr)
        host, _, port = daemon.data_addr.rpartition(":")
        ch = ControlChannel(host, int(port), 10.0, None, "stopped-agent")
        try:
            started = time.monotonic()
            reply = ch.exchange(m.NixlMetadata(0, bytes.fromhex(metadata_hex), ast.literal_eval(regions)),
                                timeout_s=SETUP_TIMEOUT_S + STALL_SLACK_S)
            assert reply.metadata and time.monotonic() - started < SETUP_TIMEOUT_S + STALL_SLACK_S
            assert _nixl_peers(daemon.data_addr) == peers + 1
        finally:
            ch.close()
        deadline = time.monotonic() + STALL_SLACK_S
        while _nixl_peers(daemon.data_addr) != peers:
            assert time.monotonic() < deadline, "the stopped agent was not unloaded"
            time.sleep(0.02)
        keys, blocks, locations = put_blocks(daemon.data_addr, 2, 3000, seed=9)
        transport = NixlTransport(daemon.data_addr)
        try:
            got = transport.get_many(keys, [loc.length for loc in locations], [loc.seq for loc in locations], NS)
            assert [bytes(g)[64:] for g in got] == [b[64:] for b in blocks]
        finally:
            transport.close()
    finally:
        child.kill()
        child.wait()
