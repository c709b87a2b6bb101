"""Rules of a request beyond its byte layout, checked by the sans-IO protocol (no sockets): a PUT
names each key once, and a frame carries only the flags its op takes. Fed whole and byte by byte."""
import os
import struct

import pytest

from kvtier.common.blockformat import encode_block
from kvtier.wire import connection as p
from kvtier.wire import events as m
from kvtier.wire import frames as f

from test_protocol import feed

K1, K2, K3 = (bytes([0x40 + i]) * 16 for i in range(3))
NS = b"\x09" * 16
FLAGS_AT = 6  # the header's u16 flags (kvtier.wire.frames)
PING = p.Ping(99, b"next")
FLAG_NAMES = {f.FLAG_HAS_NS: "HAS_NS", f.FLAG_DURABLE: "DURABLE", f.FLAG_WANT_LOCATIONS: "WANT_LOCATIONS",
              f.FLAG_READER_VERIFIES: "READER_VERIFIES", f.FLAG_WANT_ORIGIN: "WANT_ORIGIN",
              f.FLAG_PIN_TTL: "PIN_TTL", f.FLAG_SCATTER: "SCATTER", f.FLAG_SKIP_DELETED: "SKIP_DELETED"}
UNDEFINED_FLAG = 0x100
# what docs/protocol.md says each request op takes; every other flag is refused
REQUEST_TAKES = {
    m.Op.HELLO: 0,
    m.Op.LOOKUP: f.FLAG_HAS_NS | f.FLAG_WANT_LOCATIONS | f.FLAG_WANT_ORIGIN,
    m.Op.GET: f.FLAG_HAS_NS | f.FLAG_READER_VERIFIES | f.FLAG_WANT_ORIGIN,
    m.Op.PUT: f.FLAG_HAS_NS | f.FLAG_DURABLE | f.FLAG_SKIP_DELETED,
    m.Op.DELETE: f.FLAG_HAS_NS,
    m.Op.PIN: f.FLAG_HAS_NS | f.FLAG_PIN_TTL,
    m.Op.UNPIN: f.FLAG_HAS_NS,
    m.Op.FLUSH: 0,
    m.Op.STATS: 0,
    m.Op.PING: 0,
    m.Op.NIXL_METADATA: 0,
    m.Op.NIXL_GET: f.FLAG_HAS_NS | f.FLAG_READER_VERIFIES | f.FLAG_SCATTER,
    m.Op.NIXL_PUT: f.FLAG_HAS_NS | f.FLAG_DURABLE,
}
BLOCK = encode_block(K1, NS, 0, os.urandom(200))
ONE_OF_EACH = [  # a valid request of every op, as the client's writer makes it
    p.Hello(1, "c"), p.Lookup(1, (K1,)), p.Get(1, (K1,)), p.Put(1, (K1,), (BLOCK,)), p.Delete(1, (K1,)),
    p.Pin(1, (K1,)), p.Unpin(1, (K1,)), p.Flush(1), p.Stats(1), p.Ping(1, b"x"),
    m.NixlMetadata(1, b"md", ((0x10000, 4096),)), m.NixlGet(1, (K1,), "a", ((0x10000, 4096),)),
    m.NixlPut(1, (K1,), "a", (((0x10000, 4096),),)),
]
assert {p.Connection(p.Role.CLIENT).send(r)[5] for r in ONE_OF_EACH} == set(REQUEST_TAKES)


def with_flags(wire: bytes, extra: int) -> bytes:
    (flags,) = struct.unpack_from("<H", wire, FLAGS_AT)
    return wire[:FLAGS_AT] + struct.pack("<H", flags | extra) + wire[FLAGS_AT + 2:]


def put_frame(items, rid=5) -> bytes:
    """A PUT frame of ``(key, block)`` items as a raw frame (the item table as it comes)."""
    meta = b"".join(f.PUT_ITEM.pack(k, len(b)) for k, b in items)
    payload = b"".join(items_block for _, items_block in items)
    return f.pack_header(m.Op.PUT, 0, rid, len(items), len(meta), len(payload)) + meta + payload


def refused_then_served(wire: bytes, step: int) -> p.Rejected:
    server = p.Connection(p.Role.SERVER)
    events = feed(server, wire + p.Connection(p.Role.CLIENT).send(PING), step)
    assert len(events) == 2 and isinstance(events[0], p.Rejected), events
    assert events[1] == PING and not server.in_frame
    return events[0]


# -- a PUT names each key once ---------------------------------------------------------
@pytest.mark.parametrize("step", [1, 1 << 20])
def test_a_put_naming_a_key_twice_with_other_blocks_is_refused(step):
    other = encode_block(K1, NS, 0, os.urandom(200))
    rejected = refused_then_served(put_frame([(K1, BLOCK), (K2, encode_block(K2, NS, 0, b"k2")), (K1, other)]),
                                   step)
    assert rejected.code == p.ErrorCode.BAD_REQUEST and rejected.request_id == 5
    assert f"items 0 and 2 name the same key {K1.hex()}" in rejected.message and "nothing stored" in rejected.message


def test_a_put_naming_a_key_twice_with_the_same_block_is_refused_too():
    rejected = refused_then_served(put_frame([(K1, BLOCK), (K1, BLOCK)]), 1 << 20)
    assert rejected.code == p.ErrorCode.BAD_REQUEST and f"items 0 and 1 name the same key {K1.hex()}" in \
        rejected.message


def test_a_repeated_key_is_refused_before_the_payload_arrives():
    wire = put_frame([(K2, BLOCK), (K1, BLOCK), (K2, BLOCK)])
    server = p.Connection(p.Role.SERVER)
    server.receive_data(wire[:len(wire) - 3 * len(BLOCK)])  # the header and the item table only
    rejected = server.next_event()
    assert isinstance(rejected, p.Rejected) and "items 0 and 2" in rejected.message
    assert server.pending_head is None  # no buffer is chosen: the payload is skipped as it arrives


def test_a_nixl_put_naming_a_key_twice_is_refused():
    wire = p.Connection(p.Role.CLIENT).send(m.NixlPut(5, (K1, K2), "a", (((0x10000, 200),), ((0x20000, 200),))))
    first, second = wire.index(K1), wire.index(K2)
    wire = wire[:second] + K1 + wire[second + len(K1):]
    assert wire.index(K1) == first
    rejected = refused_then_served(wire, 1)
    assert rejected.code == p.ErrorCode.BAD_REQUEST and f"items 0 and 1 name the same key {K1.hex()}" in \
        rejected.message


@pytest.mark.parametrize("request_", [
    p.Lookup(5, (K1, K1, K2)), p.Get(5, (K1, K2, K1)), p.Delete(5, (K1, K1)), p.Pin(5, (K2, K2), ttl_ms=10),
    p.Unpin(5, (K1, K1)), m.NixlGet(5, (K1, K1), "a", ((0x10000, 4096), (0x20000, 4096))),
], ids=lambda r: type(r).__name__)
def test_ops_that_store_nothing_may_repeat_a_key(request_):
    """One answer per item: a repeated key is answered twice (GET sends its block twice)."""
    server = p.Connection(p.Role.SERVER)
    (event,) = feed(server, p.Connection(p.Role.CLIENT).send(request_), 1)
    assert event == request_


# -- a frame carries only the flags its op takes -----------------------------------------
REFUSED = [(r, flag) for r in ONE_OF_EACH for flag in (*FLAG_NAMES, UNDEFINED_FLAG)
           if not flag & REQUEST_TAKES[p.Connection(p.Role.CLIENT).send(r)[5]]]


@pytest.mark.parametrize("request_,flag", REFUSED, ids=[f"{type(r).__name__}-{FLAG_NAMES.get(flag, hex(flag))}"
                                                         for r, flag in REFUSED])
def test_a_flag_the_op_does_not_take_is_refused_naming_it(request_, flag):
    wire = with_flags(p.Connection(p.Role.CLIENT).send(request_), flag)
    rejected = refused_then_served(wire, 1 << 20)
    op = m.Op(wire[5]).name
    assert rejected.code == p.ErrorCode.BAD_REQUEST, rejected
    assert FLAG_NAMES.get(flag, f"{flag:#x}") in rejected.message and op in rejected.message, rejected.message


def test_every_flag_an_op_takes_is_accepted():
    requests = [p.Lookup(1, (K1,), True, NS, want_origin=True), p.Get(2, (K1,), NS, True, want_origin=True),
                p.Put(3, (K1,), (BLOCK,), True, NS, skip_deleted=True), p.Delete(4, (K1,), NS), p.Pin(5, (K1,), NS, ttl_ms=7),
                p.Unpin(6, (K1,), NS),
                m.NixlGet(7, (K1,), "a", ((0x10000, 64),), NS, True, (((0x10000, 64),),)),
                m.NixlPut(8, (K1,), "a", (((0x10000, 64),),), True, NS)]
    client = p.Connection(p.Role.CLIENT)
    wires = [client.send(r) for r in requests]
    assert [struct.unpack_from("<H", w, FLAGS_AT)[0] for w in wires] == [REQUEST_TAKES[w[5]] for w in wires]
    assert len(feed(p.Connection(p.Role.SERVER), b"".join(wires), 1)) == len(requests)


@pytest.mark.parametrize("request_,reply,flag", [
    (p.Put(3, (K1,), (BLOCK,)), p.PutReply(3, (7,)), f.FLAG_DURABLE),
    (p.Get(3, (K1,)), p.GetReply(3, (None,)), f.FLAG_WANT_LOCATIONS),
    (p.Ping(3), p.PingReply(3), f.FLAG_HAS_NS),
    (p.Lookup(3, (K1,)), p.LookupReply(3, 0), f.FLAG_READER_VERIFIES),
])
def test_a_reply_with_a_flag_its_op_does_not_take_is_a_protocol_error(request_, reply, flag):
    client = p.Connection(p.Role.CLIENT)
    client.send(request_)
    client.receive_data(with_flags(p.Connection(p.Role.SERVER).send(reply), flag))
    with pytest.raises(p.ProtocolError, match=FLAG_NAMES[flag]) as raised:
        client.next_event()
    assert raised.value.fatal
