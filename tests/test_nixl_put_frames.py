"""NIXL_PUT (0x0D) on the wire: sans-IO, fed whole and byte by byte; no sockets."""
import struct

import pytest

from kvtier.wire import connection as p
from kvtier.wire import events as m
from kvtier.wire import frames as f
from kvtier.wire import nixl_frames as nf

from test_nixl_frames import _feed, _refused_and_served_on

K1, K2 = bytes([1]) * 16, bytes([2]) * 16
NS = b"\x09" * 16
PUTS = [
    m.NixlPut(3, (K1, K2), "kvtier-client-a", (((0x10000, 64), (0x50000, 2048)), ((0x30000, 100),)), True, NS),
    m.NixlPut(4, (K1,), "b", (((0x10000, 4096),),)),
]


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_puts_and_their_replies_round_trip(byte_by_byte):
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    assert _feed(server, b"".join(client.send(msg) for msg in PUTS), byte_by_byte) == PUTS
    replies = [m.NixlPutReply(3, (7, 8)), m.NixlPutReply(4, (9,))]
    assert _feed(client, b"".join(server.send(msg) for msg in replies), byte_by_byte) == replies
    assert client.outstanding == 0


def test_the_layout_is_namespace_agent_items_then_extents():
    _, flags, _, count, meta, payload, _ = nf.ENCODERS[m.NixlPut](PUTS[0])
    assert flags == f.FLAG_HAS_NS | f.FLAG_DURABLE and count == 2 and payload == []
    name = b"kvtier-client-a"
    assert meta[:16] == NS and meta[16:18] == struct.pack("<H", len(name)) and meta[18:18 + len(name)] == name
    rest = meta[18 + len(name):]
    assert rest == struct.pack("<16sI", K1, 2) + struct.pack("<16sI", K2, 1) + b"".join(
        struct.pack("<QI", a, n) for a, n in [(0x10000, 64), (0x50000, 2048), (0x30000, 100)])


def test_a_reply_with_another_item_count_is_a_protocol_error():
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    client.send(PUTS[0])
    client.receive_data(server.send(m.NixlPutReply(3, (1,))))
    with pytest.raises(p.ProtocolError, match="1 items for 2 requested"):
        client.next_event()


def _frame(count: int, meta: bytes, payload: bytes = b"", flags: int = 0) -> bytes:
    return f.pack_header(m.Op.NIXL_PUT, flags, 7, count, len(meta), len(payload)) + meta + payload


AGENT = struct.pack("<H", 1) + b"a"
BAD_FRAMES = [
    (_frame(0, AGENT), p.ErrorCode.LIMIT, "NIXL_PUT of 0 items"),
    (_frame(p.BATCH_COUNT_MAX + 1, AGENT), p.ErrorCode.LIMIT, "NIXL_PUT of"),
    (_frame(1, AGENT + struct.pack("<16sI", K1, 1)[:-1]), p.ErrorCode.BAD_REQUEST, "does not hold 1 items"),
    (_frame(1, AGENT + struct.pack("<16sI", K1, 2) + struct.pack("<QI", 4096, 10)), p.ErrorCode.BAD_REQUEST,
     "does not hold 2 extents"),
    (_frame(1, AGENT + struct.pack("<16sI", K1, 0)), p.ErrorCode.BAD_REQUEST, "item 0: 0 extents"),
    (_frame(1, AGENT + struct.pack("<16sI", K1, 1) + struct.pack("<QI", 4096, 0)), p.ErrorCode.BAD_REQUEST,
     "item 0: 1 extents"),
    (_frame(1, AGENT + struct.pack("<16sI", K1, m.NIXL_EXTENTS_MAX + 1)), p.ErrorCode.LIMIT, "over the limit"),
    (_frame(1, struct.pack("<H", 9) + b"a"), p.ErrorCode.BAD_REQUEST, "agent name of 9 bytes"),
    (_frame(1, b""), p.ErrorCode.BAD_REQUEST, "no agent name"),
    (_frame(1, AGENT + struct.pack("<16sI", K1, 1) + struct.pack("<QI", 4096, 10), payload=b"x"),
     p.ErrorCode.BAD_REQUEST, "carries no payload"),
]


@pytest.mark.parametrize("frame,code,message", BAD_FRAMES)
def test_malformed_puts_are_refused_with_the_framing_kept(frame, code, message):
    _refused_and_served_on(frame, code, message)


def test_before_hello_a_nixl_put_is_refused_from_the_header():
    server = p.Connection(p.Role.SERVER, hello_first=True)
    server.receive_data(_frame(1, AGENT))
    with pytest.raises(p.ProtocolError) as raised:
        server.next_event()
    assert raised.value.code == p.ErrorCode.AUTH and raised.value.fatal


@pytest.mark.parametrize("msg,problem", [
    (m.NixlPut(1, (), "a", ()), "0 keys"),
    (m.NixlPut(1, (K1,), "a", ((),)), "one or more extents"),
    (m.NixlPut(1, (K1,), "a", (((4096, 0),),)), "one or more extents"),
    (m.NixlPut(1, (K1,), "", (((4096, 1),),)), "agent name of 0 bytes"),
    (m.NixlPut(1, (b"short",), "a", (((4096, 1),),)), "key must be 16 bytes"),
])
def test_the_encoder_refuses_what_the_decoder_would(msg, problem):
    with pytest.raises(ValueError, match=problem):
        p.Connection(p.Role.CLIENT).send(msg)
