"""NIXL_METADATA (0x0B) and NIXL_GET (0x0C) on the wire: sans-IO, fed whole and byte by byte; no sockets."""
import struct

import pytest

from kvtier.wire import connection as p
from kvtier.wire import events as m
from kvtier.wire import frames as f
from kvtier.wire import nixl_frames as nf

K1, K2 = bytes([1]) * 16, bytes([2]) * 16
NS = b"\x09" * 16
REQUESTS = [
    m.NixlMetadata(1, b"agent-metadata", ((0x10000, 1 << 20), (0x7F0000000000, 4096))),
    m.NixlMetadata(2, b"x", ()),
    m.NixlGet(3, (K1, K2), "kvtier-client-a", ((0x10000, 4096), (0x20000, 8192)), NS, True),
    m.NixlGet(4, (), "b", ()),
    m.NixlGet(5, (K1, K2), "c", ((0x10000, 4160), (0x30000, 100)), NS, True,
              (((0x10000, 64), (0x50000, 2048), (0x60000, 2048)), ((0x30000, 100),))),
]
REPLIES = [
    m.NixlMetadataReply(1, b"daemon-metadata"),
    m.NixlGetReply(3, (4096, f.DEFERRED_LENGTH)),
]


def _feed(conn, data: bytes, byte_by_byte: bool):
    events = []
    chunks = [data[i:i + 1] for i in range(len(data))] if byte_by_byte else [data]
    for chunk in chunks:
        conn.receive_data(chunk)
        while (event := conn.next_event()) is not p.NEED_DATA:
            events.append(event)
    return events


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_requests_round_trip(byte_by_byte):
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    wire = b"".join(client.send(msg) for msg in REQUESTS)
    assert _feed(server, wire, byte_by_byte) == REQUESTS


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_replies_round_trip_and_answer_their_requests(byte_by_byte):
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    client.send(REQUESTS[0])
    client.send(REQUESTS[2])
    wire = b"".join(server.send(msg) for msg in REPLIES)
    assert _feed(client, wire, byte_by_byte) == REPLIES
    assert client.outstanding == 0


def test_get_reply_with_another_item_count_is_a_protocol_error():
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    client.send(REQUESTS[2])  # two items
    client.receive_data(server.send(m.NixlGetReply(3, (4096,))))
    with pytest.raises(p.ProtocolError, match="1 items for 2 requested"):
        client.next_event()


def test_descriptor_layout_is_key_address_capacity():
    _, flags, _, count, meta, payload, _ = nf.ENCODERS[m.NixlGet](REQUESTS[2])
    assert flags == f.FLAG_HAS_NS | f.FLAG_READER_VERIFIES and count == 2 and payload == []
    name = b"kvtier-client-a"
    assert meta[:16] == NS and meta[16:18] == struct.pack("<H", len(name)) and meta[18:18 + len(name)] == name
    assert meta[18 + len(name):] == struct.pack("<16sQI", K1, 0x10000, 4096) + struct.pack("<16sQI", K2, 0x20000, 8192)


def test_scatter_extents_follow_the_descriptors_counts_first():
    _, flags, _, count, meta, _, _ = nf.ENCODERS[m.NixlGet](REQUESTS[4])
    assert flags & f.FLAG_SCATTER and count == 2
    table = meta[-(2 * 4 + 4 * 12):]
    assert table[:8] == struct.pack("<II", 3, 1)
    assert table[8:] == b"".join(struct.pack("<QI", a, n) for a, n in
                                 [(0x10000, 64), (0x50000, 2048), (0x60000, 2048), (0x30000, 100)])


@pytest.mark.parametrize("extents,problem", [
    ((((0x10000, 64),), ((0x30000, 100),)), "add up to its capacity"),  # 64 is not 4160
    ((((0x50000, 4160),), ((0x30000, 100),)), "start at its descriptor"),
    ((((0x10000, 4160),),), "2 keys and 1 extent lists"),
    ((((0x10000, 4160),), ()), "start at its descriptor"),
])
def test_a_client_cannot_send_extents_that_disagree_with_their_descriptors(extents, problem):
    msg = m.NixlGet(5, (K1, K2), "c", ((0x10000, 4160), (0x30000, 100)), NS, True, extents)
    with pytest.raises(ValueError, match=problem):
        p.Connection(p.Role.CLIENT).send(msg)


def _scatter_frame(counts, extents, descriptors=((K1, 0x10000, 4160),)) -> bytes:
    meta = struct.pack("<H", 1) + b"a" + b"".join(DESCRIPTOR.pack(*d) for d in descriptors)
    meta += b"".join(struct.pack("<I", c) for c in counts) + b"".join(struct.pack("<QI", *e) for e in extents)
    return _frame(m.Op.NIXL_GET, len(descriptors), meta, flags=f.FLAG_SCATTER)


def _frame(op: int, count: int, meta: bytes, payload: bytes = b"", flags: int = 0) -> bytes:
    return f.pack_header(op, flags, 7, count, len(meta), len(payload)) + meta + payload


def _rejected(frame: bytes) -> p.Rejected:
    server = p.Connection(p.Role.SERVER)
    server.receive_data(frame)
    event = server.next_event()
    assert isinstance(event, p.Rejected), event
    return event


REGION = struct.Struct("<QQ")
DESCRIPTOR = struct.Struct("<16sQI")
BAD_FRAMES = [
    (_frame(m.Op.NIXL_METADATA, 1, REGION.pack(4096, 4096)), p.ErrorCode.BAD_REQUEST, "no agent metadata"),
    (_frame(m.Op.NIXL_METADATA, m.NIXL_REGIONS_MAX + 1, b"md"), p.ErrorCode.LIMIT, "over the limit"),
    (_frame(m.Op.NIXL_METADATA, 0, b"x" * (m.NIXL_AGENT_METADATA_BYTES_MAX + 1)), p.ErrorCode.LIMIT,
     "agent metadata of"),
    (_frame(m.Op.NIXL_METADATA, 1, REGION.pack(0, 4096) + b"md"), p.ErrorCode.BAD_REQUEST, "at address 0"),
    (_frame(m.Op.NIXL_METADATA, 1, REGION.pack(4096, 0) + b"md"), p.ErrorCode.BAD_REQUEST, "empty"),
    (_frame(m.Op.NIXL_METADATA, 1, REGION.pack(2**64 - 4096, 8192) + b"md"), p.ErrorCode.BAD_REQUEST,
     "past the end"),
    (_frame(m.Op.NIXL_METADATA, 0, b"md", payload=b"p"), p.ErrorCode.BAD_REQUEST, "carries no payload"),
    (_frame(m.Op.NIXL_GET, 1, struct.pack("<H", 1) + b"a" + DESCRIPTOR.pack(K1, 4096, 10)[:-1]),
     p.ErrorCode.BAD_REQUEST, "does not hold 1 items"),
    (_frame(m.Op.NIXL_GET, 0, struct.pack("<H", 0)), p.ErrorCode.BAD_REQUEST, "agent name of 0 bytes"),
    (_frame(m.Op.NIXL_GET, 0, struct.pack("<H", 2) + b"\xff\xfe"), p.ErrorCode.BAD_REQUEST, "not UTF-8"),
    (_frame(m.Op.NIXL_GET, 0, b""), p.ErrorCode.BAD_REQUEST, "no agent name"),
    (_frame(m.Op.NIXL_GET, 0, b"short", flags=f.FLAG_HAS_NS), p.ErrorCode.BAD_REQUEST, "no namespace id"),
    (_frame(m.Op.NIXL_GET, p.BATCH_COUNT_MAX + 1, b""), p.ErrorCode.LIMIT, "over the limit"),
]
SCATTER_FRAMES = [
    ((2,), [(0x10000, 64), (0x20000, 4000)], "do not add up to its capacity"),
    ((1,), [(0x20000, 4160)], "do not start at its descriptor"),
    ((0,), [], "0 extents"),
    ((2,), [(0x10000, 64)], "does not hold 2 extents"),
    ((), [], "extent counts of 0 bytes"),
    ((m.NIXL_EXTENTS_MAX + 1,), [], "over the limit"),
]


@pytest.mark.parametrize("counts,extents,message", SCATTER_FRAMES)
def test_malformed_scatter_tables_are_refused_with_the_framing_kept(counts, extents, message):
    code = p.ErrorCode.LIMIT if "limit" in message else p.ErrorCode.BAD_REQUEST
    _refused_and_served_on(_scatter_frame(counts, extents), code, message)


def _refused_and_served_on(frame, code, message):
    server = p.Connection(p.Role.SERVER)
    server.receive_data(frame + p.Connection(p.Role.CLIENT).send(p.Ping(8, b"next")))
    event = server.next_event()
    assert isinstance(event, p.Rejected) and event.code == code and message in event.message, event
    while (after := server.next_event()) is p.NEED_DATA:
        pass
    assert after == p.Ping(8, b"next")


@pytest.mark.parametrize("frame,code,message", BAD_FRAMES)
def test_malformed_requests_are_refused_with_the_framing_kept(frame, code, message):
    _refused_and_served_on(frame, code, message)


@pytest.mark.parametrize("op", [m.Op.NIXL_METADATA, m.Op.NIXL_GET])
def test_before_hello_the_nixl_ops_are_refused_from_the_header(op):
    server = p.Connection(p.Role.SERVER, hello_first=True)
    server.receive_data(_frame(op, 0, b"md"))
    with pytest.raises(p.ProtocolError) as raised:
        server.next_event()
    assert raised.value.code == p.ErrorCode.AUTH and raised.value.fatal


def test_encoders_refuse_what_the_decoders_would():
    client = p.Connection(p.Role.CLIENT)
    with pytest.raises(ValueError, match="agent metadata of 0 bytes"):
        client.send(m.NixlMetadata(1, b"", ()))
    with pytest.raises(ValueError, match="2 keys and 1 descriptors"):
        client.send(m.NixlGet(1, (K1, K2), "a", ((4096, 1),)))
    with pytest.raises(ValueError, match="agent name of 0 bytes"):
        client.send(m.NixlGet(1, (), "", ()))
    with pytest.raises(ValueError, match="key must be 16 bytes"):
        client.send(m.NixlGet(1, (b"short",), "a", ((4096, 1),)))


def test_a_part_notification_names_its_request_and_ranges():
    message = nf.part_notification(5, [(0, 0, 8 << 20), (3, 4096, 100)])
    assert message.startswith(nf.notification_prefix(5)) and not message.startswith(nf.notification_prefix(6))
    assert nf.parse_part_notification(message) == (5, [(0, 0, 8 << 20), (3, 4096, 100)])


@pytest.mark.parametrize("message,problem", [
    (b"other:" + bytes(20), "not a kvtier NIXL_GET notification"),
    (nf.notification_prefix(5), "not a kvtier NIXL_GET notification"),
    (nf.part_notification(5, [(0, 0, 1)])[:-1], "1 ranges in 15 bytes"),
    (nf.notification_prefix(5) + struct.pack("<I", 0), "0 ranges in 0 bytes"),
])
def test_a_malformed_part_notification_is_refused(message, problem):
    with pytest.raises(ValueError, match=problem):
        nf.parse_part_notification(message)


def test_a_part_notification_names_at_least_one_range_and_not_too_many():
    with pytest.raises(ValueError, match="1..4096 ranges"):
        nf.part_notification(1, [])
    with pytest.raises(ValueError, match="1..4096 ranges"):
        nf.part_notification(1, [(0, 0, 1)] * (nf.PART_RANGES_MAX + 1))
