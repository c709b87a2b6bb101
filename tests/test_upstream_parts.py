"""The pull-through's parts without an upstream daemon: the WANT_ORIGIN wire encoding (sans-IO,
fed byte by byte), the negative cache (a fake clock), the store queue (a real in-memory
engine), the upstream client against a real local daemon, and the config keys."""
from __future__ import annotations

import os
import socket
import time

import pytest

from daemon_proc import start_kvtierd
from test_engine import mem_engine, same_block
from kvtier.common.blockformat import encode_block
from kvtier.daemon.config import ConfigError, DaemonConfig, config_from_args
from kvtier.daemon.engine import EngineError
from kvtier.daemon.upstream import StaticTarget, UpstreamAuthError, UpstreamClient, UpstreamTimeout
from kvtier.daemon.upstream.negative_cache import NegativeCache
from kvtier.daemon.upstream.store_queue import StoreQueue
from kvtier.wire import connection as p
from kvtier.wire.frames import FLAG_WANT_ORIGIN

NS = b"n" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def feed_byte_by_byte(conn: p.Connection, wire: bytes):
    for i in range(len(wire)):
        conn.receive_data(wire[i:i + 1])
        event = conn.next_event()
        if event is not p.NEED_DATA:
            assert i == len(wire) - 1, "a whole message before its last byte"
            return event
    raise AssertionError("no message")


# -- the wire: FLAG_WANT_ORIGIN ---------------------------------------------------
def test_get_with_origins_round_trips_byte_by_byte():
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    request = feed_byte_by_byte(server, client.send(p.Get(0, (key(1), key(2), key(3)), NS, want_origin=True)))
    assert request.want_origin and request.keys == (key(1), key(2), key(3))
    blocks = (b"x" * 70, None, b"y" * 80)
    wire = server.send(p.GetReply(request.request_id, blocks, bytes([1, 0, 0])))
    assert wire[6] & FLAG_WANT_ORIGIN
    reply = feed_byte_by_byte(client, wire)
    assert [None if b is None else bytes(b) for b in reply.blocks] == list(blocks)
    assert reply.origins == bytes([1, 0, 0])


def test_lookup_with_origins_has_one_byte_per_leading_key():
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    request = feed_byte_by_byte(server, client.send(p.Lookup(0, tuple(key(i) for i in range(4)), False, NS,
                                                             want_origin=True)))
    assert request.want_origin
    reply = feed_byte_by_byte(client, server.send(p.LookupReply(request.request_id, 3, None, bytes([0, 0, 1]))))
    assert (reply.leading, reply.origins) == (3, bytes([0, 0, 1]))


def test_a_reply_with_origins_nobody_asked_for_breaks_the_connection():
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    request = feed_byte_by_byte(server, client.send(p.Get(0, (key(1),), NS)))
    client.receive_data(server.send(p.GetReply(request.request_id, (None,), b"\x00")))
    with pytest.raises(p.ProtocolError, match="carries the origins the request did not ask for"):
        client.next_event()


def test_a_reply_without_the_origins_asked_for_breaks_the_connection():
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    request = feed_byte_by_byte(server, client.send(p.Get(0, (key(1),), NS, want_origin=True)))
    client.receive_data(server.send(p.GetReply(request.request_id, (None,))))
    with pytest.raises(p.ProtocolError, match="lacks the origins the request asked for"):
        client.next_event()


def test_an_origin_byte_other_than_0_or_1_is_refused():
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    request = feed_byte_by_byte(server, client.send(p.Get(0, (key(1),), NS, want_origin=True)))
    client.receive_data(server.send(p.GetReply(request.request_id, (None,), b"\x07")))
    with pytest.raises(p.ProtocolError, match="origin bytes other than 0"):
        client.next_event()


def test_origins_must_match_the_items():
    with pytest.raises(ValueError, match="2 origin bytes for 1 GET reply items"):
        p.Connection(p.Role.SERVER).send(p.GetReply(1, (None,), b"\x00\x00"))
    with pytest.raises(ValueError, match="1 origin bytes for 2 LOOKUP reply leading keys"):
        p.Connection(p.Role.SERVER).send(p.LookupReply(1, 2, None, b"\x00"))


def test_a_daemon_answers_want_origin_even_without_an_upstream(tmp_path):
    daemon = start_kvtierd(tmp_path)
    try:
        from kvtier.client import BlockClient
        block = encode_block(key(5), NS, 0, b"z" * 100)
        with BlockClient(daemon.data_addr) as c:
            c.put_many([(key(5), block)], ns_id=NS)
            assert not c.has_upstream
            origins: list = []
            assert c.get_many([key(5), key(6)], ns_id=NS, origins=origins)[1] is None
            assert origins == [False, False]
        up = UpstreamClient(daemon.data_addr, None, timeout_s=2.0)
        try:  # the daemon's own upstream client, speaking the flag on a raw channel
            got = up.get_many([key(5), key(6)], NS)
            assert got.corrupt == 0 and got.blocks[1] is None and bytes(got.blocks[0][64:]) == block[64:]
            assert p.FEATURE_UPSTREAM not in up.features()
        finally:
            up.close()
    finally:
        daemon.stop()


# -- the negative cache -----------------------------------------------------------
def test_negative_cache_expires_after_its_ttl():
    cache = NegativeCache(ttl_s=2.0, entries_max=8)
    cache.add(NS, [key(1), key(2)], now_s=100.0)
    assert cache.absent(NS, [key(1), key(2), key(3)], now_s=101.9) == [True, True, False]
    assert cache.absent(b"m" * 16, [key(1)], now_s=101.0) == [False]  # per namespace
    assert cache.absent(NS, [key(1)], now_s=102.0) == [False]
    assert len(cache) == 0


def test_negative_cache_is_bounded_oldest_first():
    cache = NegativeCache(ttl_s=10.0, entries_max=3)
    for i in range(5):
        cache.add(NS, [key(i)], now_s=float(i))
    assert cache.absent(NS, [key(i) for i in range(5)], now_s=5.0) == [False, False, True, True, True]
    cache.forget(NS, [key(3)])
    assert cache.absent(NS, [key(3), key(4)], now_s=5.0) == [False, True]


def test_negative_cache_refuses_nonsense_bounds():
    with pytest.raises(ValueError, match="ttl_s > 0"):
        NegativeCache(ttl_s=0)


# -- the rank walk (owners asked in rendezvous order) -------------------------------
def test_rank_walk_moves_what_a_rank_left_open_to_the_next_owner():
    from kvtier.daemon.upstream.rank_walk import Answer, RankWalk

    walk = RankWalk(count=3, ranks=2)
    assert walk.asks({"A": [0, 2], "B": [1]}) == {"A": [0, 2], "B": [1]}
    walk.answered([0, 2], [Answer.FOUND, Answer.LACKED])
    walk.answered([1], None)  # B failed
    walk.end_rank()
    assert (walk.open, walk.fallbacks, walk.done) == ([1, 2], 2, False)
    assert walk.asks({"C": [0, 2], "A": [1]}) == {"C": [2], "A": [1]}  # k0 was found: not asked again
    walk.answered([2], [Answer.FOUND])
    walk.answered([1], [Answer.LACKED])
    walk.end_rank()
    assert (walk.open, walk.fallbacks, walk.fallback_hits, walk.done) == ([1], 2, 1, True)
    assert walk.absent() == []  # k1: lacked at A, but B never answered for it


def test_rank_walk_calls_absent_only_what_every_owner_lacked():
    from kvtier.daemon.upstream.rank_walk import Answer, RankWalk

    walk = RankWalk(count=2, ranks=2)
    walk.answered([0, 1], [Answer.LACKED, Answer.UNKNOWN])  # k1: a corrupt copy
    assert walk.absent() == []  # not before every rank was asked
    walk.end_rank()
    walk.answered([0, 1], [Answer.LACKED, Answer.LACKED])
    walk.end_rank()
    assert (walk.open, walk.absent()) == ([0, 1], [0])
    nobody = RankWalk(count=2, ranks=0)  # no member to ask: nothing is known absent
    assert (nobody.done, nobody.open, nobody.absent()) == (True, [0, 1], [])


def test_lookup_answers_stop_at_the_first_miss():
    from kvtier.daemon.upstream.rank_walk import Answer, lookup_answers

    assert lookup_answers(4, 1) == [Answer.FOUND, Answer.LACKED, Answer.UNKNOWN, Answer.UNKNOWN]
    assert lookup_answers(2, 2) == [Answer.FOUND, Answer.FOUND]
    assert lookup_answers(1, 0) == [Answer.LACKED]


# -- the store queue --------------------------------------------------------------
def blocks_of(count: int, size: int = 1000):
    return [(key(i), memoryview(encode_block(key(i), NS, 0, os.urandom(size)))) for i in range(count)]


def test_store_queue_stores_behind_and_serves_what_waits():
    engine, _, _ = mem_engine()
    queue = StoreQueue(engine.put_many)
    try:
        items = blocks_of(5)
        assert queue.offer(items) == 0
        for (k, block), waiting in zip(items, queue.pending([k for k, _ in items])):
            assert waiting is None or bytes(waiting) == bytes(block)
        assert queue.wait_idle(5.0)
        for k, block in items:
            assert same_block(engine.get(k), bytes(block))
        stats = queue.statistics()
        assert (stats.queued_blocks, stats.stored_blocks, stats.dropped_blocks, stats.queue_bytes) == (5, 5, 0, 0)
        assert queue.pending([key(0)]) == [None]
    finally:
        queue.close()
        engine.close()


def test_store_queue_drops_and_counts_what_does_not_fit():
    engine, _, _ = mem_engine()
    items = blocks_of(4, 1000)
    queue = StoreQueue(engine.put_many, bytes_max=2 * items[0][1].nbytes)
    try:
        engine_lock = engine._lock  # hold the engine so the worker cannot drain meanwhile
        with engine_lock:
            dropped = queue.offer(items)
        assert dropped >= 1
        assert queue.wait_idle(5.0)
        stats = queue.statistics()
        assert stats.dropped_blocks == dropped and stats.stored_blocks == 4 - dropped
    finally:
        queue.close()
        engine.close()


def test_store_queue_counts_what_the_engine_refuses():
    engine, _, _ = mem_engine()
    engine.close()
    queue = StoreQueue(engine.put_many)
    try:
        queue.offer(blocks_of(2))
        assert queue.wait_idle(5.0)
        assert queue.statistics().failed_blocks == 2
        with pytest.raises(EngineError):
            engine.put_many([bytes(blocks_of(1)[0][1])])
    finally:
        queue.close()


# -- the upstream client against a real daemon --------------------------------------
def test_upstream_client_refused_token_and_timeouts(tmp_path):
    (tmp_path / "token").write_text("secret\n")
    daemon = start_kvtierd(tmp_path / "d", "--token-file", str(tmp_path / "token"))
    try:
        wrong = UpstreamClient(daemon.data_addr, "nope", timeout_s=2.0)
        with pytest.raises(UpstreamAuthError, match="refused our token"):
            wrong.lookup([key(1)], NS)
        right = StaticTarget(daemon.data_addr, "secret", 2.0)
        block = encode_block(key(1), NS, 0, b"q" * 500)
        assert right.client.put_many([block], NS) and right.client.pin([key(1)], NS) == [True]
        assert right.client.pin([key(1), key(2)], NS, ttl_s=30.0) == [True, False]  # a soft pin
        assert right.client.lookup([key(1), key(2)], NS) == 1
        right.client.get_many([key(1)], NS)
        right.client.get_many([key(1)], NS)
        assert right.client.connections_made == 1  # pooled
        right.close()
    finally:
        daemon.kill()
    with socket.create_server(("127.0.0.1", 0)) as mute:  # the kernel accepts; nobody ever answers HELLO
        silent = UpstreamClient(f"127.0.0.1:{mute.getsockname()[1]}", None, timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            silent.get_many([key(1)], NS)
        assert 0.3 <= time.monotonic() - started < 1.0


# -- config -----------------------------------------------------------------------
def test_upstream_flags_and_toml(tmp_path):
    cfg = config_from_args(["--upstream", "10.0.0.9:7410", "--upstream-timeout-ms", "250"])
    assert (cfg.upstream, cfg.upstream_timeout_ms, cfg.upstream_token_file) == ("10.0.0.9:7410", 250, None)
    toml = tmp_path / "k.toml"
    toml.write_text('upstream = "etcd://127.0.0.1:2379/region"\nupstream_token_file = "/t"\n'
                    'upstream_timeout_ms = 900\n')
    cfg = config_from_args(["--config", str(toml)])
    assert (cfg.upstream, cfg.upstream_token_file, cfg.upstream_timeout_ms) == \
        ("etcd://127.0.0.1:2379/region", "/t", 900)
    assert cfg.redacted()["upstream_token_file"] == "<set>"
    with pytest.raises(ConfigError, match="upstream_timeout_ms: 0 is outside"):
        DaemonConfig(upstream="a:1", upstream_timeout_ms=0)
    with pytest.raises(ConfigError, match="upstream_token_file: only makes sense with upstream"):
        DaemonConfig(upstream_token_file="/t")
    with pytest.raises(ConfigError, match="upstream"):
        DaemonConfig(upstream="no-port-here")


# -- PullThrough over a real upstream daemon and an in-memory engine ----------------
class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_pull_through_defers_what_does_not_fit_the_reply_and_stores_it_all(tmp_path):
    from kvtier.daemon.upstream import PullThrough

    region = start_kvtierd(tmp_path / "region")
    engine, _, _ = mem_engine()
    pull = PullThrough(StaticTarget(region.data_addr, None, 2.0), engine)
    try:
        from kvtier.client import BlockClient
        blocks = [encode_block(key(i), NS, 0, os.urandom(3000)) for i in range(4)]
        with BlockClient(region.data_addr) as c:
            c.put_many([(key(i), b) for i, b in enumerate(blocks)], ns_id=NS)
        msg = p.Get(7, tuple(key(i) for i in range(4)), NS, want_origin=True)
        reply = pull.fill(msg, p.GetReply(7, (None,) * 4), payload_bytes_max=2 * len(blocks[0]))
        assert [b is p.DEFERRED for b in reply.blocks] == [False, False, True, True]
        assert [bytes(b[64:]) for b in reply.blocks[:2]] == [b[64:] for b in blocks[:2]]
        assert reply.origins == bytes([1, 1, 0, 0])
        assert pull.store.wait_idle(5.0)
        assert all(same_block(engine.get(key(i)), b) for i, b in enumerate(blocks))  # all four stored
        leading, origins = pull.lookup([key(i) for i in range(6)], NS, local=4)
        assert (leading, origins) == (4, bytes(4))  # the region lacks key 4: negative-cached now
        assert pull.negative.absent(NS, [key(4), key(5)], time.monotonic()) == [True, False]
    finally:
        pull.close()
        engine.close()
        region.kill()


def test_pull_through_backs_off_a_dead_upstream(tmp_path):
    from kvtier.daemon.upstream import PullThrough
    from kvtier.daemon.upstream.pull_through import DOWN_BACKOFF_S

    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        dead = f"127.0.0.1:{placeholder.getsockname()[1]}"  # closed when the block ends: refused after
    engine, _, _ = mem_engine()
    clock = FakeClock()
    pull = PullThrough(StaticTarget(dead, None, 0.5), engine, clock=clock)
    try:
        msg = p.Get(1, (key(1),), NS)
        assert pull.fill(msg, p.GetReply(1, (None,)), 1 << 20).blocks == (None,)
        assert pull.fill(msg, p.GetReply(1, (None,)), 1 << 20).blocks == (None,)
        stats = pull.statistics()
        assert (stats.failures["unavailable"], stats.skipped_down, stats.requests) == (1, 1, 1)
        clock.now_s += DOWN_BACKOFF_S
        pull.fill(msg, p.GetReply(1, (None,)), 1 << 20)
        assert pull.statistics().failures["unavailable"] == 2  # asked again after the backoff
        assert pull.statistics().negative_entries == 0  # a failure is not "absent"
    finally:
        pull.close()
        engine.close()
