"""BlockClient and AsyncBlockClient against a real kvtierd subprocess."""
import asyncio
import os
import select
import socket
import sys
import threading

import numpy as np
import pytest

from kvtier.client import AsyncBlockClient, BlockClient, BlockLocationInfo, ConnectionLost, RemoteError
from kvtier.wire import connection as p
from kvtier.wire import frames as f
from kvtier.common.blockformat import HEADER_SIZE, decode_header, encode_block, verify_block
from kvtier.common.keys import KVLayout, Namespace, chain_keys
from kvtier.client import transport_ops as ops

from daemon_proc import device_map_of

NS = b"\x07" * 16


def make_block(key: bytes, size: int, ns: bytes = NS) -> bytes:
    return encode_block(key, ns, 0, os.urandom(size))


def keys_of(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(15, "little") for i in range(n)]


def test_put_get_lookup_delete_round_trip(kvtierd):
    keys = keys_of(10, 1)
    blocks = [make_block(k, 1000 + 37 * i) for i, k in enumerate(keys)]
    with BlockClient(kvtierd.data_addr) as c:
        assert c.ping() > 0
        seqs = c.put_many(list(zip(keys, blocks)))
        assert len(seqs) == 10 and len(set(seqs)) == 10 and all(s > 0 for s in seqs)
        assert c.put(keys[0], blocks[0]) == seqs[0]  # a re-put is a no-op that returns the stored seq
        got = c.get_many(keys + keys_of(2, 2))
        for block, seq, stored in zip(blocks, seqs, got):
            header = verify_block(stored, expected_key=decode_header(block).key, expected_seq=seq)
            assert stored[HEADER_SIZE:] == block[HEADER_SIZE:] and header.ns_id == NS
        assert got[10:] == [None, None]
        views = c.get_many(keys + keys_of(1, 2), copy=False)  # zero-copy: read-only views of the reply
        assert all(isinstance(v, memoryview) and v.readonly for v in views[:10]) and views[10] is None
        assert [bytes(v) for v in views[:10]] == got[:10]
        assert c.lookup(keys) == 10
        assert c.lookup(keys[:3] + keys_of(1, 3) + keys[3:]) == 3
        assert c.delete(keys[4]) is True and c.delete(keys[4]) is False
        assert c.lookup(keys) == 4 and c.get(keys[4]) is None
        assert c.delete_many([keys[5], keys_of(1, 9)[0]]) == [True, False]


def test_get_into_a_callers_buffer(kvtierd):
    key = keys_of(1, 4)[0]
    block = make_block(key, 300_000)
    with BlockClient(kvtierd.data_addr) as c:
        c.put(key, block)
        buf = bytearray(400_000)
        n = c.get_into(key, buf)
        assert n == len(block) and buf[HEADER_SIZE:n] == block[HEADER_SIZE:]
        assert c.get_into(keys_of(1, 5)[0], buf) is None
        with pytest.raises(ValueError, match="does not fit"):
            c.get_into(key, bytearray(1000))
        assert c.get(key)[HEADER_SIZE:] == block[HEADER_SIZE:]  # the connection survived


def test_lookup_locations_geometry_pin_and_stats(kvtierd):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
    ns = Namespace("tiny-llama", layout)
    keys = chain_keys(ns.id, list(range(64)), layout.block_tokens)
    with BlockClient(kvtierd.data_addr) as c:
        seqs = c.put_many([(k, make_block(k, 512, ns.id)) for k in keys[:10]], durable=True)
        leading, locs = c.lookup_locations(keys)
        assert leading == 10 and len(locs) == len(keys)
        assert all(isinstance(loc, BlockLocationInfo) for loc in locs[:10]) and locs[10:] == [None] * (len(keys) - 10)
        assert [loc.seq for loc in locs[:10]] == seqs
        assert all(loc.length == HEADER_SIZE + 512 for loc in locs[:10])
        geo = c.geometry()
        assert len(geo.device_ids) == 4 and geo.stripe_size_bytes == 256 << 10
        pieces = geo.map_range(locs[0].logical_offset, locs[0].length)
        assert sum(piece[2] for piece in pieces) == locs[0].length
        assert c.pin(keys[:2] + keys[12:13]) == [True, True, False]
        assert c.unpin(keys[:1]) == [True]
        c.flush()
        assert all(loc.sealed for loc in c.lookup_locations(keys[:10])[1])  # flushed: sealed, direct-readable
        assert c.lookup(keys, ns_id=ns.id) == 10
        stats = c.stats()
        assert stats["engine"]["blocks"] == 10
        server = stats["server"]
        assert server["lookup_keys_asked"] == 2 * len(keys) + 10 and server["lookup_keys_hit"] == 30
        assert server["namespaces"][ns.id.hex()] == {"hits": 10, "misses": len(keys) - 10}
        assert server["requests"]["put"] == 1 and server["latency"]["put"]["count"] == 1


def test_bad_block_is_refused_and_named(kvtierd):
    key = keys_of(1, 6)[0]
    block = bytearray(make_block(key, 100))
    block[-1] ^= 0xFF
    with BlockClient(kvtierd.data_addr) as c:
        with pytest.raises(RemoteError, match="CRC") as info:
            c.put(key, bytes(block))
        assert info.value.code.name == "BAD_BLOCK"
        with pytest.raises(RemoteError, match="item 0.*not the expected"):
            c.put(keys_of(1, 7)[0], make_block(key, 100))
        assert c.get(key) is None and c.lookup([key]) == 0


def flip_byte_on_flash(daemon, client, key: bytes, at: int) -> None:
    """Flip one byte of a stored block in its device file, behind the daemon's back."""
    (_, (loc,)) = client.lookup_locations([key])
    geometry = client.geometry()
    device, offset, _ = geometry.map_range(loc.logical_offset + at, 1)[0]
    with open(device_map_of(daemon)[geometry.device_ids[device]], "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0xFF]))


FILLER_BYTES = 256 << 10
FILLERS_MAX = 64  # 16 MiB of fillers: several of the test daemon's 4 MiB regions


def seal_the_region_of(client, keys) -> None:
    """Put filler blocks until these stored keys' LOOKUP locations say sealed (LOCATION_SEALED):
    their region was sealed and left DRAM, so the daemon reads them from flash. Call with nothing
    made durable since they were put (no flush, no durable put): while a block is in the open
    region, not yet written in place, its location is not sealed."""
    for n in range(FILLERS_MAX):
        _, locs = client.lookup_locations(keys)
        if all(loc is not None and loc.sealed for loc in locs):
            return
        filler = bytes([200, keys[0][0]]) + n.to_bytes(14, "little")
        client.put(filler, make_block(filler, FILLER_BYTES))
    raise AssertionError(f"{FILLERS_MAX} filler blocks did not seal the region of {len(keys)} blocks")


def test_a_block_corrupt_on_flash_is_a_miss_and_a_re_put_replaces_it(kvtierd):
    """The daemon sends blocks with their header, key and seq checked and leaves the payload
    CRC to the client (READER_VERIFIES); a block that fails is asked for again without the
    flag, the daemon finds the corruption, drops the block and answers a miss -- so a re-put
    stores a good copy."""
    keys = keys_of(3, 40)
    blocks = [make_block(k, 100_000 + 999 * i) for i, k in enumerate(keys)]
    with BlockClient(kvtierd.data_addr) as c:
        c.put_many(list(zip(keys, blocks)))
        seal_the_region_of(c, keys)
        flip_byte_on_flash(kvtierd, c, keys[1], HEADER_SIZE + 5000)
        flip_byte_on_flash(kvtierd, c, keys[2], HEADER_SIZE + 7)
        got = c.get_many(keys)
        assert got[1] is None and got[0][HEADER_SIZE:] == blocks[0][HEADER_SIZE:] and got[2] is None
        assert c.statistics().corrupt_blocks == 2  # as sent; asked again, the daemon checks and drops them
        assert c.stats()["engine"]["corrupt_reads"] == 2 and c.lookup(keys[1:2]) == 0
        c.put(keys[1], blocks[1])
        assert c.get(keys[1])[HEADER_SIZE:] == blocks[1][HEADER_SIZE:]
        flip_byte_on_flash(kvtierd, c, keys[0], HEADER_SIZE + 1)
        buf = bytearray(len(blocks[0]))
        assert c.get_into(keys[0], buf) is None and c.lookup(keys[:1]) == 0
        assert c.statistics().corrupt_blocks == 3


def test_the_daemon_checks_payloads_unless_the_reader_says_it_does(kvtierd):
    """A reader that does not say it checks payload CRCs (a client from before the flag) gets
    them checked by the daemon -- which drops a block corrupt on flash; one that says so gets
    the block as stored. The daemon offers the flag in HELLO."""
    keys = keys_of(3, 41)
    blocks = [make_block(k, 50_000) for k in keys]
    with BlockClient(kvtierd.data_addr) as c:
        assert p.FEATURE_GET_READER_VERIFIES in c.server_info()["features"]
        c.put_many(list(zip(keys, blocks)))
        seal_the_region_of(c, keys)
        flip_byte_on_flash(kvtierd, c, keys[0], HEADER_SIZE + 100)
        flip_byte_on_flash(kvtierd, c, keys[2], HEADER_SIZE + 100)
        trusting = c._call(lambda: ops.op_single(p.Get(0, tuple(keys), None, reader_verifies=True)))
        assert trusting.blocks[0] is not None and len(trusting.blocks[0]) == len(blocks[0])  # as stored
        assert c.stats()["engine"]["corrupt_reads"] == 0 and c.lookup(keys[:1]) == 1
        plain = c._call(lambda: ops.op_single(p.Get(0, tuple(keys))))
        assert plain.blocks[0] is None and plain.blocks[2] is None
        assert bytes(plain.blocks[1])[HEADER_SIZE:] == blocks[1][HEADER_SIZE:]
        assert c.stats()["engine"]["corrupt_reads"] == 2 and c.lookup(keys[:1]) == 0


def test_async_client_asks_again_without_the_flag_after_a_mismatch(kvtierd):
    keys = keys_of(2, 42)
    blocks = [make_block(k, 70_000) for k in keys]

    async def scenario():
        async with AsyncBlockClient(kvtierd.data_addr) as c:
            await c.put_many(list(zip(keys, blocks)))
            with BlockClient(kvtierd.data_addr) as sync:
                seal_the_region_of(sync, keys)
                flip_byte_on_flash(kvtierd, sync, keys[1], HEADER_SIZE + 3)
            got = await c.get_many(keys)
            assert got[0][HEADER_SIZE:] == blocks[0][HEADER_SIZE:] and got[1] is None
            assert c.statistics().corrupt_blocks == 1 and await c.lookup(keys[1:]) == 0
            buf = bytearray(len(blocks[0]))
            assert await c.get_into(keys[0], buf) == len(blocks[0])

    asyncio.run(scenario())


def test_big_gets_are_split_and_deferred_items_fetched(kvtierd):
    """More block bytes than one reply may carry: the daemon defers, the client asks again."""
    keys = keys_of(12, 8)
    blocks = [make_block(k, 3 << 20) for k in keys]  # 36 MiB over 3 MiB blocks; regions are 4 MiB
    with BlockClient(kvtierd.data_addr) as c:
        c.put_many(list(zip(keys, blocks)))
        import kvtier.wire.events as m
        got = c.get_many(keys)
        assert [g[HEADER_SIZE:] == b[HEADER_SIZE:] for g, b in zip(got, blocks)] == [True] * 12
        assert m.PAYLOAD_BYTES_MAX > 36 << 20  # the deferral path itself is covered in test_daemon


def test_a_dropped_connection_is_replaced(kvtierd):
    key = keys_of(1, 10)[0]
    with BlockClient(kvtierd.data_addr, pool_size=1) as c:
        c.put(key, make_block(key, 64))
        (ch,) = list(c._pool.queue)
        ch.sock.close()  # as if the daemon had dropped it
        assert c.get(key) is not None
        assert c.statistics().reconnects == 1


def test_one_client_shared_by_threads(kvtierd):
    errors = []
    with BlockClient(kvtierd.data_addr, pool_size=3) as c:
        def worker(tag):
            try:
                keys = keys_of(20, 100 + tag)
                blocks = [make_block(k, 5000) for k in keys]
                c.put_many(list(zip(keys, blocks)))
                got = c.get_many(keys)
                assert [g[HEADER_SIZE:] for g in got] == [b[HEADER_SIZE:] for b in blocks]
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def test_async_client(kvtierd):
    async def run():
        async with AsyncBlockClient(kvtierd.data_addr, pool_size=2) as c:
            keys = keys_of(8, 11)
            blocks = [make_block(k, 20_000) for k in keys]
            seqs = await c.put_many(list(zip(keys, blocks)), durable=True)
            assert len(seqs) == 8
            results = await asyncio.gather(*(c.get(k) for k in keys))
            assert [r[HEADER_SIZE:] for r in results] == [b[HEADER_SIZE:] for b in blocks]
            assert await c.lookup(keys + keys_of(1, 12)) == 8
            leading, locs = await c.lookup_locations(keys[:2])
            assert leading == 2 and locs[0].length == len(blocks[0])
            buf = bytearray(30_000)
            assert await c.get_into(keys[0], buf) == len(blocks[0])
            assert (await c.geometry()).stripe_size_bytes == 256 << 10
            assert await c.pin(keys[:1]) == [True] and await c.unpin(keys[:1]) == [True]
            assert await c.delete(keys[0]) is True
            await c.flush()
            assert (await c.stats())["engine"]["blocks"] == 7
            assert await c.ping() > 0
    asyncio.run(run())


def test_put_batches_are_split_into_frames_one_daemon_arena_holds():
    """12 blocks of 2 MiB go out as frames of at most 16 MiB (received into pooled arenas,
    not transient buffers); a block larger than that travels alone."""
    big_key = b"\x03" * 16
    big = encode_block(big_key, NS, 1, bytes(20 << 20))
    items = [(bytes([i]) * 16, encode_block(bytes([i]) * 16, NS, 1, bytes((2 << 20) - 64))) for i in range(12)]
    frames = next(ops.op_put_many(items + [(big_key, big)] + items[:1], False, None, p.DEFAULT_LIMITS))
    sizes = [sum(len(b) for b in frame.blocks) for frame in frames]
    assert sizes == [16 << 20, 8 << 20, len(big), 2 << 20]
    assert all(s <= ops.PUT_FRAME_BYTES_TARGET for s in sizes if s != len(big))


def test_the_clients_check_keys_with_the_protocols_writer():
    from kvtier.client import block_client
    from kvtier.wire import writers

    assert block_client.check_key is writers.check_key and ops.check_key is writers.check_key
    with pytest.raises(ValueError, match="a key must be 16 bytes, got 3"):
        next(ops.op_get_many([b"abc"], None, p.DEFAULT_LIMITS))


def test_zero_copy_reply_buffers_are_reused_only_once_every_view_is_gone():
    from kvtier.client.block_client import ReplyBuffers
    pool = ReplyBuffers(count_max=2)
    first = pool.take(1000)
    first_id = id(first)
    view = memoryview(first).cast("B")[10:20].toreadonly()
    del first
    second = pool.take(500)
    assert id(second) != first_id  # a caller still holds a view of the first
    del second, view
    assert id(pool.take(800)) == first_id  # now free, and large enough
    assert len(pool.take(4000)) == 4000  # too large for either: a new one (replaces a free one)


def fake_getrefcount(obj):
    """Reference counts as a newer CPython may report them (arguments borrowed:
    two less than 3.11 says); the pool must not rely on them."""
    return REAL_GETREFCOUNT(obj) - 2


REAL_GETREFCOUNT = sys.getrefcount


def test_a_held_view_is_never_overwritten_whatever_reference_counts_say(monkeypatch):
    from kvtier.client.block_client import ReplyBuffers
    monkeypatch.setattr(sys, "getrefcount", fake_getrefcount)
    pool = ReplyBuffers(count_max=1)
    buf = pool.take(64)
    first_id = id(buf)
    memoryview(buf)[:5] = b"held!"
    held = memoryview(buf).cast("B")[:5].toreadonly()  # as get_many(copy=False) hands blocks out
    del buf
    again = pool.take(64)
    assert id(again) != first_id
    memoryview(again)[:5] = b"XXXXX"  # the next reply lands in whatever take() returned
    assert bytes(held) == b"held!"
    arr = np.frombuffer(held, np.uint8)  # an array over a view keeps the buffer busy too
    del held, again
    assert id(pool.take(64)) != first_id and bytes(arr) == b"held!"
    del arr
    assert id(pool.take(64)) == first_id  # free again: reused


def test_zero_copy_views_survive_later_gets_whatever_reference_counts_say(kvtierd, monkeypatch):
    monkeypatch.setattr(sys, "getrefcount", fake_getrefcount)
    keys = keys_of(4, 13)
    blocks = [make_block(k, 100_000 + i) for i, k in enumerate(keys)]
    with BlockClient(kvtierd.data_addr, pool_size=1) as c:
        c.put_many(list(zip(keys, blocks)))
        held = c.get_many(keys[2:], copy=False)  # the larger reply: its buffer would fit the next ones
        for _ in range(3):
            assert [bytes(v[HEADER_SIZE:]) for v in c.get_many(keys[:2], copy=False)] == \
                [b[HEADER_SIZE:] for b in blocks[:2]]
        assert [bytes(v[HEADER_SIZE:]) for v in held] == [b[HEADER_SIZE:] for b in blocks[2:]]


def test_zero_copy_views_stay_valid_across_later_gets(kvtierd):
    keys = keys_of(6, 11)
    blocks = [make_block(k, 200_000 + i) for i, k in enumerate(keys)]
    with BlockClient(kvtierd.data_addr, pool_size=1) as c:
        c.put_many(list(zip(keys, blocks)))
        held = c.get_many(keys[:3], copy=False)
        for _ in range(3):  # later replies must not land in the buffer the held views point into
            assert [bytes(v[HEADER_SIZE:]) for v in c.get_many(keys[3:], copy=False)] == \
                [b[HEADER_SIZE:] for b in blocks[3:]]
        assert [bytes(v[HEADER_SIZE:]) for v in held] == [b[HEADER_SIZE:] for b in blocks[:3]]
        assert [decode_header(v).key for v in held] == keys[:3]


class _CollectingWriter:
    """The writer half of an asyncio stream, without a socket."""

    def __init__(self):
        self.frames = []

    def writelines(self, parts):
        self.frames.append(b"".join(bytes(part) for part in parts))

    async def drain(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("error_id, raised", [
    (1, RemoteError),  # its own request: the daemon's error
    (0, RemoteError),  # connection-level: the daemon closes
    (7, p.ProtocolError),  # another request's: the stream is out of step
])
def test_async_client_checks_the_request_id_of_error_replies(error_id, raised):
    from kvtier.wire.channel import AsyncChannel

    async def run():
        reader = asyncio.StreamReader()
        ch = AsyncChannel(reader, _CollectingWriter(), timeout_s=5)
        server = p.Connection(p.Role.SERVER)
        reader.feed_data(server.send(p.ErrorReply(error_id, p.ErrorCode.BAD_REQUEST, "for some request")))
        with pytest.raises(raised) as info:
            await ch.exchange([p.Ping(0, b"x")])
        if raised is p.ProtocolError:
            assert "reply for request 7, expected 1" in str(info.value)
    asyncio.run(run())


def _recv_exact(sock, nbytes):
    chunks, left = [], nbytes
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _shut(*socks):
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv on it
        except OSError:
            pass
        s.close()


class ReplyDroppingProxy:
    """A TCP proxy in front of the daemon: ``drop_next(op)`` makes it cut the
    connection instead of forwarding the next reply to ``op`` (the daemon
    applied the request; its answer is lost); ``cut_all()`` drops every
    connection, as a daemon restart would."""

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._drop_op = None
        self.dropped = 0
        self._pairs = []
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._listener.close()
        self.cut_all()

    def drop_next(self, op):
        self._drop_op = op | p.REPLY_BIT

    def cut_all(self):
        for pair in self._pairs:
            _shut(*pair)

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            daemon = socket.create_connection(self._target)
            self._pairs.append((client, daemon))
            threading.Thread(target=self._requests, args=(client, daemon), daemon=True).start()
            threading.Thread(target=self._replies, args=(daemon, client), daemon=True).start()

    def _requests(self, client, daemon):
        try:
            while data := client.recv(1 << 16):
                daemon.sendall(data)
        except OSError:
            pass
        _shut(daemon)

    def _replies(self, daemon, client):
        try:
            while (head := _recv_exact(daemon, f.FRAME_HEADER_SIZE)) is not None:
                _, _, op, _, _, _, meta_len, payload_len, _, _ = f.FRAME_HEADER.unpack(head)
                body = _recv_exact(daemon, meta_len + payload_len)
                if op == self._drop_op:
                    self._drop_op = None
                    self.dropped += 1
                    break
                client.sendall(head + body)
        except OSError:
            pass
        _shut(client, daemon)


def test_a_delete_whose_reply_was_lost_is_not_repeated(kvtierd):
    """A repeat would answer "not found" for the keys the first one deleted."""
    keys = keys_of(3, 14)
    with BlockClient(kvtierd.data_addr) as direct:
        direct.put_many([(k, make_block(k, 100)) for k in keys])
    with ReplyDroppingProxy(kvtierd.data_addr) as proxy, BlockClient(proxy.addr, pool_size=1) as c:
        assert c.lookup(keys) == 3  # a pooled connection
        proxy.drop_next(p.Op.DELETE)
        with pytest.raises(ConnectionLost, match="not repeated"):
            c.delete(keys[0])
        assert proxy.dropped == 1 and c.lookup(keys[:1]) == 0  # it was applied
        proxy.drop_next(p.Op.PIN)  # PIN reports presence, so its repeat answers the same
        assert c.pin(keys[1:2]) == [True] and proxy.dropped == 2
        proxy.cut_all()  # a pooled connection the daemon closed is replaced before the DELETE goes out
        (pooled,) = list(c._pool.queue)
        assert select.select([pooled.sock], [], [], 5)[0]  # its FIN has arrived
        assert c.delete_many(keys[1:]) == [True, True]
        assert c.statistics().reconnects == 2


def test_async_client_does_not_repeat_a_delete_whose_reply_was_lost(kvtierd):
    key = keys_of(1, 15)[0]
    with BlockClient(kvtierd.data_addr) as direct:
        direct.put(key, make_block(key, 100))

    async def run(proxy):
        async with AsyncBlockClient(proxy.addr, pool_size=1) as c:
            assert await c.lookup([key]) == 1
            proxy.drop_next(p.Op.DELETE)
            with pytest.raises(ConnectionLost, match="not repeated"):
                await c.delete(key)
            assert await c.lookup([key]) == 0 and await c.delete(key) is False
    with ReplyDroppingProxy(kvtierd.data_addr) as proxy:
        asyncio.run(run(proxy))
