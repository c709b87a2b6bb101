"""The store path: chunks gathered while earlier ones are on the wire, raw host blocks sent from the
engine's own tensors, and loads into the caller's output."""
import gc
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier.client.block_encoder import BlockEncoder  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.client.store_pipeline import chunk_bounds, run_pipelined  # noqa: E402
from kvtier.common.blockformat import encode_block, verify_block  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
from kvtier.kernels import get_codec  # noqa: E402
from kvtier.wire import connection as p  # noqa: E402
from kvtier.wire.sockets import sendmsg_all  # noqa: E402
from kvtier.wire.writers import encode_message  # noqa: E402

from daemon_proc import start_kvtierd  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)


def _kv(layout: KVLayout, tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(1, layout.num_kv_heads, tokens, layout.head_dim, generator=gen).to(torch.float16)
                  for _ in range(2)) for _ in range(layout.num_layers)]


def test_chunks_cover_every_block_once():
    assert chunk_bounds(5, 32 << 20) == [(i, i + 1) for i in range(5)]  # a large block alone
    assert chunk_bounds(10, 8 << 20) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(0, 1) == []


def test_no_more_than_in_flight_sends_run_and_every_chunk_is_released():
    running, most, released = 0, 0, []
    lock = threading.Lock()

    def send(start, end, built):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.01)
        with lock:
            running -= 1
        return end - start

    with ThreadPoolExecutor(8) as pool:
        total = run_pipelined(chunk_bounds(12, 1, 1), lambda s, e: (s, e), send, released.append, pool, 3)
    assert total == 12 and most <= 3 and sorted(released) == [(i, i + 1) for i in range(12)]


def test_a_failed_send_stops_the_gathers_and_is_raised_after_the_others_end():
    built, released = [], []

    def send(start, end, chunk):
        if start == 1:
            raise ConnectionError("daemon gone")
        time.sleep(0.02)
        return 1

    def build(start, end):
        built.append(start)
        return start

    with ThreadPoolExecutor(4) as pool, pytest.raises(ConnectionError, match="daemon gone"):
        run_pipelined(chunk_bounds(50, 1, 1), build, send, released.append, pool, 2)
    assert len(built) < 50 and sorted(released) == sorted(built)


def test_a_failed_gather_releases_what_was_sent():
    released = []

    def build(start, end):
        if start == 3:
            raise ValueError("bad kv")
        return start

    with ThreadPoolExecutor(4) as pool, pytest.raises(ValueError, match="bad kv"):
        run_pipelined(chunk_bounds(6, 1, 1), build, lambda s, e, b: 1, released.append, pool, 2)
    assert sorted(released) == [0, 1, 2]


def test_blocks_sent_from_the_engine_tensors_are_the_send_buffer_bytes():
    ns = Namespace("m", LAYOUT)
    kv = _kv(LAYOUT, 50)
    keys = ns.keys(list(range(50)))
    encoder = BlockEncoder(LAYOUT, ns.id, get_codec("raw"))
    source = encoder.encode_from_source(kv, 1, keys[1:3])
    with encoder.encode(kv, 1, keys[1:3]) as reference:
        for i, (parts, block) in enumerate(zip(source.blocks, reference)):
            joined = b"".join(bytes(part) for part in parts)
            verify_block(joined, expected_key=keys[1 + i])
            assert joined == bytes(block) and parts.nbytes == len(joined)
    assert encoder.buffers.allocated == 2  # the reference's; the source blocks took none
    row = source.blocks[0][1]  # layer 0 K, head 0, block 1's tokens: a view of the engine's tensor
    assert torch.frombuffer(row, dtype=torch.float16).data_ptr() == kv[0][0][0, 0, 16:32].data_ptr()


def test_only_raw_contiguous_host_kv_is_sent_from_where_it_lies():
    ns = Namespace("m", LAYOUT)
    keys = ns.keys(list(range(32)))
    assert BlockEncoder(LAYOUT, ns.id, get_codec("int8")).encode_from_source(_kv(LAYOUT, 32), 0, keys) is None
    strided = [(k.transpose(2, 3).contiguous().transpose(2, 3), v) for k, v in _kv(LAYOUT, 32)]  # rows not contiguous
    assert BlockEncoder(LAYOUT, ns.id, get_codec("raw")).encode_from_source(strided, 0, keys) is None


def test_a_put_of_block_parts_frames_them_as_one_block_each():
    key = bytes(range(16))
    block = encode_block(key, b"n" * 16, 0, b"payload bytes")
    parts = p.BlockParts((block[:70], memoryview(block)[70:]))
    op, _, _, count, meta, payload, _ = encode_message(p.Put(1, (key,), (parts,)))
    assert op == p.Op.PUT and count == 1 and b"".join(bytes(v) for v in payload) == block
    assert meta == encode_message(p.Put(1, (key,), (block,)))[4]  # the same item length


def test_a_block_in_flight_holds_no_object_the_garbage_collector_tracks_per_row():
    """Hundreds of tracked wrappers per block in flight survive young collections and make the
    host's full collections frequent: the rows, and the PUT payload built from them, are untracked."""
    ns = Namespace("m", LAYOUT)
    kv = _kv(LAYOUT, 64)
    keys = ns.keys(list(range(64)))
    source = BlockEncoder(LAYOUT, ns.id, get_codec("raw")).encode_from_source(kv, 0, keys)
    rows = [part for parts in source.blocks for part in parts[1:]]
    assert len(rows) == 4 * LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads
    assert not any(gc.is_tracked(row) for row in rows)
    payload = encode_message(p.Put(1, tuple(keys[:4]), tuple(source.blocks)))[5]
    assert [id(part) for part in payload] == [id(part) for parts in source.blocks for part in parts]


def test_sendmsg_all_sends_every_byte_of_shaped_buffers_across_short_sends():
    rows = [np.full((64, 64), i, dtype=np.int16) + np.arange(64, dtype=np.int16) for i in range(40)]
    parts = [b"head", *rows, bytearray(b""), memoryview(b"tail")]
    expected = b"".join(bytes(memoryview(part)) for part in parts)
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # many short sends, most cutting a row
    got = bytearray()
    reader = threading.Thread(target=lambda: _read_all(right, len(expected), got))
    reader.start()
    try:
        assert sendmsg_all(left, parts) == len(expected)
    finally:
        reader.join(10)
        left.close()
        right.close()
    assert bytes(got) == expected


def test_a_payload_buffer_that_is_not_contiguous_is_refused_before_anything_is_sent():
    key = bytes(range(16))
    strided = np.arange(64, dtype=np.int16).reshape(8, 8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        p.Connection(p.Role.CLIENT).send_parts(p.Put(1, (key,), (p.BlockParts((b"h" * 64, strided)),)))


def _read_all(sock: socket.socket, nbytes: int, into: bytearray) -> None:
    while len(into) < nbytes:
        chunk = sock.recv(65536)
        if not chunk:
            return
        into += chunk


@pytest.fixture
def daemon(tmp_path):
    d = start_kvtierd(tmp_path)
    yield d
    d.stop()


def test_a_store_sends_no_copy_of_raw_host_kv_and_loads_back_into_the_callers_output(daemon):
    ns = Namespace("m", LAYOUT)
    tokens = list(range(64))
    kv = _kv(LAYOUT, 64, seed=3)
    with KVCache(ns, daemon.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
        assert cache.store(tokens, kv, durable=True) == 4
        assert all(encoder.buffers.allocated == 0 for encoder in cache._encoders)  # no gather, no send buffer
        out = torch.zeros(3, 2, 1, 2, 80, 16, dtype=torch.float16)
        got = cache.load(tokens, out=out)
        assert got.num_tokens == 64
        for (k, v), (k2, v2) in zip(kv, got.layers):
            assert k2.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
            assert torch.equal(k, k2) and torch.equal(v, v2)
        assert torch.equal(out[:, :, :, :, 64:], torch.zeros(3, 2, 1, 2, 16, 16, dtype=torch.float16))
        short = torch.zeros(3, 2, 1, 2, 40, 16, dtype=torch.float16)
        assert cache.load(tokens, out=short).num_tokens == 32  # cut to what the output holds, whole blocks
        with pytest.raises(ValueError, match="out has shape"):
            cache.load(tokens, out=torch.zeros(3, 2, 1, 3, 64, 16, dtype=torch.float16))
        with pytest.raises(ValueError, match="out is torch.float32"):
            cache.load(tokens, out=torch.zeros(3, 2, 1, 2, 64, 16))


def test_a_held_write_behind_save_copies_nothing_on_the_step_and_stores_after(daemon):
    """``store_async(copy=False)``: the call only enqueues (nothing is gathered or sent until the
    save worker runs it); then the blocks are stored from the caller's KV."""
    ns = Namespace("held", LAYOUT)
    tokens, kv = list(range(48)), _kv(LAYOUT, 48, seed=5)
    gate = threading.Event()
    with KVCache(ns, daemon.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
        blocker = cache._saves.submit(0, 0, lambda: gate.wait(30) and 0)  # the save worker is busy
        future = cache.store_async(tokens, kv, copy=False)
        assert not future.done() and cache.lookup(tokens) == 0
        assert all(encoder.buffers.allocated == 0 for encoder in cache._encoders)
        gate.set()
        blocker.result(30)
        assert future.result(30) == 3 and cache.lookup(tokens) == 48
        got = cache.load(tokens)
        assert all(torch.equal(k, k2) and torch.equal(v, v2) for (k, v), (k2, v2) in zip(kv, got.layers))
        blocks = [torch.stack([torch.stack([k[0, :, 16 * b:16 * (b + 1)], v[0, :, 16 * b:16 * (b + 1)]])
                               for k, v in kv]) for b in range(3)]
        keys = [bytes([i + 1]) * 16 for i in range(3)]
        assert cache.store_blocks_async(keys, blocks, copy=False).result(30) == 3
        assert all(encoder.buffers.allocated == 0 for encoder in cache._encoders)
        assert all(torch.equal(a, b) for a, b in zip(cache.load_blocks(keys), blocks))
