"""A real kvtierd refuses a PUT that names a key twice and a frame with a flag its op does not take:
a clear error, nothing stored, and the connection and every other client served on."""
import os

import pytest

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient, RemoteError
from kvtier.common.blockformat import HEADER_SIZE, encode_block
from kvtier.wire import connection as p
from kvtier.wire import events as m
from kvtier.wire import frames as f

from test_bad_input import frame, raw, read_replies

NS = b"\x0d" * 16
KEEP = bytes([0xDD]) * 16
KEEP_BLOCK = encode_block(KEEP, NS, 0, os.urandom(3000))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("rules"))
    with BlockClient(d.data_addr) as c:
        c.put(KEEP, KEEP_BLOCK)
    yield d
    assert d.stop() == 0, d.log_tail()


def key(i: int) -> bytes:
    return bytes([0x70]) + i.to_bytes(15, "little")


def put_frame(items, rid: int, flags: int = 0) -> bytes:
    meta = b"".join(f.PUT_ITEM.pack(k, len(b)) for k, b in items)
    return frame(p.Op.PUT, rid=rid, count=len(items), meta=meta, payload=b"".join(b for _, b in items), flags=flags)


def assert_serving_others(daemon):
    with BlockClient(daemon.data_addr) as c:
        assert c.get(KEEP)[HEADER_SIZE:] == KEEP_BLOCK[HEADER_SIZE:]


def test_a_put_naming_a_key_twice_is_refused_and_stores_nothing(daemon):
    twice, other = key(1), key(2)
    items = [(twice, encode_block(twice, NS, 0, b"first" * 100)), (other, encode_block(other, NS, 0, b"o" * 300)),
             (twice, encode_block(twice, NS, 0, b"second" * 100))]
    with raw(daemon) as s:
        s.sendall(put_frame(items, rid=11) + frame(p.Op.PING, rid=12, meta=b"alive"))
        error, pong = read_replies(s, 2)
        assert isinstance(error, p.ErrorReply) and error.code == p.ErrorCode.BAD_REQUEST, error
        assert error.request_id == 11 and f"items 0 and 2 name the same key {twice.hex()}" in error.message
        assert pong == p.PingReply(12, b"alive")
    with BlockClient(daemon.data_addr) as c:
        assert c.lookup([twice]) == 0 and c.lookup([other]) == 0  # nothing of the batch stored
        block = encode_block(twice, NS, 0, b"again" * 100)
        with pytest.raises(RemoteError, match="the same key") as info:  # identical blocks too, from the client
            c.put_many([(twice, block), (twice, block)])
        assert info.value.code == p.ErrorCode.BAD_REQUEST and c.lookup([twice]) == 0
        c.put(twice, block)  # the same connection serves on
        assert c.get(twice)[HEADER_SIZE:] == block[HEADER_SIZE:]
    assert_serving_others(daemon)


def test_a_nixl_put_naming_a_key_twice_is_refused_from_its_frame(daemon):
    """Refused by the protocol before any NIXL agent is asked (this daemon runs none)."""
    twice = key(8)
    request = m.NixlPut(31, (twice, twice), "a", (((0x10000, 200),), ((0x20000, 200),)))
    with raw(daemon) as s:
        s.sendall(p.Connection(p.Role.CLIENT).send(request) + frame(p.Op.PING, rid=32))
        error, pong = read_replies(s, 2)
        assert error.code == p.ErrorCode.BAD_REQUEST and f"NIXL_PUT items 0 and 1 name the same key {twice.hex()}" \
            in error.message and pong == p.PingReply(32), error
    assert_serving_others(daemon)


@pytest.mark.parametrize("wire, fragment", [
    (frame(p.Op.GET, count=1, meta=KEEP, flags=f.FLAG_DURABLE), "DURABLE"),
    (frame(p.Op.LOOKUP, count=1, meta=KEEP, flags=f.FLAG_PIN_TTL), "PIN_TTL"),
    (frame(p.Op.FLUSH, flags=f.FLAG_HAS_NS), "HAS_NS"),
    (frame(p.Op.DELETE, count=1, meta=KEEP, flags=f.FLAG_WANT_ORIGIN), "WANT_ORIGIN"),
    (frame(p.Op.UNPIN, count=1, meta=KEEP, flags=f.FLAG_DURABLE), "DURABLE"),
    (frame(p.Op.PING, meta=b"x", flags=0x8000), "0x8000"),
])
def test_a_flag_the_op_does_not_take_is_refused_and_the_connection_kept(daemon, wire, fragment):
    with raw(daemon) as s:
        s.sendall(wire + frame(p.Op.PING, rid=99, meta=b"alive"))
        error, pong = read_replies(s, 2)
        assert isinstance(error, p.ErrorReply) and error.code == p.ErrorCode.BAD_REQUEST, error
        assert fragment in error.message and "does not take" in error.message, error.message
        assert pong == p.PingReply(99, b"alive")
    with BlockClient(daemon.data_addr) as c:
        assert c.lookup([KEEP]) == 1  # the DELETE was refused, not done
    assert_serving_others(daemon)


def test_a_put_with_a_flag_it_does_not_take_stores_nothing(daemon):
    k = key(3)
    with raw(daemon) as s:
        s.sendall(put_frame([(k, encode_block(k, NS, 0, b"p" * 500))], rid=21, flags=f.FLAG_WANT_LOCATIONS)
                  + frame(p.Op.PING, rid=22))
        error, pong = read_replies(s, 2)
        assert error.code == p.ErrorCode.BAD_REQUEST and "WANT_LOCATIONS" in error.message and pong == p.PingReply(22)
    with BlockClient(daemon.data_addr) as c:
        assert c.lookup([k]) == 0
    assert_serving_others(daemon)


def test_lookup_get_and_pin_answer_a_repeated_key_per_item_and_count_it_once(daemon):
    a, b = key(4), key(5)
    blocks = {k: encode_block(k, NS, 0, os.urandom(700)) for k in (a, b)}
    with BlockClient(daemon.data_addr) as c:
        c.put_many(list(blocks.items()))
        assert c.lookup([a, a, b]) == 3
        got = c.get_many([a, b, a, key(6), a])
        assert [None if g is None else g[HEADER_SIZE:] for g in got] == \
            [blocks[a][HEADER_SIZE:], blocks[b][HEADER_SIZE:], blocks[a][HEADER_SIZE:], None, blocks[a][HEADER_SIZE:]]
        pinned_before = c.stats()["engine"]["pinned_bytes"]
        assert c.pin([a, a]) == [True, True]
        assert c.stats()["engine"]["pinned_bytes"] - pinned_before == len(blocks[a])
        assert c.unpin([a, a]) == [True, True] and c.stats()["engine"]["pinned_bytes"] == pinned_before
    assert_serving_others(daemon)


def test_the_client_sends_only_flags_its_ops_take(daemon):
    """The client's requests with its options set (READER_VERIFIES where HELLO lists it) are served."""
    k = key(7)
    block = encode_block(k, NS, 0, b"all options")
    with BlockClient(daemon.data_addr) as c:
        assert len(c.put_many([(k, block)], durable=True, ns_id=NS)) == 1
        assert c.lookup_locations([k], ns_id=NS)[0] == 1 and c.lookup([k], ns_id=NS, origins=[]) == 1
        assert c.pin([k], ttl_s=5) == [True] and c.unpin([k]) == [True]
        assert c.get_many([k], ns_id=NS)[0][HEADER_SIZE:] == block[HEADER_SIZE:]
        assert c.delete_many([k]) == [True]
        c.flush()
    assert_serving_others(daemon)
