"""The sans-IO data protocol, fed bytes whole and one at a time; no sockets."""
import os
import struct

import pytest

from kvtier.wire import connection as p
from kvtier.wire import frames as f
from kvtier.wire import readers, state, writers
from kvtier.common.blockformat import encode_block
from kvtier.wire.events import TOKEN_BYTES_MAX

K1, K2, K3 = (bytes([i]) * 16 for i in (1, 2, 3))
NS = b"\x09" * 16
BLOCK1 = encode_block(K1, NS, 1, os.urandom(300))
BLOCK2 = encode_block(K2, NS, 1, os.urandom(5000))

REQUESTS = [
    p.Hello(1, "bench", "s3cret"),
    p.Lookup(2, (K1, K2, K3)),
    p.Lookup(3, (K1, K2), want_locations=True, ns_id=NS),
    p.Get(4, (K1, K2), ns_id=NS),
    p.Get(5, ()),
    p.Get(15, (K2,), reader_verifies=True),
    p.Put(6, (K1, K2), (BLOCK1, BLOCK2), durable=True, ns_id=NS),
    p.Put(7, (K3,), (BLOCK1,)),
    p.Delete(8, (K1,)),
    p.Pin(9, (K1, K2)),
    p.Unpin(10, (K2,)),
    p.Flush(11),
    p.Stats(12),
    p.Ping(13, b"hello"),
    p.Put(2**64 - 1, (), ()),
]
REPLIES = [
    p.HelloReply(1, {"server": "kvtierd", "geometry": {"stripe_size_bytes": 1048576}}),
    p.LookupReply(2, 2),
    p.LookupReply(3, 1, (p.Location(4096, 364, 7, True), None)),
    p.GetReply(4, (BLOCK1, None, BLOCK2, p.DEFERRED)),
    p.GetReply(5, ()),
    p.PutReply(6, (5, 6)),
    p.DeleteReply(8, (True,)),
    p.PinReply(9, (True, False)),
    p.UnpinReply(10, (False,)),
    p.FlushReply(11),
    p.StatsReply(12, {"ops": {"get": 3}}),
    p.PingReply(13, b"hello"),
    p.ErrorReply(14, p.ErrorCode.BAD_BLOCK, "PUT item 0: payload CRC mismatch"),
]
ANSWERED = [  # the requests REPLIES answer, in order
    p.Hello(1, "bench"),
    p.Lookup(2, (K1, K2, K3)),
    p.Lookup(3, (K1, K2), want_locations=True),
    p.Get(4, (K1, K2, K3, K1)),
    p.Get(5, ()),
    p.Put(6, (K1, K2), (BLOCK1, BLOCK2)),
    p.Delete(8, (K1,)),
    p.Pin(9, (K1, K2)),
    p.Unpin(10, (K2,)),
    p.Flush(11),
    p.Stats(12),
    p.Ping(13, b"hello"),
    p.Put(14, (K1,), (BLOCK1,)),
]


def normalize(msg):
    """Messages with memoryview payloads compare by their bytes."""
    if isinstance(msg, p.Put):
        return (type(msg), msg.request_id, msg.keys, tuple(bytes(b) for b in msg.blocks), msg.durable, msg.ns_id)
    if isinstance(msg, p.GetReply):
        return (type(msg), msg.request_id,
                tuple(b if b is None or b is p.DEFERRED else bytes(b) for b in msg.blocks))
    if isinstance(msg, p.ErrorReply):
        return (type(msg), msg.request_id, int(msg.code), msg.message)
    return msg


def drain(conn):
    events = []
    while True:
        ev = conn.next_event()
        if ev is p.NEED_DATA or ev is p.CONNECTION_CLOSED:
            return events, ev
        events.append(ev)


def feed(conn, wire, step):
    """Every event ``wire`` gives, fed ``step`` bytes at a time."""
    events = []
    for i in range(0, len(wire), step):
        conn.receive_data(wire[i:i + step])
        got, _ = drain(conn)
        events += got
    return events


@pytest.mark.parametrize("step", [None, 1, 7])
def test_every_request_round_trips(step):
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    wire = b"".join(client.send(r) for r in REQUESTS)
    events = feed(server, wire, step or len(wire))
    assert [normalize(e) for e in events] == [normalize(r) for r in REQUESTS]
    assert server.bytes_received == len(wire) == client.bytes_sent
    assert not server.in_frame


@pytest.mark.parametrize("step", [None, 1, 13])
def test_every_reply_round_trips(step):
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    for request in ANSWERED:
        client.send(request)
    assert client.outstanding == len(ANSWERED)
    wire = b"".join(server.send(r) for r in REPLIES)
    events = feed(client, wire, step or len(wire))
    assert [normalize(e) for e in events] == [normalize(r) for r in REPLIES]
    assert client.outstanding == 0


def test_clean_end_of_stream_and_truncation():
    server = p.Connection(p.Role.SERVER)
    server.receive_data(b"")
    assert server.next_event() is p.CONNECTION_CLOSED
    wire = p.Connection(p.Role.CLIENT).send(p.Put(3, (K1,), (BLOCK1,)))
    for cut in (5, f.FRAME_HEADER_SIZE + 3, len(wire) - 1):
        server = p.Connection(p.Role.SERVER)
        server.receive_data(wire[:cut])
        assert server.next_event() is p.NEED_DATA
        assert server.in_frame
        server.receive_data(b"")
        with pytest.raises(p.ProtocolError, match="truncated") as info:
            server.next_event()
        assert info.value.fatal and info.value.code == p.ErrorCode.BAD_FRAME
        with pytest.raises(p.ProtocolError, match="already failed"):
            server.next_event()


def test_zero_copy_payload_into_a_callers_buffer():
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    client.send(p.Get(4, (K2,)))
    wire = server.send(p.GetReply(4, (BLOCK2,)))
    header_and_meta = f.FRAME_HEADER_SIZE + 4
    client.receive_data(wire[:header_and_meta + 10])  # a little payload came with the header
    assert client.next_event() is p.NEED_DATA
    assert client.pending_head.payload_len == len(BLOCK2)
    assert client.pending_meta == (len(BLOCK2),)
    target = bytearray(len(BLOCK2) + 100)
    client.set_payload_buffer(target)
    pos = header_and_meta + 10
    while (view := client.payload_view()) is not None:  # what recv_into would do
        n = min(777, view.nbytes)
        view[:n] = wire[pos:pos + n]
        pos += n
        client.payload_received(n)
    (reply,) = drain(client)[0]
    assert bytes(target[:len(BLOCK2)]) == BLOCK2
    assert reply.blocks[0].obj is target  # the reply points into the caller's buffer, no copy


def test_allocated_payload_view_path():
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    wire = client.send(p.Put(1, (K1, K2), (BLOCK1, BLOCK2)))
    server.receive_data(wire[:40])
    assert server.next_event() is p.NEED_DATA
    assert server.payload_view() is None  # meta not complete yet
    server.receive_data(wire[40:100])
    assert server.next_event() is p.NEED_DATA
    view = server.payload_view()
    start = len(wire) - view.nbytes
    view[:] = wire[start:]
    server.payload_received(view.nbytes)
    (put,) = drain(server)[0]
    assert [bytes(b) for b in put.blocks] == [BLOCK1, BLOCK2]


def test_bad_magic_and_version_are_fatal():
    server = p.Connection(p.Role.SERVER)
    server.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 10)
    with pytest.raises(p.ProtocolError, match="magic") as info:
        server.next_event()
    assert info.value.fatal
    server = p.Connection(p.Role.SERVER)
    server.receive_data(f.pack_header(p.Op.PING, 0, 5, 0, 0, 0, version=9))
    with pytest.raises(p.ProtocolError, match="version 9") as info:
        server.next_event()
    assert info.value.code == p.ErrorCode.BAD_VERSION and info.value.request_id == 5


def test_lengths_over_their_limits_are_refused_before_allocating():
    for meta_len, payload_len, what in ((p.META_BYTES_MAX + 1, 0, "meta"), (0, 2**32 - 1, "payload")):
        server = p.Connection(p.Role.SERVER)
        server.receive_data(f.pack_header(p.Op.PUT, 0, 1, 1, meta_len, payload_len))
        with pytest.raises(p.ProtocolError, match=f"{what}.*over the limit") as info:
            server.next_event()
        assert info.value.code == p.ErrorCode.LIMIT and info.value.fatal


@pytest.mark.parametrize("step", [None, 1, 1000])
def test_a_payload_refused_before_it_arrives_is_skipped(step):
    """The server refuses a PUT once its header and meta are in (no buffer for the payload):
    the payload is skipped as it arrives, however it is split, and the next frame parses."""
    client = p.Connection(p.Role.CLIENT)
    put, good = client.send(p.Put(4, (K1, K2), (BLOCK1, BLOCK2))), client.send(p.Ping(5, b"next"))
    wire = put + good
    server = p.Connection(p.Role.SERVER)
    head_and_meta = len(put) - len(BLOCK1) - len(BLOCK2)
    step = step or len(wire)
    events = feed(server, wire[:head_and_meta], step)
    assert not events and server.pending_head.request_id == 4
    rejected = server.reject_payload(p.ErrorCode.BUSY, "no room")
    assert (rejected.request_id, rejected.code, rejected.message) == (4, p.ErrorCode.BUSY, "no room")
    with pytest.raises(RuntimeError, match="pending payload"):
        server.reject_payload(p.ErrorCode.BUSY, "twice")
    events = feed(server, wire[head_and_meta:], step)
    assert events == [p.Ping(5, b"next")] and not server.in_frame


def test_rejected_requests_keep_the_framing():
    """Unknown op, count over the limit, wrong key size, a block over the
    region limit: each becomes a Rejected event; the next frame still parses."""
    limits = p.Limits(block_bytes_max=1000)
    server = p.Connection(p.Role.SERVER, limits)
    client = p.Connection(p.Role.CLIENT)
    bad = [
        f.pack_header(0x55, 0, 1, 0, 3, 4) + b"abc" + b"defg",
        f.pack_header(p.Op.GET, 0, 2, p.BATCH_COUNT_MAX + 1, 0, 0),
        f.pack_header(p.Op.GET, 0, 3, 2, 30, 0) + b"k" * 30,
        client.send(p.Put(4, (K2,), (BLOCK2,))),  # 5064 bytes > 1000
        f.pack_header(p.Op.GET, 0x80, 5, 1, 16, 0) + K1,  # a flag no op defines
        f.pack_header(p.Op.PUT | p.REPLY_BIT, 0, 6, 0, 0, 0),  # a reply sent to a server
    ]
    good = client.send(p.Ping(7, b"still here"))
    for step in (None, 1):
        server = p.Connection(p.Role.SERVER, limits)
        wire = b"".join(bad) + good
        events = feed(server, wire, step or len(wire))
        codes = [(e.request_id, e.code) for e in events[:-1]]
        assert codes == [(1, p.ErrorCode.UNKNOWN_OP), (2, p.ErrorCode.LIMIT), (3, p.ErrorCode.BAD_REQUEST),
                         (4, p.ErrorCode.TOO_LARGE), (5, p.ErrorCode.BAD_REQUEST), (6, p.ErrorCode.UNKNOWN_OP)]
        assert "wrong key size" in events[2].message and "region size" in events[3].message
        assert events[-1] == p.Ping(7, b"still here")


def test_put_lengths_must_add_up_and_hello_limits():
    server = p.Connection(p.Role.SERVER)
    meta = struct.pack("<16sI", K1, 10)
    server.receive_data(f.pack_header(p.Op.PUT, 0, 1, 1, len(meta), 11) + meta + b"x" * 11)
    (ev,) = drain(server)[0]
    assert isinstance(ev, p.Rejected) and "add up" in ev.message
    long_token = b"t" * (TOKEN_BYTES_MAX + 1)
    meta = struct.pack("<H", 0) + struct.pack("<H", len(long_token)) + long_token
    server.receive_data(f.pack_header(p.Op.HELLO, 0, 2, 0, len(meta), 0) + meta)
    (ev,) = drain(server)[0]
    assert ev.code == p.ErrorCode.LIMIT and "token" in ev.message


def test_sender_checks_keys_and_roles():
    client = p.Connection(p.Role.CLIENT)
    with pytest.raises(ValueError, match="16 bytes"):
        client.send(p.Get(1, (b"short",)))
    with pytest.raises(TypeError, match="client cannot send"):
        client.send(p.PingReply(1))
    with pytest.raises(ValueError, match="over the frame limits"):
        client.send(p.Get(1, (K1,) * (p.BATCH_COUNT_MAX + 1)))


def test_a_client_refuses_requests_from_the_server():
    client = p.Connection(p.Role.CLIENT)
    client.receive_data(p.Connection(p.Role.CLIENT).send(p.Ping(1)))
    with pytest.raises(p.ProtocolError, match="expected a reply"):
        client.next_event()


def test_keys_with_zero_bytes_survive_the_vectorized_split():
    keys = tuple([bytes(16), b"\x00" * 15 + b"\x01", b"\x01" + b"\x00" * 15] + [os.urandom(16) for _ in range(1021)])
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    for msg in (p.Lookup(1, keys, ns_id=NS), p.Get(2, keys), p.Delete(3, keys[:3])):
        server.receive_data(client.send(msg))
        got = server.next_event()
        assert isinstance(got.keys, p.PackedKeys) and got.keys.packed == b"".join(msg.keys)  # for batch consumers
        assert got.keys._keys is None and len(got.keys) == len(msg.keys)  # not split until someone needs them
        assert got == msg and all(type(k) is bytes and len(k) == 16 for k in got.keys)
        assert hash(got) == hash(msg) and got.keys[1:3] == msg.keys[1:3] and list(got.keys) == list(msg.keys)
        assert msg.keys[-1] in got.keys and got.keys == readers.PackedKeys(b"".join(msg.keys))
    assert readers.split_keys(NS + b"".join(keys[:2]), 16) == keys[:2] and readers.split_keys(b"") == ()
    with pytest.raises(ValueError):
        readers.PackedKeys(b"\x00" * 17)


def test_lookup_reply_encodes_any_object_with_location_fields():
    """The daemon hands the engine's location objects to the encoder as they are."""
    class EngineLocation:
        def __init__(self, logical_offset, length, seq, sealed):
            self.logical_offset, self.length, self.seq, self.sealed = logical_offset, length, seq, sealed

    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    client.send(p.Lookup(5, (K1, K2), want_locations=True))
    client.receive_data(server.send(p.LookupReply(5, 1, (EngineLocation(1 << 40, 2 << 20, 99, False), None))))
    assert client.next_event() == p.LookupReply(5, 1, (p.Location(1 << 40, 2 << 20, 99, False), None))


def test_location_records_encode_columns_like_location_objects():
    present = [True, False, True, True]
    records = writers.location_records(present, [1 << 40, 7, 4096, 0], [2 << 20, 7, 364, 1], [99, 7, 5, 2 ** 63],
                                 [False, True, True, True])
    as_objects = (p.Location(1 << 40, 2 << 20, 99, False), None, p.Location(4096, 364, 5, True),
                  p.Location(0, 1, 2 ** 63, True))
    server = p.Connection(p.Role.SERVER)
    wire = server.send(p.LookupReply(6, 1, records))
    assert wire == p.Connection(p.Role.SERVER).send(p.LookupReply(6, 1, as_objects))  # the same bytes
    client = p.Connection(p.Role.CLIENT)
    client.send(p.Lookup(6, (K1, K2, K3, K1), want_locations=True))
    client.receive_data(wire)
    assert client.next_event() == p.LookupReply(6, 1, as_objects)
    assert len(writers.location_records([], [], [], [], [])) == 0
    with pytest.raises(ValueError):
        p.LocationRecords(b"\x00" * 23, 1)


def test_send_parts_can_number_a_frame_without_copying_the_message():
    msg = p.Lookup(0, (K1, K2, K3), ns_id=NS)
    numbered = b"".join(bytes(x) for x in p.Connection(p.Role.CLIENT).send_parts(msg, request_id=41))
    assert numbered == p.Connection(p.Role.CLIENT).send(p.Lookup(41, (K1, K2, K3), ns_id=NS))
    with pytest.raises(ValueError):
        p.Connection(p.Role.CLIENT).send_parts(msg, request_id=2 ** 64)


@pytest.mark.parametrize("first, code, fragment", [
    (f.pack_header(p.Op.PUT, 0, 1, 64, 64 * 20, 64 * (3 << 20)), p.ErrorCode.AUTH, "first frame must be HELLO"),
    (f.pack_header(p.Op.GET, 0, 1, 1, 16, 0), p.ErrorCode.AUTH, "got op 0x03"),
    (f.pack_header(p.Op.PING, 0, 1, 0, 0, 0), p.ErrorCode.AUTH, "first frame must be HELLO"),
    (f.pack_header(p.Op.HELLO, 0, 1, 0, 8, 1 << 20), p.ErrorCode.LIMIT, "before-HELLO limit"),
    (f.pack_header(p.Op.HELLO, 0, 1, 0, p.HELLO_META_BYTES_MAX + 1, 0), p.ErrorCode.LIMIT, "before-HELLO limit"),
])
def test_before_hello_only_a_hello_sized_frame_is_read(first, code, fragment):
    """Refused from the 32-byte header alone: nothing past it is read or allocated."""
    server = p.Connection(p.Role.SERVER, hello_first=True)
    for byte in first[:-1]:
        server.receive_data(bytes([byte]))
        assert server.next_event() is p.NEED_DATA
    server.receive_data(first[-1:] + b"x" * 4096)
    with pytest.raises(p.ProtocolError, match=fragment) as info:
        server.next_event()
    assert info.value.code == code and info.value.fatal and info.value.request_id == 1
    assert server.pending_head is None and server.payload_view() is None


@pytest.mark.parametrize("step", [None, 1])
def test_after_hello_is_accepted_the_full_limits_apply(step):
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER, hello_first=True)
    hello = p.Hello(1, "n" * 256, "t" * TOKEN_BYTES_MAX)  # the largest valid HELLO fits the before-HELLO limit
    hello_wire = client.send(hello)
    wire = hello_wire + client.send(REQUESTS[5])
    assert server.awaiting_hello
    events = feed(server, wire[:len(hello_wire)], step or len(wire))
    assert events == [hello] and server.awaiting_hello  # the server decides whether the HELLO succeeded
    server.hello_accepted()
    assert not server.awaiting_hello
    events = feed(server, wire[len(hello_wire):], step or len(wire))
    assert [normalize(e) for e in events] == [normalize(REQUESTS[5])]
    with pytest.raises(ValueError, match="server-side"):
        p.Connection(p.Role.CLIENT, hello_first=True)


# -- a client connection checks each reply against the request it answers ---
def reply_wire(*replies) -> bytes:
    server = p.Connection(p.Role.SERVER)
    return b"".join(server.send(r) for r in replies)


def client_after(*requests) -> p.Connection:
    client = p.Connection(p.Role.CLIENT)
    for request in requests:
        client.send(request)
    return client


def feed_until_error(conn, wire, step):
    """Feed ``wire`` ``step`` bytes at a time until the connection raises; the events before, and the error."""
    events = []
    with pytest.raises(p.ProtocolError) as info:
        for i in range(0, len(wire), step):
            conn.receive_data(wire[i:i + step])
            while (event := conn.next_event()) is not p.NEED_DATA:
                events.append(event)
    assert info.value.fatal
    with pytest.raises(p.ProtocolError, match="already failed"):
        conn.next_event()
    return events, info.value


@pytest.mark.parametrize("step", [None, 1])
@pytest.mark.parametrize("requests, replies, answered, fragment", [
    ((p.Ping(1),), (p.PingReply(1), p.PingReply(1)), 1, "reply for request 1, but no request is awaiting"),
    ((p.Ping(1), p.Ping(2), p.Ping(3)), (p.PingReply(7),), 0, "reply for request 7, expected 1 or one of the 2"),
    ((), (p.FlushReply(4),), 0, "no request is awaiting a reply"),
    ((p.Get(5, (K1,)),), (p.LookupReply(5, 0),), 0, "a LOOKUP reply for request 5, which was a GET"),
    ((p.Stats(6), p.Flush(7)), (p.FlushReply(6),), 0, "a FLUSH reply for request 6, which was a STATS"),
    ((p.Get(8, (K1, K2)),), (p.GetReply(8, (BLOCK1,)),), 0, "GET reply for request 8 has 1 items for 2"),
    ((p.Put(9, (K1,), (BLOCK1,)),), (p.PutReply(9, (1, 2)),), 0, "PUT reply for request 9 has 2 items for 1"),
    ((p.Delete(10, (K1, K2)),), (p.DeleteReply(10, (True,)),), 0, "has 1 items for 2"),
    ((p.Lookup(11, (K1, K2)),), (p.LookupReply(11, 3),), 0, "counts 3 leading keys of a request of 2"),
    ((p.Lookup(12, (K1,)),), (p.LookupReply(12, 1, (None,)),), 0, "carries the locations the request did not"),
    ((p.Lookup(13, (K1,), want_locations=True),), (p.LookupReply(13, 1),), 0, "lacks the locations the request"),
    ((p.Lookup(14, (K1, K2), want_locations=True),), (p.LookupReply(14, 1, (None,)),), 0, "1 locations for 2 keys"),
])
def test_a_reply_that_answers_no_outstanding_request_is_a_protocol_error(step, requests, replies, answered,
                                                                         fragment):
    client = client_after(*requests)
    wire = reply_wire(*replies)
    events, error = feed_until_error(client, wire, step or len(wire))
    assert len(events) == answered and fragment in str(error), str(error)
    assert error.request_id == replies[answered].request_id


@pytest.mark.parametrize("step", [None, 1])
def test_a_mismatched_reply_is_refused_from_its_header_before_its_payload(step):
    client = client_after(p.Get(1, (K1, K2)))
    wire = reply_wire(p.GetReply(1, (BLOCK2,)))
    with pytest.raises(p.ProtocolError, match="1 items for 2"):
        feed(client, wire[:f.FRAME_HEADER_SIZE], step or f.FRAME_HEADER_SIZE)
    assert client.pending_head is None and client.payload_view() is None


@pytest.mark.parametrize("step", [None, 1])
def test_an_error_reply_answers_any_request_and_id_0_none(step):
    client = client_after(p.Get(1, (K1, K2)), p.Lookup(2, (K1,), want_locations=True), p.Ping(3))
    errors = [p.ErrorReply(2, p.ErrorCode.BAD_REQUEST, "for the lookup"),
              p.ErrorReply(0, p.ErrorCode.BUSY, "connection-level"),
              p.ErrorReply(1, p.ErrorCode.NO_SPACE, "for the get")]
    wire = reply_wire(*errors, p.PingReply(3))
    assert [normalize(e) for e in feed(client, wire, step or len(wire))] == \
        [normalize(e) for e in errors] + [p.PingReply(3)]
    assert client.outstanding == 0
    client.receive_data(reply_wire(p.ErrorReply(2, p.ErrorCode.BAD_REQUEST, "answered already")))
    with pytest.raises(p.ProtocolError, match="reply for request 2, but no request is awaiting"):
        client.next_event()


def test_replies_come_back_in_any_order_and_each_request_once():
    client = client_after(p.Ping(1, b"a"), p.Flush(2), p.Lookup(3, (K1, K2)))
    client.receive_data(reply_wire(p.LookupReply(3, 2), p.PingReply(1, b"a"), p.FlushReply(2)))
    assert drain(client)[0] == [p.LookupReply(3, 2), p.PingReply(1, b"a"), p.FlushReply(2)]
    with pytest.raises(ValueError, match="request id 4 is already awaiting its reply"):
        client_after(p.Ping(4)).send(p.Flush(4))
    client.send(p.Ping(1))  # answered: the id may be used again
    assert client.outstanding == 1


def test_an_unchecked_client_takes_every_reply_as_it_comes():
    client = p.Connection(p.Role.CLIENT, check_replies=False)
    wire = reply_wire(*REPLIES)
    assert [normalize(e) for e in feed(client, wire, len(wire))] == [normalize(r) for r in REPLIES]
    assert client.outstanding == 0
    client.send(p.Ping(1))
    client.send(p.Ping(1))  # nothing is recorded


# -- the transition table --------------------------------------------------
def test_the_transition_table_is_complete_and_final_states_are_final():
    every_state = set(state.Receive) | set(state.Admission)
    assert set(state.TRANSITIONS) == every_state
    assert state.TRANSITIONS[state.Receive.CLOSED] == {} and state.TRANSITIONS[state.Receive.BROKEN] == {}
    targets = {target for row in state.TRANSITIONS.values() for target in row.values()}
    assert targets == every_state - {state.Admission.AWAITING_HELLO}  # every state but the start is reachable
    used = {what for row in state.TRANSITIONS.values() for what in row}
    assert used == set(state.Input)
    machine = state.ConnectionState()
    with pytest.raises(RuntimeError, match="no transition from HEADER on PAYLOAD_SKIPPED"):
        machine.process(state.Input.PAYLOAD_SKIPPED)
    for what in (state.Input.HEADER_READ, state.Input.META_READ, state.Input.PAYLOAD_REFUSED,
                 state.Input.PAYLOAD_SKIPPED, state.Input.END_OF_STREAM):
        machine.process(what)
    assert machine.receive is state.Receive.CLOSED and machine.admission is state.Admission.OPEN
