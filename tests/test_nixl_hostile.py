"""Hostile NIXL peers against a real kvtierd: bad descriptors are refused before any transfer and
nothing is written outside a client's buffer; metadata only after an authenticated HELLO; a
client that dies or stalls mid-transfer; the daemon answers errors and serves on."""
from __future__ import annotations

import os
import socket
import time

import pytest

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from nixl_daemon import LOOPBACK_ENV, start_misbehaving_peer, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.nixl_transport import ClientAgent, NixlTransport, buffer_address, ControlChannel  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402
from kvtier.wire import connection as p  # noqa: E402
from kvtier.wire import events as m  # noqa: E402
from kvtier.wire.frames import pack_header  # noqa: E402
from kvtier.wire.frames import DEFERRED_LENGTH  # noqa: E402

os.environ.update(LOOPBACK_ENV)
NS = b"\x05" * 16
CANARY = 0xC3
STALL_WAIT_S = 20.0  # the daemon's TRANSFER_TIMEOUT_S (5 s) and the log line, with room on a loaded machine


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_nixl_daemon(tmp_path_factory.mktemp("kvtierd-hostile"))
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture(scope="module")
def stored(daemon):
    """Two blocks in the daemon: ``(keys, blocks, lengths)``."""
    keys = [b"\x31" * 16, b"\x32" * 16]
    blocks = [encode_block(k, NS, 0, os.urandom(20_000)) for k in keys]
    with BlockClient(daemon.data_addr) as client:
        client.put_many(list(zip(keys, blocks)), ns_id=NS)
    return keys, blocks, [len(b) for b in blocks]


class RawPeer:
    """A real client agent and one control connection that sends whatever descriptors it is told to."""

    def __init__(self, addr: str, region_offset: int = 0, region_bytes: int | None = None):
        self.agent = ClientAgent.shared(loopback_only=True)
        self.buf = self.agent.take_buffer(1 << 20)  # a view of a registered buffer: ours while it lives
        self.buf[:] = bytes([CANARY]) * self.buf.nbytes
        self.base = buffer_address(self.buf)
        host, _, port = addr.rpartition(":")
        self.ch = ControlChannel(host, int(port), 10.0, None, "raw-peer")
        region = (self.base + region_offset, region_bytes or (1 << 20) - region_offset)  # of a larger buffer
        reply = self.ch.exchange(m.NixlMetadata(0, self.agent.metadata(), (region,)))
        self.daemon_agent = self.agent.add_daemon(reply.metadata)

    def get(self, keys, descriptors, agent_name=None, extents=None):
        """The reply, once the blocks it says were written have arrived (their notification)."""
        reply = self.ch.exchange(m.NixlGet(0, tuple(keys), agent_name or self.agent.name, tuple(descriptors), NS,
                                           True, extents), while_waiting=self.agent.progress)
        request_id = self.ch.last_request_id
        written = sum(n for n in reply.lengths if n != DEFERRED_LENGTH)
        arrived, deadline = 0, time.monotonic() + 10.0
        while arrived < written:  # the part notifications of every byte written
            assert time.monotonic() < deadline, (arrived, written)
            self.agent.progress()
            arrived += sum(n for _, _, n in self.agent.take_parts(self.daemon_agent, request_id))
        return reply

    def untouched(self) -> bool:
        return bytes(self.buf).count(bytes([CANARY])) == self.buf.nbytes

    def still_served(self) -> bool:
        return self.ch.exchange(p.Ping(0, b"alive")).data == b"alive"

    def close(self):
        self.ch.close()


@pytest.mark.parametrize("make_descriptors,message", [
    (lambda base, n: [(base + (1 << 20) - 4096, n[0]), (base, n[1])], "outside every region"),  # past the end
    (lambda base, n: [(base - 4096, n[0]), (base + 65536, n[1])], "outside every region"),  # before the start
    (lambda base, n: [(base, n[0] - 1), (base + 65536, n[1])], "cannot hold its block"),  # a wrong length
    (lambda base, n: [(base, n[0]), (base + 4096, n[1])], "overlap"),
    (lambda base, n: [(base, 0), (base + 65536, n[1])], "capacity of 0 bytes"),
])
def test_bad_descriptors_are_refused_and_nothing_is_written(daemon, stored, make_descriptors, message):
    keys, _, lengths = stored
    peer = RawPeer(daemon.data_addr)
    try:
        with pytest.raises(p.RemoteError, match=message) as refused:
            peer.get(keys, make_descriptors(peer.base, lengths))
        assert refused.value.code == p.ErrorCode.BAD_REQUEST
        assert peer.untouched()
        assert peer.still_served()
        good = peer.get(keys, [(peer.base, lengths[0]), (peer.base + 65536, lengths[1])])
        assert good.lengths == tuple(lengths)
    finally:
        peer.close()


def test_writes_stay_inside_the_descriptor(daemon, stored):
    keys, blocks, lengths = stored
    peer = RawPeer(daemon.data_addr, region_offset=8192, region_bytes=lengths[0])  # the region is the block
    try:
        with pytest.raises(p.RemoteError, match="outside every region"):
            peer.get(keys[:1], [(peer.base + 8191, lengths[0])])  # one byte before the declared region
        reply = peer.get(keys[:1], [(peer.base + 8192, lengths[0])])
        assert reply.lengths == (lengths[0],)
        seen = bytes(peer.buf)
        assert seen[8192 + 64:8192 + lengths[0]] == blocks[0][64:]
        outside = seen[:8192] + seen[8192 + lengths[0]:]
        assert outside.count(bytes([CANARY])) == len(outside)
    finally:
        peer.close()


def _scatter(base: int, cuts) -> tuple[tuple[int, int], ...]:
    """Extents (offset, length) from ``base``: one block's bytes spread over the buffer, gaps between."""
    return tuple((base + offset, length) for offset, length in cuts)


@pytest.mark.parametrize("second,message", [
    ([(300_000, 10_000), (1 << 20, 10_064)], "outside every region"),  # its last extent past the region's end
    ([(300_000, 10_000), (305_000, 10_064)], "overlap"),  # two extents of one block over each other
    ([(100, 10_000), (600_000, 10_064)], "overlap"),  # over the first block's extents
    ([(300_000, 10_000), (600_000, 10_063)], "cannot hold its block"),  # one byte short
])
def test_bad_scatter_extents_are_refused_and_nothing_is_written(daemon, stored, second, message):
    keys, _, lengths = stored
    peer = RawPeer(daemon.data_addr)
    try:
        first = _scatter(peer.base, [(0, 64), (4096, 10_000), (40_000, lengths[0] - 10_064)])
        other = _scatter(peer.base, second)
        descriptors = [(first[0][0], lengths[0]), (other[0][0], sum(n for _, n in other))]
        with pytest.raises(p.RemoteError, match=message) as refused:
            peer.get(keys, descriptors, extents=(first, other))
        assert refused.value.code == p.ErrorCode.BAD_REQUEST
        assert peer.untouched() and peer.still_served()
    finally:
        peer.close()


def test_a_scattered_block_lands_in_its_extents_and_nowhere_else(daemon, stored):
    keys, blocks, lengths = stored
    peer = RawPeer(daemon.data_addr)
    cuts = [(0, 64), (8192, 7000), (65536, 5000), (200_000, lengths[0] - 12_064)]
    try:
        extents = _scatter(peer.base, cuts)
        reply = peer.get(keys[:1], [(extents[0][0], lengths[0])], extents=(extents,))
        assert reply.lengths == (lengths[0],)
        seen, pos, landed = bytes(peer.buf), 0, bytearray()
        for offset, length in cuts:
            landed += seen[offset:offset + length]
        assert landed[64:] == blocks[0][64:]
        touched = set()
        for offset, length in cuts:
            touched.update(range(offset, offset + length))
        assert all(seen[i] == CANARY for i in range(len(seen)) if i not in touched)
    finally:
        peer.close()


def test_only_the_agent_this_connection_loaded_is_written_to(daemon, stored):
    keys, _, lengths = stored
    peer = RawPeer(daemon.data_addr)
    try:
        with pytest.raises(p.RemoteError, match="names agent 'someone-else'"):
            peer.get(keys[:1], [(peer.base, lengths[0])], agent_name="someone-else")
        assert peer.untouched() and peer.still_served()
    finally:
        peer.close()


def test_nixl_get_before_nixl_metadata_is_refused(daemon, stored):
    keys, _, lengths = stored
    host, _, port = daemon.data_addr.rpartition(":")
    ch = ControlChannel(host, int(port), 10.0, None, "no-metadata")
    try:
        with pytest.raises(p.RemoteError, match="before NIXL_METADATA"):
            ch.exchange(m.NixlGet(0, tuple(keys[:1]), "x", ((4096, lengths[0]),), NS, True))
        assert ch.exchange(p.Ping(0, b"ok")).data == b"ok"
    finally:
        ch.close()


def test_garbage_metadata_and_unregistered_regions_are_refused(daemon, stored):
    keys, _, lengths = stored
    host, _, port = daemon.data_addr.rpartition(":")
    ch = ControlChannel(host, int(port), 10.0, None, "garbage")
    try:
        with pytest.raises(p.RemoteError, match="does not load"):
            ch.exchange(m.NixlMetadata(0, b"not nixl metadata at all", ((4096, 4096),)))
        assert ch.exchange(p.Ping(0, b"ok")).data == b"ok"
    finally:
        ch.close()
    # a region declared but never registered with NIXL: NIXL itself refuses the WRITE
    agent = ClientAgent.shared(loopback_only=True)
    unregistered = bytearray(1 << 16)
    start = buffer_address(unregistered)
    ch = ControlChannel(host, int(port), 10.0, None, "unregistered")
    try:
        ch.exchange(m.NixlMetadata(0, agent.metadata(), ((start, len(unregistered)),)))
        with pytest.raises(p.RemoteError, match="could not be posted"):
            ch.exchange(m.NixlGet(0, tuple(keys[:1]), agent.name, ((start, lengths[0]),), NS, True))
        assert unregistered.count(0) == len(unregistered)
        assert ch.exchange(p.Ping(0, b"ok")).data == b"ok"
    finally:
        ch.close()


def _raw_frame(op: int, meta: bytes, count: int = 0) -> bytes:
    return pack_header(op, 0, 1, count, len(meta), 0) + meta


def _error_and_close(sock: socket.socket) -> p.ErrorReply:
    conn = p.Connection(p.Role.CLIENT, check_replies=False)
    while True:
        event = conn.next_event()
        if event is p.NEED_DATA:
            conn.receive_data(sock.recv(65536))
            continue
        assert isinstance(event, p.ErrorReply), event
        conn.receive_data(sock.recv(65536))
        assert conn.next_event() is p.CONNECTION_CLOSED
        return event


def test_metadata_before_hello_is_refused_and_closed(daemon):
    agent = ClientAgent.shared(loopback_only=True)
    host, _, port = daemon.data_addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(_raw_frame(m.Op.NIXL_METADATA, agent.metadata()))
        error = _error_and_close(sock)
    assert error.code == p.ErrorCode.AUTH and "first frame must be HELLO" in error.message


def test_metadata_with_a_wrong_token_is_never_read(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("right-token\n")
    d = start_nixl_daemon(tmp_path / "kvtierd", "--token-file", str(token_file))
    agent = ClientAgent.shared(loopback_only=True)
    try:
        host, _, port = d.data_addr.rpartition(":")
        with pytest.raises(p.RemoteError, match="wrong token"):
            ControlChannel(host, int(port), 10.0, "wrong-token", "intruder")
        hello = p.Connection(p.Role.CLIENT).send(p.Hello(1, "intruder", "wrong-token"))
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(hello + _raw_frame(m.Op.NIXL_METADATA, agent.metadata()))
            assert _error_and_close(sock).code == p.ErrorCode.AUTH
        assert "event=nixl_peer" not in d.log_tail(100_000)
        transport = NixlTransport(d.data_addr, token="right-token")  # the right token: served
        transport.close()
        assert "event=nixl_peer" in d.log_tail(100_000)
    finally:
        assert d.stop() == 0, d.log_tail()


def _start_child(addr: str, action: str, keys, lengths):
    return start_misbehaving_peer(addr, action, NS, keys, lengths)


def _big_blocks(addr: str, seed: int):
    keys = [bytes([seed, i]) * 8 for i in range(2)]
    blocks = [encode_block(k, NS, 0, os.urandom((32 << 20) - 64)) for k in keys]
    with BlockClient(addr) as client:
        client.put_many(list(zip(keys, blocks)), ns_id=NS)
    return keys, [len(b) for b in blocks]


def _serves_nixl(addr: str, stored) -> bool:
    keys, blocks, lengths = stored
    transport = NixlTransport(addr)
    try:
        with BlockClient(addr) as client:
            _, locations = client.lookup_locations(keys, ns_id=NS)
        got = transport.get_many(keys, lengths, [loc.seq for loc in locations], NS)
        return [bytes(g)[64:] for g in got] == [b[64:] for b in blocks]
    finally:
        transport.close()


def test_a_client_that_dies_mid_transfer_leaves_the_daemon_serving(daemon, stored):
    keys, lengths = _big_blocks(daemon.data_addr, seed=0x41)
    child = _start_child(daemon.data_addr, "kill", keys, lengths)
    assert child.wait(30) == -9
    assert _serves_nixl(daemon.data_addr, stored)
    assert daemon.alive()
    with BlockClient(daemon.data_addr) as client:
        nixl = client.stats()["nixl"]
    assert nixl["writes"] >= 1 and nixl["transport"] == "sm"


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_transfer_that_never_completes_times_out(tmp_path, stored):
    d = start_nixl_daemon(tmp_path / "kvtierd", "--nixl-tls", "self,tcp")  # a stopped peer stalls a TCP WRITE
    child = None
    try:
        keys, lengths = _big_blocks(d.data_addr, seed=0x42)
        child = _start_child(d.data_addr, "stop", keys, lengths)
        deadline = time.monotonic() + STALL_WAIT_S
        while "not done within" not in d.log_tail(100_000) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "TRANSFER_TIMEOUT_S" in d.log_tail(100_000), d.log_tail()
        with BlockClient(d.data_addr) as client:
            assert client.stats()["nixl"]["timeouts"] == 1
        small_keys = [b"\x51" * 16]
        small = [encode_block(small_keys[0], NS, 0, os.urandom(5000))]
        with BlockClient(d.data_addr) as client:
            client.put_many(list(zip(small_keys, small)), ns_id=NS)
        assert _serves_nixl(d.data_addr, (small_keys, small, [len(small[0])]))
    finally:
        if child is not None:
            child.kill()
            child.wait()
        assert d.stop() == 0, d.log_tail()
