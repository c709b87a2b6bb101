"""Connection hygiene: a per-peer connection limit and an idle timeout for authenticated connections."""
import itertools
import socket
import time

import pytest

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient
from kvtier.common.blockformat import encode_block
from kvtier.wire import connection as p

NS = bytes(16)
KEY = bytes([0xC1]) * 16


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("hygiene"), "--max-connections", "8",
                      "--max-connections-per-peer", "3", "--idle-timeout", "1")
    yield d
    assert d.stop() == 0, d.log_tail()


def connect(daemon, source_ip: str = "127.0.0.1", hello: bool = True) -> socket.socket:
    host, _, port = daemon.data_addr.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10, source_address=(source_ip, 0))
    if hello:
        s.sendall(p.Connection(p.Role.CLIENT).send(p.Hello(1, "hygiene-test", "")))
        (reply,) = replies(s)
        assert isinstance(reply, p.HelloReply), reply
    return s


def replies(sock, n=1):
    conn = p.Connection(p.Role.CLIENT, check_replies=False)
    out = []
    while len(out) < n:
        ev = conn.next_event()
        if ev is p.NEED_DATA:
            data = sock.recv(65536)
            conn.receive_data(data)
            continue
        if ev is p.CONNECTION_CLOSED:
            break
        out.append(ev)
    return out


def test_one_peer_cannot_take_every_connection(daemon):
    held = [connect(daemon) for _ in range(3)]
    try:
        with connect(daemon, hello=False) as extra:
            (error,) = replies(extra)
            assert error.code == p.ErrorCode.BUSY
            assert "from 127.0.0.1" in error.message and "max_connections_per_peer 3" in error.message
        with connect(daemon, source_ip="127.0.0.2") as other:  # another address still gets in
            other.sendall(p.Connection(p.Role.CLIENT).send(p.Ping(2, b"x")))
            assert replies(other) == [p.PingReply(2, b"x")]
    finally:
        for s in held:
            s.close()
        wait_connections_closed(daemon)  # the daemon lets them go on its own threads: later tests need the room


def wait_connections_closed(daemon, timeout_s: float = 30.0) -> None:
    """Until the daemon counts no open connection but the one asking (from 127.0.0.2: it takes no
    room from 127.0.0.1's per-peer quota)."""
    deadline = time.monotonic() + timeout_s
    with connect(daemon, source_ip="127.0.0.2") as s:
        conn = p.Connection(p.Role.CLIENT, check_replies=False)
        for request_id in itertools.count(2):
            s.sendall(conn.send(p.Stats(request_id)))
            (reply,) = replies(s)
            if reply.stats["server"]["open_connections"] <= 1:
                return
            assert time.monotonic() < deadline, reply.stats["server"]
            time.sleep(0.05)


def test_an_idle_authenticated_connection_is_closed_naming_the_timeout(daemon):
    with connect(daemon) as s:
        started = time.monotonic()
        (error,) = replies(s)
        waited = time.monotonic() - started
        assert error.code == p.ErrorCode.TIMEOUT and "idle_timeout" in error.message
        assert 0.9 < waited < 5
        assert s.recv(1) == b""
    with BlockClient(daemon.data_addr) as c:
        stats = c.stats()
    assert stats["server"]["idle_closed_connections"] >= 1


def test_a_pooled_client_reconnects_after_the_daemon_closed_its_idle_connection(daemon):
    block = encode_block(KEY, NS, 0, b"hygiene" * 100)
    with BlockClient(daemon.data_addr) as c:
        c.put(KEY, block)
        before = c.statistics().reconnects
        time.sleep(1.6)  # past the idle timeout: the daemon closes the pooled connection
        assert c.get(KEY)[64:] == block[64:]
        assert c.statistics().reconnects == before + 1


def test_a_busy_connection_is_not_idle(daemon):
    with connect(daemon) as s:
        conn = p.Connection(p.Role.CLIENT, check_replies=False)
        for i in range(4):  # requests every 0.5 s keep it open past the 1 s idle timeout
            time.sleep(0.5)
            s.sendall(conn.send(p.Ping(10 + i, b"y")))
            assert replies(s) == [p.PingReply(10 + i, b"y")]
