"""DataServer in-process on a real engine and real sockets: paths that need
settings the command line does not expose (a small reply payload limit)."""
import os
import socket
import threading
import time

import numpy as np
import pytest

from kvtier.client import BlockClient
from kvtier.common.blockformat import HEADER_SIZE, encode_block
from kvtier.daemon.engine import Engine, EngineConfig
from kvtier.daemon.server import DataServer
from kvtier.daemon.server.arenas import ReplyArenas
from kvtier.wire import connection as p

from test_engine import seal
from kvtier.wire.events import RemoteError

NS = b"\x0c" * 16


@pytest.fixture
def engine(tmp_path):
    cfg = EngineConfig(device_paths=tuple(str(tmp_path / f"dev{i}") for i in range(2)),
                       device_size_bytes=32 << 20, stripe_size_bytes=256 << 10, region_size_bytes=2 << 20)
    eng = Engine.open(cfg, create_if_missing=True)
    yield eng
    eng.close()


def test_gets_over_the_reply_limit_are_deferred_and_fetched_again(engine):
    server = DataServer(engine, "127.0.0.1", 0, region_size_bytes=2 << 20, payload_bytes_max=1 << 20)
    host, port = server.start()
    try:
        keys = [bytes([7]) + i.to_bytes(15, "little") for i in range(40)]
        blocks = [encode_block(k, NS, 0, os.urandom(100_000 + i)) for i, k in enumerate(keys)]  # ~4 MiB in all
        with BlockClient(f"{host}:{port}") as c:
            assert c.server_info()["limits"]["payload_bytes_max"] == 1 << 20
            assert len(c.put_many(list(zip(keys, blocks)))) == 40  # the client splits the PUT too
            got = c.get_many(keys + [b"\x00" * 16])
            assert [g[HEADER_SIZE:] for g in got[:40]] == [b[HEADER_SIZE:] for b in blocks] and got[40] is None
            assert c.statistics().frames >= 5  # 4 MiB through 1 MiB replies: several rounds
    finally:
        server.stop()
    stats = server.statistics()
    assert stats.requests["get"] >= 4 and stats.namespaces["none"].hits == 40
    assert stats.latency["get"].cumulative_counts[-1] == stats.requests["get"]
    with pytest.raises(TypeError):
        stats.requests["get"] = 0  # a frozen snapshot


def test_statistics_count_bytes_and_ops(engine):
    server = DataServer(engine, "127.0.0.1", 0, region_size_bytes=2 << 20)
    host, port = server.start()
    try:
        key = b"\x09" * 16
        block = encode_block(key, NS, 0, os.urandom(50_000))
        with BlockClient(f"{host}:{port}", pool_size=1) as c:
            c.put(key, block)
            assert c.get(key)[HEADER_SIZE:] == block[HEADER_SIZE:]
    finally:
        server.stop()  # joins the connection threads: every request is recorded
    stats = server.statistics()
    assert stats.requests["put"] == 1 and stats.requests["get"] == 1 and stats.requests["hello"] == 1
    assert stats.bytes_in > len(block) and stats.bytes_out > len(block)
    assert stats.total_connections == 1 and stats.errors == {} and stats.open_connections == 0


def test_a_get_whose_block_outgrew_its_location_locates_it_again(engine):
    """Blocks are located, then read into the reply buffer; if a block changed
    size in between (the engine refuses the too-small slot), the GET locates
    the blocks again and is answered with the block as it is now."""
    from kvtier.wire import connection as p
    from kvtier.daemon.server.handler import RequestHandler
    from kvtier.daemon.server.session import Session
    from kvtier.daemon.server.stats import ServerStatsRecorder

    keys = [bytes([3]) + i.to_bytes(15, "little") for i in range(3)]
    blocks = [encode_block(k, NS, 0, os.urandom(5000 + i)) for i, k in enumerate(keys)]
    grown = encode_block(keys[2], NS, 0, os.urandom(50_000))

    class OutgrowingEngine:
        def __init__(self, inner):
            self._inner, self.calls = inner, 0

        def locate_buffer(self, keys_buf, for_read=False):
            rows = self._inner.locate_buffer(keys_buf, for_read)
            if self.calls == 0:  # deleted and put again, larger, once it was located
                self._inner.delete_many([keys[2]])
                self._inner.put(grown)
            return rows

        def get_many_placed(self, keys, bufs, verify_payload=True, located=None):
            self.calls += 1
            return self._inner.get_many_placed(keys, bufs, verify_payload, located)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    engine.put_many(blocks)
    fake = OutgrowingEngine(engine)
    handler = RequestHandler(fake, ServerStatsRecorder(), lambda: None, 2 << 20, p.Limits(), dict)
    session = Session("test", greeted=True)
    reply, close = handler.handle(p.Get(7, (keys[0], b"\x00" * 16, keys[2])), session)
    assert fake.calls == 2 and not close and isinstance(reply, p.GetReply)
    assert [None if b is None else bytes(b)[HEADER_SIZE:] for b in reply.blocks] == \
        [blocks[0][HEADER_SIZE:], None, grown[HEADER_SIZE:]]
    handler.buffers.reply_sent(session)
    assert handler.buffers.statistics().lent == 0


def test_a_get_the_engine_keeps_refusing_is_answered_with_its_error(engine):
    """A block that outgrows its slot on every try: after GET_READ_TRIES the GET is
    answered with the engine's refusal (the connection serves on) and holds nothing."""
    from kvtier.wire import connection as p
    from kvtier.daemon.engine import EngineError
    from kvtier.daemon.server.arenas import ReplyArenas
    from kvtier.daemon.server.get_reply import GET_READ_TRIES
    from kvtier.daemon.server.handler import RequestHandler
    from kvtier.daemon.server.session import Session
    from kvtier.daemon.server.stats import ServerStatsRecorder

    class RefusingEngine:
        def __init__(self, inner):
            self._inner, self.calls = inner, 0

        def get_many_placed(self, keys, bufs, verify_payload=True, located=None):
            self.calls += 1
            raise EngineError("buffer of 4096 bytes is too small for the 8192-byte block")

        def __getattr__(self, name):
            return getattr(self._inner, name)

    key = bytes([3]) * 16
    engine.put(encode_block(key, NS, 0, os.urandom(5000)))
    fake = RefusingEngine(engine)
    arenas = ReplyArenas(budget_bytes=0)  # a transient buffer each try
    handler = RequestHandler(fake, ServerStatsRecorder(), lambda: None, 2 << 20, p.Limits(), dict, arenas)
    session = Session("test", greeted=True)
    reply, close = handler.handle(p.Get(7, (key,)), session)
    assert fake.calls == GET_READ_TRIES and not close
    assert isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.BAD_REQUEST and "too small" in reply.message
    handler.buffers.reply_sent(session)
    assert arenas.statistics().transient_bytes == 0


def test_get_reply_blocks_land_in_the_connections_buffer(engine):
    from kvtier.wire import connection as p
    from kvtier.daemon.server.arenas import GET_ARENA_BYTES_MAX
    from kvtier.daemon.server.handler import RequestHandler
    from kvtier.daemon.server.session import Session
    from kvtier.daemon.server.stats import ServerStatsRecorder

    keys = [bytes([4]) + i.to_bytes(15, "little") for i in range(4)]
    blocks = [encode_block(k, NS, 0, os.urandom(300_000 + 999 * i)) for i, k in enumerate(keys)]
    engine.put_many(blocks[:2])
    seal(engine)  # two on flash (sealed), two in the open region
    engine.put_many(blocks[2:])
    handler = RequestHandler(engine, ServerStatsRecorder(), lambda: None, 2 << 20, p.Limits(), dict)
    session = Session("test", greeted=True)
    for _ in range(2):  # the second reply reuses the first one's buffer
        reply, _ = handler.handle(p.Get(1, tuple(keys) + (b"\x01" * 16,)), session)
        assert [bytes(b)[HEADER_SIZE:] for b in reply.blocks[:4]] == [b[HEADER_SIZE:] for b in blocks]
        assert reply.blocks[4] is None
        assert all(b.obj is session.get_arena.obj for b in reply.blocks[:4])
        # the sealed blocks were read in place: each at its own offset within a page, not copied to one
        locs = engine.locate_many(keys[:2])
        assert [np.frombuffer(b, np.uint8).ctypes.data % 4096 for b in reply.blocks[:2]] == \
            [loc.logical_offset % 4096 for loc in locs] and any(loc.logical_offset % 4096 for loc in locs)
    assert session.get_arena.nbytes == GET_ARENA_BYTES_MAX


def test_get_reply_arenas_are_shared_within_one_daemon_wide_budget(engine):
    """Two arenas allowed: a third GET in flight is read into a buffer of its own,
    and an arena given back after its reply is sent is lent again, not added."""
    from kvtier.wire import connection as p
    from kvtier.daemon.server.arenas import GET_ARENA_BYTES_MAX, ReplyArenas
    from kvtier.daemon.server.handler import RequestHandler
    from kvtier.daemon.server.session import Session
    from kvtier.daemon.server.stats import ServerStatsRecorder

    keys = [bytes([5]) + i.to_bytes(15, "little") for i in range(3)]
    blocks = [encode_block(k, NS, 0, os.urandom(70_000 + i)) for i, k in enumerate(keys)]
    engine.put_many(blocks)
    arenas = ReplyArenas(budget_bytes=2 * GET_ARENA_BYTES_MAX)
    handler = RequestHandler(engine, ServerStatsRecorder(), lambda: None, 2 << 20, p.Limits(), dict, arenas)
    sessions = [Session(f"peer{i}", greeted=True) for i in range(3)]
    replies = [handler.handle(p.Get(1, tuple(keys)), s)[0] for s in sessions]  # none sent yet: all in flight
    for reply in replies:
        assert [bytes(b)[HEADER_SIZE:] for b in reply.blocks] == [b[HEADER_SIZE:] for b in blocks]
    assert [s.get_arena is not None for s in sessions] == [True, True, False]
    assert all(b.obj is sessions[0].get_arena.obj for b in replies[0].blocks)
    assert not any(isinstance(b, memoryview) and b.obj in (sessions[0].get_arena.obj, sessions[1].get_arena.obj)
                   for b in replies[2].blocks)  # a buffer of its own, not an arena
    stats = arenas.statistics()
    assert (stats.created, stats.lent, stats.refused) == (2, 2, 1)
    first = sessions[0].get_arena
    handler.buffers.reply_sent(sessions[0])
    assert sessions[0].get_arena is None
    reply, _ = handler.handle(p.Get(2, tuple(keys)), sessions[2])
    assert sessions[2].get_arena is first and reply.blocks[0].obj is first.obj
    for s in sessions:
        handler.buffers.reply_sent(s)
    stats = arenas.statistics()
    assert (stats.created, stats.lent, stats.refused) == (2, 0, 1)


def test_idle_connections_hold_no_arena_and_busy_ones_stay_in_budget(engine):
    import threading

    from kvtier.daemon.server.arenas import GET_ARENA_BYTES_MAX, ReplyArenas

    keys = [bytes([6]) + i.to_bytes(15, "little") for i in range(8)]
    blocks = [encode_block(k, NS, 0, os.urandom(150_000 + i)) for i, k in enumerate(keys)]
    engine.put_many(blocks)
    server = DataServer(engine, "127.0.0.1", 0, region_size_bytes=2 << 20,
                        reply_arenas=ReplyArenas(budget_bytes=2 * GET_ARENA_BYTES_MAX))
    host, port = server.start()
    clients = [BlockClient(f"{host}:{port}", pool_size=1) for _ in range(8)]
    errors = []

    def reader(c, tag):
        try:
            mine = [bytes([7, tag]) + i.to_bytes(14, "little") for i in range(4)]
            c.put_many([(k, encode_block(k, NS, 0, os.urandom(90_000))) for k in mine])  # payload in an arena
            for _ in range(10):
                got = c.get_many(keys)
                assert [g[HEADER_SIZE:] for g in got] == [b[HEADER_SIZE:] for b in blocks]
            assert c.lookup(mine) == 4
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    try:
        threads = [threading.Thread(target=reader, args=(c, tag)) for tag, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        stats = server.reply_arena_statistics()  # 8 connections open, all idle now
        assert stats.created <= 2 and stats.lent == 0, stats
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_requests_without_an_arena_stay_within_the_transient_budget(engine):
    """No arenas at all and 2.5 MiB for buffers outside them: while other requests hold 2 MiB
    of it a 1 MiB PUT waits for room, and is refused BUSY before its payload is received
    when none comes back in time (the connection serves on), or goes through once the others
    are done; a 3 MiB frame, more than the whole budget, is TOO_LARGE; GETs through the
    buffer of their own fit; every byte reserved is given back."""
    import threading

    from kvtier.client import RemoteError
    from kvtier.wire import connection as p
    arenas = ReplyArenas(budget_bytes=0, transient_budget_bytes=5 << 19, transient_wait_s=30.0)
    server = DataServer(engine, "127.0.0.1", 0, region_size_bytes=2 << 20, reply_arenas=arenas)
    host, port = server.start()
    keys = [bytes([9]) + i.to_bytes(15, "little") for i in range(3)]
    blocks = [encode_block(k, NS, 0, os.urandom(1 << 20)) for k in keys]
    try:
        with BlockClient(f"{host}:{port}", pool_size=1) as c:
            c.put(keys[0], blocks[0])
            assert arenas.reserve_transient(2 << 20)  # other requests in flight (after the PUT's reply_sent)
            arenas.transient_wait_s = 0.2
            with pytest.raises(RemoteError) as busy:
                c.put(keys[1], blocks[1])
            assert busy.value.code == p.ErrorCode.BUSY and "stayed spent for 0.2 s" in str(busy.value)
            assert c.ping() > 0 and c.lookup(keys[1:2]) == 0  # same connection; nothing of the frame stored
            arenas.transient_wait_s = 30.0  # however late the timer thread runs on a loaded machine
            threading.Timer(0.05, arenas.release_transient, args=(2 << 20,)).start()  # the others finish
            c.put(keys[1], blocks[1])  # waits for that room, then is stored
            with pytest.raises(RemoteError) as too_large:
                c.put_many(list(zip(keys, blocks)))  # one frame of 3 MiB
            assert too_large.value.code == p.ErrorCode.TOO_LARGE and "whole budget" in str(too_large.value)
            assert c.lookup(keys) == 2
            got = c.get_many(keys[:2])  # no arena: 2 MiB reserved for a buffer of its own, then given back
            assert [g[HEADER_SIZE:] for g in got] == [b[HEADER_SIZE:] for b in blocks[:2]]
        server.stop()  # its connection threads are done: every reply_sent has run
        stats = arenas.statistics()
        assert (stats.created, stats.transient_bytes, stats.transient_refused) == (0, 0, 1)
        assert stats.transient_waits >= 2  # the refused PUT and the one that got through (and any racing reply_sent)
    finally:
        server.stop()


def test_a_get_without_an_arena_reads_what_one_arena_holds_and_reserves_once(engine):
    """With every arena lent, a GET reads a reply's worth at a time into a buffer of its own
    (not 64 blocks to send 4); a block larger than an arena whose read is refused (it grew)
    gives its first reservation back before the second is made."""
    from kvtier.wire import connection as p
    from kvtier.daemon.engine import EngineError
    from kvtier.daemon.server.arenas import ReplyArenas
    from kvtier.daemon.server.handler import RequestHandler
    from kvtier.daemon.server.session import Session
    from kvtier.daemon.server.stats import ServerStatsRecorder

    class Counting:
        def __init__(self, inner, fail_placed=False):
            self._inner, self.read_keys, self.fail_placed = inner, 0, fail_placed

        def get_many(self, keys):
            self.read_keys += len(keys)
            return self._inner.get_many(keys)

        def get_many_placed(self, keys, bufs, verify_payload=True, located=None):
            self.read_keys += len(keys)
            if self.fail_placed:
                self.fail_placed = False
                raise EngineError("the block grew since it was located")
            return self._inner.get_many_placed(keys, bufs, verify_payload, located)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    keys = [bytes([10]) + i.to_bytes(15, "little") for i in range(40)]
    blocks = [encode_block(k, NS, 0, os.urandom(250_000)) for k in keys]
    engine.put_many(blocks)
    counting = Counting(engine)
    arenas = ReplyArenas(arena_bytes=1 << 20, budget_bytes=0)
    handler = RequestHandler(counting, ServerStatsRecorder(), lambda: None, 2 << 20, p.Limits(), dict, arenas)
    session, got, asked = Session("test", greeted=True), {}, list(range(40))
    while asked:
        reply, _ = handler.handle(p.Get(1, tuple(keys[i] for i in asked)), session)
        handler.buffers.reply_sent(session)
        got.update({i: bytes(b) for i, b in zip(asked, reply.blocks) if b is not p.DEFERRED})
        asked = [i for i, b in zip(asked, reply.blocks) if b is p.DEFERRED]
    assert [got[i][HEADER_SIZE:] for i in range(40)] == [b[HEADER_SIZE:] for b in blocks]
    assert counting.read_keys <= 40 + 10, counting.read_keys  # a few re-reads at chunk edges, not 64 per round
    assert arenas.statistics().transient_bytes == 0

    big_key = bytes([11]) * 16
    engine.put(encode_block(big_key, NS, 0, os.urandom(1_500_000)))  # larger than an arena: a buffer of its own
    failing = Counting(engine, fail_placed=True)
    tight = ReplyArenas(arena_bytes=1 << 20, transient_budget_bytes=2 << 20)
    handler = RequestHandler(failing, ServerStatsRecorder(), lambda: None, 2 << 20, p.Limits(), dict, tight)
    reply, _ = handler.handle(p.Get(2, (big_key,)), session)
    assert isinstance(reply, p.GetReply) and len(reply.blocks[0]) == 1_500_000 + HEADER_SIZE
    handler.buffers.reply_sent(session)
    stats = tight.statistics()
    assert (stats.transient_bytes, stats.transient_refused) == (0, 0)


# -- PUTs received straight into the open region ------------------------------
def in_place_server(engine):
    """A server whose arenas are smaller than the PUTs below: they start a region of their own."""
    server = DataServer(engine, "127.0.0.1", 0, region_size_bytes=2 << 20,
                        reply_arenas=ReplyArenas(arena_bytes=64 << 10, budget_bytes=1 << 20))
    host, port = server.start()
    return server, f"{host}:{port}"


def test_a_put_lands_in_the_open_region_and_a_bad_crc_there_stores_nothing(engine):
    server, addr = in_place_server(engine)
    try:
        keys = [bytes([9]) + i.to_bytes(15, "little") for i in range(3)]
        blocks = [encode_block(k, NS, 0, os.urandom(300_000)) for k in keys]
        bad = bytearray(blocks[1])
        bad[HEADER_SIZE + 7] ^= 1
        with BlockClient(addr) as c:
            with pytest.raises(RemoteError, match="CRC") as info:
                c.put_many([(keys[0], blocks[0]), (keys[1], bytes(bad))], durable=True)
            assert info.value.code == p.ErrorCode.BAD_BLOCK
            assert c.lookup(keys[:1]) == 0 and engine.statistics().puts == 0  # nothing of the frame
            c.put_many(list(zip(keys, blocks)), durable=True)
            assert [g[HEADER_SIZE:] for g in c.get_many(keys)] == [b[HEADER_SIZE:] for b in blocks]
        assert engine.statistics().puts_received_in_place == 3
    finally:
        server.stop()


def test_a_connection_dropped_mid_payload_stores_nothing_and_frees_the_room(engine):
    server, addr = in_place_server(engine)
    try:
        key = b"\x0a" * 16
        block = encode_block(key, NS, 0, os.urandom(500_000))
        host, _, port = addr.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            conn = p.Connection(p.Role.CLIENT)
            s.sendall(conn.send(p.Hello(1, "drop-test")))
            assert s.recv(65536)  # the HELLO reply
            wire = b"".join(bytes(part) for part in conn.send_parts(p.Put(2, (key,), (block,), True)))
            s.sendall(wire[:len(wire) - 200_000])  # the header, the meta and part of the block: then gone
        with BlockClient(addr) as c:
            assert c.lookup([key]) == 0
            c.put(key, block, durable=True)  # waits for the dropped one's reservation to be aborted
            assert c.get(key)[HEADER_SIZE:] == block[HEADER_SIZE:]
        assert engine.statistics().puts_received_in_place == 1
    finally:
        server.stop()


def _next_event(s: socket.socket, conn: p.Connection):
    while (event := conn.next_event()) is p.NEED_DATA:
        conn.receive_data(s.recv(65536))
    return event


def _greeted(addr: str, name: str) -> tuple[socket.socket, p.Connection]:
    host, _, port = addr.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    conn = p.Connection(p.Role.CLIENT)
    s.sendall(conn.send(p.Hello(1, name)))
    assert isinstance(_next_event(s, conn), p.HelloReply)
    return s, conn


def test_a_put_stalled_mid_payload_in_the_open_region_is_closed_soon_and_others_store(engine, monkeypatch):
    """Holding the open region, a stalled PUT makes every other writer wait: its frame's deadline is
    RESERVED_PAYLOAD_STALL_S plus its payload's time, not the frame timeout, then ERROR TIMEOUT."""
    from kvtier.daemon.server import connection_loop
    monkeypatch.setattr(connection_loop, "RESERVED_PAYLOAD_STALL_S", 0.5)
    server, addr = in_place_server(engine)  # frame timeout: the default 30 s
    try:
        key, other = b"\x0b" * 16, b"\x0c" * 16
        block = encode_block(key, NS, 0, os.urandom(500_000))
        s, conn = _greeted(addr, "stall-test")
        with s:
            wire = b"".join(bytes(part) for part in conn.send_parts(p.Put(2, (key,), (block,), True)))
            s.sendall(wire[:len(wire) - 200_000])  # the header, the meta and part of the block: then nothing
            started = time.monotonic()
            with BlockClient(addr) as c:
                c.put(other, encode_block(other, NS, 0, os.urandom(1000)), durable=True)
                assert time.monotonic() - started < 10  # not the 30 s frame timeout
                assert c.lookup([key]) == 0 and c.lookup([other]) == 1
            error = _next_event(s, conn)
            assert isinstance(error, p.ErrorReply) and error.code == p.ErrorCode.TIMEOUT, error
            assert "did not arrive within" in error.message and "open region" in error.message
    finally:
        server.stop()


def trickle(s: socket.socket, data: bytes, every_s: float, stop: threading.Event) -> threading.Thread:
    """Send ``data`` a byte every ``every_s`` (under any stall bound) until stopped."""
    def run():
        for i in range(len(data)):
            if stop.wait(every_s):
                return
            try:
                s.sendall(data[i:i + 1])
            except OSError:
                return
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_put_trickling_into_the_open_region_is_cut_off_by_its_deadline_and_others_store(engine, monkeypatch):
    """A byte every 0.2 s: the payload must be in within RESERVED_PAYLOAD_STALL_S plus its size at
    RESERVED_PAYLOAD_RATE_MIN_BYTES_S however its bytes trickle; then every writer goes on."""
    from kvtier.daemon.server import connection_loop
    monkeypatch.setattr(connection_loop, "RESERVED_PAYLOAD_STALL_S", 0.5)
    monkeypatch.setattr(connection_loop, "RESERVED_PAYLOAD_RATE_MIN_BYTES_S", 1 << 20)  # 500 KB: about 1 s in all
    server, addr = in_place_server(engine)
    stop = threading.Event()
    try:
        key, other = b"\x1b" * 16, b"\x1c" * 16
        block = encode_block(key, NS, 0, os.urandom(500_000))
        s, conn = _greeted(addr, "trickle-test")
        with s:
            wire = b"".join(bytes(part) for part in conn.send_parts(p.Put(2, (key,), (block,), True)))
            s.sendall(wire[:len(wire) - len(block) + 100])  # the header, the meta and the block's head
            trickle(s, wire[len(wire) - len(block) + 100:], 0.2, stop)
            started = time.monotonic()
            with BlockClient(addr) as c:
                c.put(other, encode_block(other, NS, 0, os.urandom(1000)), durable=True)
                c.delete_many([other])
                assert time.monotonic() - started < 5
                assert c.lookup([key]) == 0
            error = _next_event(s, conn)
            assert isinstance(error, p.ErrorReply) and error.code == p.ErrorCode.TIMEOUT, error
            assert "did not arrive within" in error.message and "open region" in error.message
    finally:
        stop.set()
        server.stop()


def test_a_trickling_payload_gives_its_transient_room_back_once_past_its_deadline(engine, monkeypatch):
    from kvtier.daemon.server import connection_loop
    monkeypatch.setattr(connection_loop, "PAYLOAD_RATE_MIN_BYTES_S", 4 << 20)  # 3.2 MB: 0.5 + 0.8 s
    server = DataServer(engine, "127.0.0.1", 0, region_size_bytes=2 << 20, frame_timeout_s=0.5,
                        reply_arenas=ReplyArenas(arena_bytes=64 << 10, budget_bytes=1 << 20,
                                                 transient_budget_bytes=4 << 20, transient_wait_s=0.2))
    host, port = server.start()
    addr = f"{host}:{port}"
    stop = threading.Event()
    try:
        def frame(tag: int) -> list[tuple[bytes, bytes]]:  # larger than a region: not received in place
            keys = [bytes([tag, i]) * 8 for i in range(4)]
            return [(k, encode_block(k, NS, 0, os.urandom(800_000))) for k in keys]
        items = frame(0x2a)
        s, conn = _greeted(addr, "trickle-transient")
        with s:
            wire = b"".join(bytes(part) for part in conn.send_parts(
                p.Put(2, tuple(k for k, _ in items), tuple(b for _, b in items))))
            head = len(wire) - sum(len(b) for _, b in items)
            s.sendall(wire[:head + 100])
            trickle(s, wire[head + 100:], 0.2, stop)
            time.sleep(2.0)  # past its deadline, though no receive ever waited 0.5 s
            with BlockClient(addr) as c:
                assert c.put_many(frame(0x2b))  # the room is free again (not BUSY)
            error = _next_event(s, conn)
            assert isinstance(error, p.ErrorReply) and error.code == p.ErrorCode.TIMEOUT, error
            assert "3200" in error.message and "did not arrive within" in error.message
    finally:
        stop.set()
        server.stop()


def test_a_put_into_the_open_region_that_keeps_sending_is_not_cut_off(engine, monkeypatch):
    from kvtier.daemon.server import connection_loop
    monkeypatch.setattr(connection_loop, "RESERVED_PAYLOAD_STALL_S", 0.3)
    monkeypatch.setattr(connection_loop, "RESERVED_PAYLOAD_RATE_MIN_BYTES_S", 1 << 20)  # below the 1 MB/s it sends
    server, addr = in_place_server(engine)
    try:
        key = b"\x0d" * 16
        block = encode_block(key, NS, 0, os.urandom(500_000))
        s, conn = _greeted(addr, "slow-test")
        with s:
            wire = b"".join(bytes(part) for part in conn.send_parts(p.Put(2, (key,), (block,), True)))
            for start in range(0, len(wire), 100_000):  # within its deadline (0.3 s + 0.5 MB at 1 MiB/s)
                s.sendall(wire[start:start + 100_000])
                time.sleep(0.1)
            reply = _next_event(s, conn)
            assert isinstance(reply, p.PutReply), reply
            time.sleep(0.5)  # idle between requests: no frame deadline then
            s.sendall(conn.send(p.Lookup(3, (key,))))
            reply = _next_event(s, conn)
            assert isinstance(reply, p.LookupReply) and reply.leading == 1, reply
        assert engine.statistics().puts_received_in_place == 1
    finally:
        server.stop()


def test_a_put_to_a_failed_engine_is_answered_shutting_down_not_dropped(engine):
    server, addr = in_place_server(engine)
    try:
        key = b"\x1d" * 16
        engine.fail("a test failed it")
        with BlockClient(addr) as c:
            with pytest.raises(RemoteError) as err:
                c.put(key, encode_block(key, NS, 0, os.urandom(300_000)))
        assert err.value.code == p.ErrorCode.SHUTTING_DOWN, err.value
    finally:
        server.stop()
