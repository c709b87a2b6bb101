"""NIXL_PUT against a real kvtierd: the daemon READs a store's blocks from this process's memory
(the engine's KV lent to NIXL, headers through a staging buffer) into a request buffer; what it
refuses (descriptors outside the declared regions, short or corrupt blocks, a peer it did not
load) stores nothing, and the daemon serves on; a durable NIXL_PUT survives a crash."""
from __future__ import annotations

import gc
import os
import time

import pytest

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

import torch  # noqa: E402

from nixl_daemon import LOOPBACK_ENV, start_misbehaving_peer, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.client.nixl_transport import ClientAgent, ControlChannel, NixlTransport, buffer_address  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
from kvtier.wire import connection as p  # noqa: E402
from kvtier.wire import events as m  # noqa: E402
from kvtier.wire.events import BlockParts  # noqa: E402

os.environ.update(LOOPBACK_ENV)
NS = b"\x0b" * 16
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=32)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_nixl_daemon(tmp_path_factory.mktemp("kvtierd-nixl-put"))
    yield d
    assert d.stop() == 0, d.log_tail()


def _kv(tokens: int, seed: int, layout: KVLayout = LAYOUT):
    g = torch.Generator().manual_seed(seed)
    shape = (1, layout.num_kv_heads, tokens, layout.head_dim)
    return [(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
            for _ in range(layout.num_layers)]


def _ready(cache: KVCache, timeout_s: float = 10.0) -> NixlTransport:
    assert cache.wait_nixl_ready(timeout_s)
    (daemon,) = cache._warm.daemons
    return daemon.nixl.ready()


def _same(loaded, kv) -> bool:
    return all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for pair, ref in zip(loaded.layers, kv) for a, b in zip(pair, ref))


def _daemon_nixl(addr: str) -> dict:
    with BlockClient(addr) as client:
        return client.stats()["nixl"]


def test_a_store_through_nixl_is_read_by_the_daemon_from_where_the_kv_lies(daemon):
    tokens = list(range(100, 100 + 32 * 5))
    kv = _kv(len(tokens), seed=1)
    before = _daemon_nixl(daemon.data_addr)
    with KVCache(Namespace("put-in-place", LAYOUT), daemon.data_addr, hot_pool_bytes=0, transport="nixl") as cache:
        transport = _ready(cache)
        assert cache.store(tokens, kv, durable=True) == 5
        stats = transport.statistics()
        assert stats.put_blocks == 5 and stats.puts_refused == 0
        # only the headers were copied (into a staging buffer): the KV itself was read where it lies
        assert 0 < stats.put_bytes_staged <= 5 * 128 and stats.put_bytes > 5 * LAYOUT.block_raw_bytes
    after = _daemon_nixl(daemon.data_addr)
    assert after["put_blocks"] - before.get("put_blocks", 0) == 5
    assert after["reads"] > before.get("reads", 0)
    with KVCache(Namespace("put-in-place", LAYOUT), daemon.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
        loaded = cache.load(tokens)
        assert loaded.num_tokens == len(tokens) and _same(loaded, kv)


def test_a_store_whose_kv_another_lend_overlaps_still_goes_through_nixl(daemon):
    """Two stores may lend overlapping views of one tensor (a prefix and its extension): the
    regions declared to the daemon are joined, or it refuses them and every PUT goes over TCP."""
    tokens = list(range(3000, 3000 + 32 * 3))
    kv = _kv(len(tokens), seed=9)
    k0 = kv[0][0]
    with KVCache(Namespace("put-overlap", LAYOUT), daemon.data_addr, hot_pool_bytes=0, transport="nixl") as cache:
        transport = _ready(cache)
        with transport.agent.lend_range(k0.data_ptr(), k0.numel() * k0.element_size() // 2):  # the other store's
            assert cache.store(tokens, kv, durable=True) == 3
        stats = transport.statistics()
        assert stats.put_blocks == 3 and stats.puts_refused == 0
        loaded = cache.load(tokens)
        assert loaded.num_tokens == len(tokens) and _same(loaded, kv)


def test_blocks_in_send_buffers_are_lent_for_their_put_not_copied(daemon):
    """A write-behind save copies the KV out into send buffers; its PUT lends those for the call."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=256)  # 512 KiB
    tokens = list(range(600, 600 + 256 * 3))
    kv = _kv(len(tokens), seed=5, layout=layout)
    with KVCache(Namespace("put-send-buffers", layout), daemon.data_addr, hot_pool_bytes=0,
                 transport="nixl") as cache:
        transport = _ready(cache)
        lent_before = dict(transport.agent._lent)
        assert cache.store_async(tokens, kv).result(timeout=30) == 3
        stats = transport.statistics()
        assert stats.put_blocks == 3 and stats.put_bytes > 3 * layout.block_raw_bytes
        assert stats.put_bytes_staged == 0  # whole blocks, one send buffer each: lent, nothing copied
        assert transport.agent._lent == lent_before
        loaded = cache.load(tokens)
        assert loaded.num_tokens == len(tokens) and _same(loaded, kv)


STORES_UNTIL_A_WAIT = 5  # stores tried until one's reply is waited for (the fault is injected in that wait)


def test_a_nixl_error_while_a_put_waits_sends_it_over_tcp_and_drops_that_connection(daemon):
    """The abandoned NIXL_PUT is stored by the daemon or, where its READ needed our progress, times
    out there (TRANSFER_TIMEOUT_S) and gives its reservation back; either way the TCP PUT of the
    same blocks stores them."""
    with KVCache(Namespace("put-progress-fault", LAYOUT), daemon.data_addr, hot_pool_bytes=0,
                 transport="nixl") as cache:
        transport = _ready(cache)
        warm = list(range(8000, 8032))
        cache.store(warm, _kv(len(warm), seed=8), durable=True)  # the agents' UCX endpoint wired up
        nixl = transport.agent._agent
        real, faults = nixl.get_new_notifs, []

        def failing_once():  # NIXL's own failure, while the durable PUT's reply is awaited
            if not faults:
                faults.append(1)
                raise RuntimeError("injected NIXL progress fault")
            return real()

        nixl.get_new_notifs = failing_once
        try:
            for attempt in range(STORES_UNTIL_A_WAIT):  # a reply there before the first poll is not waited for
                tokens = list(range(3000 + 1000 * attempt, 3000 + 1000 * attempt + 32 * 4))
                kv = _kv(len(tokens), seed=6 + attempt)
                before = transport.statistics().put_blocks
                assert cache.store(tokens, kv, durable=True) == 4
                if faults:
                    break
        finally:
            del nixl.get_new_notifs
        assert faults, "the PUT's wait never progressed the agent"
        assert transport.statistics().put_blocks - before < 4  # the failed one went over TCP
        loaded = cache.load(tokens)
        assert loaded.num_tokens == len(tokens) and _same(loaded, kv)
        more = list(range(9000, 9000 + 32 * 2))
        before = transport.statistics().put_blocks
        assert cache.store(more, _kv(len(more), seed=7), durable=True) == 2
        assert transport.statistics().put_blocks == before + 2  # NIXL again, on a good connection


def test_the_lent_kv_is_given_back_after_the_store(daemon):
    tokens = list(range(900, 900 + 32 * 2))
    kv = _kv(len(tokens), seed=2)
    with KVCache(Namespace("put-lend", LAYOUT), daemon.data_addr, hot_pool_bytes=0, transport="nixl") as cache:
        transport = _ready(cache)
        lent_before = dict(transport.agent._lent)
        cache.store(tokens, kv)
        assert transport.statistics().put_blocks == 2
        assert transport.agent._lent == lent_before


def test_a_durable_nixl_put_survives_a_crash(tmp_path):
    d = start_nixl_daemon(tmp_path / "kvtierd")
    tokens = list(range(2000, 2000 + 32 * 4))
    kv = _kv(len(tokens), seed=3)
    try:
        with KVCache(Namespace("put-crash", LAYOUT), d.data_addr, hot_pool_bytes=0, transport="nixl") as cache:
            transport = _ready(cache)
            assert cache.store(tokens, kv, durable=True) == 4
            assert transport.statistics().put_blocks == 4
        d.kill()  # SIGKILL: nothing but what reached flash is left
        d.restart()
        with KVCache(Namespace("put-crash", LAYOUT), d.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
            loaded = cache.load(tokens)
            assert loaded.num_tokens == len(tokens) and _same(loaded, kv)
    finally:
        d.stop()


class PutPeer:
    """A real client agent and one control connection that sends whatever NIXL_PUT it is told to."""

    def __init__(self, addr: str):
        self.agent = ClientAgent.shared(loopback_only=True)
        self.buf = self.agent.take_buffer(1 << 20)  # registered: ours while this view lives
        self.base = buffer_address(self.buf)
        host, _, port = addr.rpartition(":")
        self.ch = ControlChannel(host, int(port), 10.0, None, "put-peer")
        self.ch.exchange(m.NixlMetadata(0, self.agent.metadata(), ((self.base, self.buf.nbytes),)))

    def put(self, keys, extents, agent_name=None, durable=True):
        return self.ch.exchange(m.NixlPut(0, tuple(keys), agent_name or self.agent.name, tuple(extents), durable),
                                while_waiting=self.agent.progress)

    def place(self, offset: int, block: bytes) -> tuple[int, int]:
        self.buf[offset:offset + len(block)] = block
        return self.base + offset, len(block)

    def close(self):
        self.ch.close()


def _stored(addr: str, keys) -> int:
    with BlockClient(addr) as client:
        return sum(client.get(k) is not None for k in keys)


@pytest.mark.parametrize("case,code,message", [
    ("outside", p.ErrorCode.BAD_REQUEST, "outside every region"),
    ("short", p.ErrorCode.BAD_BLOCK, "shorter than its header"),
    ("corrupt", p.ErrorCode.BAD_BLOCK, "nothing stored"),
    ("wrong_key", p.ErrorCode.BAD_BLOCK, "nothing stored"),
    ("other_agent", p.ErrorCode.BAD_REQUEST, "names agent 'someone-else'"),
])
def test_a_refused_nixl_put_stores_nothing_and_the_daemon_serves_on(daemon, case, code, message):
    keys = [(case.encode() * 16)[:15] + bytes([i]) for i in range(2)]
    blocks = [encode_block(k, NS, 0, os.urandom(30_000)) for k in keys]
    peer = PutPeer(daemon.data_addr)
    try:
        extents = [[peer.place(0, blocks[0])], [peer.place(65536, blocks[1])]]
        agent_name = None
        if case == "outside":
            extents[1] = [(peer.base + peer.buf.nbytes - 100, 200)]
        elif case == "short":
            extents[1] = [(peer.base + 65536, 40)]
        elif case == "corrupt":
            peer.buf[65536 + 1000] ^= 0xFF  # after the header's CRC was computed
        elif case == "wrong_key":
            extents = [extents[1], extents[0]]
        elif case == "other_agent":
            agent_name = "someone-else"
        with pytest.raises(p.RemoteError, match=message) as refused:
            peer.put(keys, extents, agent_name)
        assert refused.value.code == code
        assert _stored(daemon.data_addr, keys) == 0
        assert peer.ch.exchange(p.Ping(0, b"alive")).data == b"alive"
        good = [encode_block(k, NS, 0, os.urandom(1000)) for k in keys]  # the same connection, a good PUT
        reply = peer.put(keys, [[peer.place(200_000, good[0])], [peer.place(300_000, good[1])]])
        assert len(reply.seqs) == 2 and _stored(daemon.data_addr, keys) == 2
    finally:
        peer.close()


def test_a_block_in_several_extents_is_joined_in_order(daemon):
    key = b"\x71" * 16
    block = encode_block(key, NS, 0, os.urandom(50_000))
    peer = PutPeer(daemon.data_addr)
    try:
        cuts = [(0, 64), (8192, 20_000), (100_000, len(block) - 20_064)]
        extents, at = [], 0
        for offset, n in cuts:
            extents.append(peer.place(offset, block[at:at + n]))
            at += n
        peer.put([key], [extents])
        with BlockClient(daemon.data_addr) as client:
            assert bytes(client.get(key))[64:] == block[64:]
    finally:
        peer.close()


def test_a_put_of_a_stored_key_is_stored_again(daemon):
    key = b"\x72" * 16
    block = encode_block(key, NS, 0, os.urandom(10_000))
    with BlockClient(daemon.data_addr) as client:
        client.put_many([(key, block)])
    stored = _daemon_nixl(daemon.data_addr).get("put_blocks", 0)
    peer = PutPeer(daemon.data_addr)
    try:
        assert len(peer.put([key], [[peer.place(0, block)]]).seqs) == 1
        assert _daemon_nixl(daemon.data_addr)["put_blocks"] == stored + 1
    finally:
        peer.close()


def test_nixl_put_before_nixl_metadata_is_refused(daemon):
    host, _, port = daemon.data_addr.rpartition(":")
    ch = ControlChannel(host, int(port), 10.0, None, "no-metadata")
    try:
        with pytest.raises(p.RemoteError, match="NIXL_PUT before NIXL_METADATA"):
            ch.exchange(m.NixlPut(0, (b"\x73" * 16,), "x", (((4096, 100),),)))
        assert ch.exchange(p.Ping(0, b"ok")).data == b"ok"
    finally:
        ch.close()


def test_declared_but_unregistered_memory_fails_the_read_and_stores_nothing(daemon):
    agent = ClientAgent.shared(loopback_only=True)
    key = b"\x74" * 16
    block = bytearray(encode_block(key, NS, 0, os.urandom(5000)))
    start = buffer_address(block)
    host, _, port = daemon.data_addr.rpartition(":")
    ch = ControlChannel(host, int(port), 10.0, None, "unregistered")
    try:
        ch.exchange(m.NixlMetadata(0, agent.metadata(), ((start, len(block)),)))
        with pytest.raises(p.RemoteError, match="nothing stored"):
            ch.exchange(m.NixlPut(0, (key,), agent.name, (((start, len(block)),),)), while_waiting=agent.progress)
        assert _stored(daemon.data_addr, [key]) == 0
        assert ch.exchange(p.Ping(0, b"ok")).data == b"ok"
    finally:
        ch.close()


def test_a_store_nixl_cannot_stage_goes_over_tcp(daemon):
    """Every staging buffer held elsewhere: the NIXL_PUT cannot copy its headers, so the blocks go
    over TCP, and are stored all the same."""
    tokens = list(range(4000, 4000 + 32 * 3))
    kv = _kv(len(tokens), seed=4)
    with KVCache(Namespace("put-fallback", LAYOUT), daemon.data_addr, hot_pool_bytes=0, transport="nixl") as cache:
        transport = _ready(cache)
        gc.collect()  # views of earlier tests' buffers, freed now rather than during the store
        held = []
        while (view := transport.agent.take_buffer(1 << 20)) is not None:
            held.append(view)
        assert cache.store(tokens, kv) == 3
        assert transport.statistics().put_blocks == 0
        del held, view
        loaded = cache.load(tokens)
        assert loaded.num_tokens == len(tokens) and _same(loaded, kv)


def test_a_block_of_more_pieces_than_one_put_may_name_is_refused_here(daemon):
    transport = NixlTransport(daemon.data_addr)
    key = b"\x75" * 16
    block = encode_block(key, NS, 0, os.urandom(m.NIXL_EXTENTS_MAX + 10))
    pieces = [memoryview(block)[:64]] + [memoryview(block)[i:i + 1] for i in range(64, len(block))]
    try:
        with pytest.raises(ValueError, match="pieces is over"):
            transport.put_many([(key, BlockParts(pieces))])
    finally:
        transport.close()


STALL_WAIT_S = 20.0  # the daemon's TRANSFER_TIMEOUT_S (5 s) and its log line, with room on a loaded machine


def _put_child(addr: str, action: str, keys, lengths):
    return start_misbehaving_peer(addr, action, NS, keys, lengths)


def _still_stores(addr: str, seed: int) -> bool:
    key = bytes([seed]) * 16
    block = encode_block(key, NS, 0, os.urandom(1 << 20))
    with BlockClient(addr) as client:
        client.put_many([(key, block)], durable=True)
        return bytes(client.get(key))[64:] == block[64:]


def test_a_client_that_dies_mid_put_leaves_nothing_half_stored(daemon):
    keys = [bytes([0x81, i]) * 8 for i in range(2)]
    failures = _daemon_nixl(daemon.data_addr).get("failures", 0)
    child = _put_child(daemon.data_addr, "put-kill", keys, [32 << 20, 32 << 20])
    assert child.wait(30) == -9
    deadline = time.monotonic() + STALL_WAIT_S
    while _daemon_nixl(daemon.data_addr).get("failures", 0) == failures and _stored(daemon.data_addr, keys) < 2:
        assert time.monotonic() < deadline, "the PUT of the dead client was never answered"
        time.sleep(0.1)  # a READ that failed, or one that was done before the client died
    assert _stored(daemon.data_addr, keys) in (0, 2)  # the frame's blocks all or none
    assert daemon.alive() and _still_stores(daemon.data_addr, 0x82)


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_put_whose_read_never_completes_times_out_and_stores_nothing(tmp_path):
    d = start_nixl_daemon(tmp_path / "kvtierd", "--nixl-tls", "self,tcp")  # a stopped peer stalls a TCP READ
    child = None
    try:
        keys = [bytes([0x83, i]) * 8 for i in range(2)]
        child = _put_child(d.data_addr, "put-stop", keys, [32 << 20, 32 << 20])
        deadline = time.monotonic() + STALL_WAIT_S
        while "not done within" not in d.log_tail(100_000) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "TRANSFER_TIMEOUT_S" in d.log_tail(100_000), d.log_tail()
        assert _daemon_nixl(d.data_addr)["timeouts"] == 1
        assert _stored(d.data_addr, keys) == 0
        assert _still_stores(d.data_addr, 0x84)  # the aborted reservation gave its room back
    finally:
        if child is not None:
            child.kill()
            child.wait()
        assert d.stop() == 0, d.log_tail()
