"""The engine data path: pooled load outputs, GET replies scattered into place, saves that
skip what the daemon holds. Real daemons, real sockets."""
from __future__ import annotations

import resource

import pytest
import torch

from daemon_proc import start_kvtierd
from kvtier.client import block_encoder
from kvtier.client.kvcache import KVCache
from kvtier.client.output_buffers import OutputBuffers, buffer_exported, tensor_over
from kvtier.common.keys import KVLayout, Namespace

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)
# large enough blocks that page faults show: 4 layers x 2 x 8 heads x 256 tokens x 128 x 2 B = 4 MiB
BIG = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)
PAGE_BYTES = resource.getpagesize()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_kvtierd(tmp_path_factory.mktemp("kvtierd"), "--device-size", "256m", "--region-size", "16m")
    yield d
    assert d.stop() == 0, d.log_tail()


def ns(name: str, layout: KVLayout = LAYOUT, codec: str = "raw") -> Namespace:
    return Namespace(model=name, layout=layout, codec=codec)


def make_kv(tokens: int, seed: int = 0, layout: KVLayout = LAYOUT):
    g = torch.Generator().manual_seed(seed)
    shape = (1, layout.num_kv_heads, tokens, layout.head_dim)
    dt = getattr(torch, layout.dtype)
    return [(torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt))
            for _ in range(layout.num_layers)]


def same(layers, kv) -> bool:
    return all(torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(layers, kv))


# --- output buffers (no daemon) ---------------------------------------------------
def _buffer_of(held):
    """The pooled mmap under an array from OutputBuffers.take."""
    return held.base.obj if isinstance(held.base, memoryview) else held.base


def test_a_buffer_is_reused_only_once_every_tensor_over_it_is_gone():
    pool = OutputBuffers(bytes_max=1 << 20)
    first = pool.take(4096)
    buf = _buffer_of(first)
    t = tensor_over(first, (2, 1024), torch.float16)
    view = t[1]
    del t, first
    assert buffer_exported(buf)  # the view still holds it
    second = pool.take(4096)
    assert _buffer_of(second) is not buf
    del view
    assert not buffer_exported(buf)
    assert _buffer_of(pool.take(1000)) is buf  # the smallest free one that fits
    stats = pool.statistics()
    assert (stats.takes, stats.reused, stats.buffers) == (3, 1, 2)


def test_concurrent_takes_never_share_a_buffer():
    """The export is taken under the pool's lock: threads racing for free buffers each get their own."""
    import threading

    pool = OutputBuffers(bytes_max=1 << 20)
    for held in [pool.take(4096) for _ in range(4)]:
        del held  # four free buffers
    barrier = threading.Barrier(8)
    taken = []

    def grab():
        barrier.wait()
        taken.append(pool.take(4096))

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(_buffer_of(h)) for h in taken}) == 8


def test_the_pool_keeps_no_more_than_its_limit():
    pool = OutputBuffers(bytes_max=10_000)
    held = [pool.take(4000) for _ in range(3)]  # in use; the third is not kept
    assert pool.statistics().bytes_kept == 8000
    del held
    big = pool.take(9000)  # idle buffers make room for it
    buf = _buffer_of(big)
    del big
    assert pool.statistics().bytes_kept == 9000 and _buffer_of(pool.take(9000)) is buf
    with pytest.raises(ValueError, match="bytes_max"):
        OutputBuffers(bytes_max=-1)


# --- loads -------------------------------------------------------------------------
def test_a_steady_state_load_faults_almost_no_pages_and_decodes_nothing(daemon, monkeypatch):
    """Raw blocks land straight in a pooled output: no page to fault in, no payload to copy."""
    tokens = list(range(4 * BIG.block_tokens))
    kv = make_kv(len(tokens), seed=1, layout=BIG)
    with KVCache(ns("faults", BIG), daemon.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
        assert cache.store(tokens, kv) == 4
        for _ in range(2):  # warms the output pool and the connections' buffers
            got = cache.load(tokens)
            assert same(got.layers, kv)
            del got
        decoded = []
        real = cache._decoder._decode_object
        monkeypatch.setattr(cache._decoder, "_decode_object", lambda data, out: decoded.append(1) or real(data, out))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        got = cache.load(tokens)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert same(got.layers, kv) and got.blocks_warm == 4
        assert decoded == []  # every block landed in place (received there, verified there)
        assert cache._outputs.buffers.statistics().reused >= 2
    loaded_pages = 4 * BIG.block_raw_bytes // PAGE_BYTES
    assert faults < loaded_pages // 20, f"{faults} minor faults for {loaded_pages} pages loaded"


def test_a_corrupt_block_landed_in_place_ends_the_prefix(daemon, tmp_path):
    """A block whose bytes on flash were damaged lands in the output, fails its CRC there, and
    the load stops before it (the daemon then drops its copy: a later load misses it)."""
    from daemon_proc import device_map_of

    tokens = list(range(50_000, 50_000 + 3 * BIG.block_tokens))
    kv = make_kv(len(tokens), seed=5, layout=BIG)
    d = start_kvtierd(tmp_path, "--device-size", "64m", "--region-size", "16m")
    try:
        with KVCache(ns("corrupt-landed", BIG), d.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
            assert cache.store(tokens, kv, durable=True) == 3
            keys = cache.keys_for(tokens)
            _, locs = cache._warm.daemons[0].client.lookup_locations(keys, ns_id=cache.namespace.id)
            geometry = cache._warm.daemons[0].client.geometry()
            paths = device_map_of(d)
            damage_at = locs[1].logical_offset + locs[1].length - 100  # inside block 1's payload
            ((index, offset, _),) = geometry.map_range(damage_at, 1)
            with open(paths[geometry.device_ids[index]], "r+b") as fh:
                fh.seek(offset)
                byte = fh.read(1)
                fh.seek(offset)
                fh.write(bytes([byte[0] ^ 0xFF]))
            d.restart()  # no page cache of the undamaged bytes
            got = cache.load(tokens)
            assert got.num_tokens == BIG.block_tokens  # block 0 only
            assert same(got.layers, [(k[:, :, :BIG.block_tokens], v[:, :, :BIG.block_tokens]) for k, v in kv])
    finally:
        d.stop()


def test_a_held_load_is_never_overwritten_by_the_next(daemon):
    a, b = list(range(100, 116)), list(range(200, 216))
    kv_a, kv_b = make_kv(16, seed=2), make_kv(16, seed=3)
    with KVCache(ns("held"), daemon.data_addr, hot_pool_bytes=0) as cache:
        cache.store(a, kv_a)
        cache.store(b, kv_b)
        got_a = cache.load(a)
        got_b = cache.load(b)
        assert same(got_a.layers, kv_a) and same(got_b.layers, kv_b)
        keep = got_a.layers[0][0]  # one view of a's output keeps all of it
        del got_a
        again = cache.load(b)
        assert torch.equal(keep, kv_a[0][0]) and same(again.layers, kv_b)


# --- saves ---------------------------------------------------------------------------
def test_a_write_behind_save_seals_only_the_blocks_the_daemon_lacks(daemon, monkeypatch):
    tokens = list(range(300, 340))
    kv = make_kv(40, seed=4)
    headers = []
    real = block_encoder.encode_header

    def counted(key, *args):
        headers.append(bytes(key))
        return real(key, *args)
    with KVCache(ns("seal-new"), daemon.data_addr, hot_pool_bytes=0) as cache:
        assert cache.store(tokens[:24], [(k[:, :, :24], v[:, :, :24]) for k, v in kv]) == 3
        monkeypatch.setattr(block_encoder, "encode_header", counted)
        assert cache.store_async(tokens, kv).result(30) == 2
        keys = cache.keys_for(tokens)
        assert headers == keys[3:]  # the three stored blocks were neither checksummed nor sent
        assert same(cache.load(tokens).layers, kv)


# --- scatter: GET reply payloads straight into the destination --------------------
def _scatter_wire():
    from kvtier.common.blockformat import encode_block
    from kvtier.wire import connection as p

    ns_id = b"n" * 16
    blocks = [encode_block(bytes([i]) * 16, ns_id, 0, bytes(range(i, i + 48)) * 4) for i in range(2)]
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    client.send(p.Get(7, (b"\0" * 16, b"\1" * 16, b"\2" * 16)))
    wire = server.send(p.GetReply(7, (blocks[0], None, blocks[1])))
    return p, client, wire, blocks


@pytest.mark.parametrize("step", [1, 7, 31])
def test_a_scattered_payload_is_received_in_order_into_its_pieces(step):
    p, client, wire, blocks = _scatter_wire()
    pos = 0
    while client.pending_head is None:  # the header and meta, fed in steps
        client.receive_data(wire[pos:pos + step])
        pos += step
        assert client.next_event() is p.NEED_DATA
    heads = [bytearray(70), bytearray(70)]
    outs = [bytearray(len(b) - 70) for b in blocks]
    views = [memoryview(heads[0]), memoryview(outs[0])[:100], memoryview(outs[0])[100:],
             memoryview(heads[1]), memoryview(outs[1])]
    client.set_payload_buffers(views)  # bytes that came with the meta are copied in
    while (pieces := client.payload_views()) is not None:  # what recvmsg_into would do
        for view in pieces:
            n = min(step, view.nbytes, len(wire) - pos)
            view[:n] = wire[pos:pos + n]
            pos += n
            client.payload_received(n)
            if n < view.nbytes:
                break
    reply = client.next_event()
    assert isinstance(reply, p.GetReply) and reply.blocks[1] is None
    for i, got in ((0, reply.blocks[0]), (1, reply.blocks[2])):
        assert isinstance(got, tuple) and b"".join(bytes(v) for v in got) == blocks[i]
    assert bytes(heads[0]) + bytes(outs[0]) == blocks[0] and bytes(heads[1]) + bytes(outs[1]) == blocks[1]


@pytest.mark.parametrize("cap", [1, 5, 64, 1000])
def test_a_scattered_payload_is_received_at_most_receive_bytes_max_at_a_time(cap):
    from kvtier.wire.payload_pieces import PayloadPieces

    p, client, wire, blocks = _scatter_wire()
    client.receive_data(wire[:p.FRAME_HEADER_SIZE + 3 * 4])  # the header and meta only
    assert client.next_event() is p.NEED_DATA
    pos = len(wire) - sum(len(b) for b in blocks)
    heads, outs = [bytearray(70), bytearray(70)], [bytearray(len(b) - 70) for b in blocks]
    client.set_payload_buffers([memoryview(heads[0]), memoryview(outs[0])[:100], memoryview(outs[0])[100:],
                                memoryview(heads[1]), memoryview(outs[1])], receive_bytes_max=cap)
    while (pieces := client.payload_views()) is not None:  # recvmsg_into filling every view
        room = sum(view.nbytes for view in pieces)
        assert room == min(cap, len(wire) - pos)
        for view in pieces:
            view[:] = wire[pos:pos + view.nbytes]
            pos += view.nbytes
        client.payload_received(room)
        assert client.payload_filled == pos - (len(wire) - sum(len(b) for b in blocks))
    assert isinstance(client.next_event(), p.GetReply) and client.payload_filled == 0
    assert bytes(heads[0]) + bytes(outs[0]) == blocks[0] and bytes(heads[1]) + bytes(outs[1]) == blocks[1]
    with pytest.raises(ValueError, match="receive_bytes_max"):
        PayloadPieces([bytearray(4)], receive_bytes_max=0)


@pytest.mark.parametrize("cut", [None, 300])
def test_receive_payload_takes_the_rest_of_a_scattered_payload_off_a_socket(cut):
    """Whole, each receive reported with the bytes in so far; cut short, the end of the stream
    reaches the parser, which calls the frame truncated."""
    import socket

    from kvtier.wire.sockets import receive_payload

    p, client, wire, blocks = _scatter_wire()
    head_and_meta = p.FRAME_HEADER_SIZE + 3 * 4
    client.receive_data(wire[:head_and_meta])
    assert client.next_event() is p.NEED_DATA
    outs = [bytearray(len(b)) for b in blocks]
    client.set_payload_buffers([memoryview(outs[0]), memoryview(outs[1])], receive_bytes_max=64)
    reports: list[int] = []
    a, b = socket.socketpair()
    with a, b:
        b.sendall(wire[head_and_meta:] if cut is None else wire[head_and_meta:head_and_meta + cut])
        b.close()
        receive_payload(a, client, reports.append)
    if cut is None:
        assert reports == sorted(reports) and reports[-1] == len(wire) - head_and_meta
        assert isinstance(client.next_event(), p.GetReply) and outs == [bytearray(b) for b in blocks]
    else:
        assert reports[-1] == cut
        with pytest.raises(p.ProtocolError, match="truncated"):
            client.next_event()


def _fold_reply(wire: bytes, plan, client, step: int, report_every: int = 1) -> object:
    """Feed a GET reply for request 7 through ``client`` into ``plan``'s views, ``step`` bytes a
    receive, telling the plan what landed after every ``report_every``-th receive."""
    from kvtier.wire import connection as p

    pos = 0
    while client.pending_head is None:
        client.receive_data(wire[pos:pos + 1])
        pos += 1
        assert client.next_event() is p.NEED_DATA
    client.set_payload_buffers(plan.views_for(7, client.pending_meta), receive_bytes_max=step)
    receives = 0
    while (pieces := client.payload_views()) is not None:
        for view in pieces:
            view[:] = wire[pos:pos + view.nbytes]
            pos += view.nbytes
        client.payload_received(sum(view.nbytes for view in pieces))
        receives += 1
        if receives % report_every == 0:
            plan.landed(client.payload_filled)
    return client.next_event()


@pytest.mark.parametrize("step, report_every", [(1, 1), (7, 1), (100, 3), (10_000, 1), (33, 1_000_000)])
def test_a_scatter_plan_folds_each_landed_blocks_crc_once_as_its_bytes_arrive(step, report_every):
    from kvtier.client.scatter_plan import LandedBlock, ScatterPlan, verify_landed
    from kvtier.common.blockformat import encode_block
    from kvtier.wire import connection as p

    ns_id, keys = b"n" * 16, [bytes([i]) * 16 for i in range(3)]
    payloads = [bytes(range(i, i + 200)) * 3 for i in range(3)]
    blocks = [encode_block(keys[0], ns_id, 0, payloads[0]), None, encode_block(keys[2], ns_id, 0, payloads[2][:50])]
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    client.send(p.Get(7, tuple(keys)))
    wire = server.send(p.GetReply(7, tuple(blocks)))
    targets = [[memoryview(bytearray(300)), memoryview(bytearray(292))] for _ in range(3)]  # block 2 lands apart
    plan = ScatterPlan(72, targets)
    plan.expect([[0, 1, 2]])
    plan.sent(7)
    reply = _fold_reply(wire, plan, client, step, report_every)
    got = verify_landed(reply.blocks[0], keys[0], 72, plan.payload_crc(0))
    assert isinstance(got, LandedBlock) and bytes(targets[0][0]) + bytes(targets[0][1]) == payloads[0][8:]
    assert plan.payload_crc(2) is None and bytes(reply.blocks[2][0]) == blocks[2]  # apart: checked whole
    stats = plan.statistics()
    assert stats.bytes_on_arrival + stats.bytes_at_check == len(payloads[0])  # every payload byte, once
    if report_every == 1:
        assert stats.bytes_at_check == 0  # all folded as they landed
    elif report_every > len(wire):
        assert stats.bytes_on_arrival == 0  # never told: all folded at the check


def test_a_block_corrupted_on_the_wire_fails_its_folded_crc():
    from kvtier.client.scatter_plan import ScatterPlan, verify_landed
    from kvtier.common.blockformat import encode_block
    from kvtier.wire import connection as p

    key, ns_id = b"k" * 16, b"n" * 16
    block = encode_block(key, ns_id, 0, bytes(range(256)) * 4)
    client, server = p.Connection(p.Role.CLIENT), p.Connection(p.Role.SERVER)
    client.send(p.Get(7, (key,)))
    wire = bytearray(server.send(p.GetReply(7, (block,))))
    wire[-100] ^= 1  # a flipped bit in the payload's last target
    plan = ScatterPlan(72, [[memoryview(bytearray(500)), memoryview(bytearray(1024 + 8 - 500))]])
    plan.expect([[0]])
    plan.sent(7)
    reply = _fold_reply(bytes(wire), plan, client, 64)
    assert verify_landed(reply.blocks[0], key, 72, plan.payload_crc(0)) is None


def test_payload_pieces_must_add_up_and_be_writable():
    from kvtier.wire.frames import FRAME_HEADER_SIZE

    p, client, wire, _ = _scatter_wire()
    head_and_meta = FRAME_HEADER_SIZE + 3 * 4
    client.receive_data(wire[:head_and_meta])
    assert client.next_event() is p.NEED_DATA and client.pending_head is not None
    with pytest.raises(ValueError, match="payload pieces of 10 bytes"):
        client.set_payload_buffers([bytearray(10)])
    with pytest.raises(ValueError, match="read-only"):
        client.set_payload_buffers([b"x" * (len(wire) - head_and_meta)])


def test_get_many_into_lands_blocks_in_place_and_verifies_them_there(daemon):
    import numpy as np

    from kvtier.client import BlockClient
    from kvtier.client.scatter_plan import LandedBlock
    from kvtier.common.blockformat import encode_block

    ns_id = b"s" * 16
    half = 128 << 10  # past the client's first receive chunk: most of each block lands by recvmsg_into
    payloads = [np.random.default_rng(i).integers(0, 255, 8 + 2 * half, dtype=np.uint8).tobytes() for i in range(3)]
    keys = [bytes([0x40 + i]) * 16 for i in range(3)]
    with BlockClient(daemon.data_addr) as c:
        c.put_many([(k, encode_block(k, ns_id, 0, pl)) for k, pl in zip(keys[:2], payloads)], ns_id=ns_id)
        c.put(keys[2], encode_block(keys[2], ns_id, 0, payloads[2][:100]))  # another size: lands apart
        out = np.zeros((3, 2, half), np.uint8)  # each block's payload bytes past 8 go to out[i] in two halves
        targets = [[memoryview(out[i, 0]), memoryview(out[i, 1])] for i in range(3)]
        missing = bytes([0x7f]) * 16
        got = c.get_many_into(keys + [missing], targets + [[memoryview(bytearray(2 * half))]], head_nbytes=64 + 8,
                              ns_id=ns_id)
        assert [type(g) for g in got[:2]] == [LandedBlock, LandedBlock] and got[3] is None
        for i in range(2):
            assert out[i].tobytes() == payloads[i][8:] and bytes(got[i].head[64:]) == payloads[i][:8]
        assert not isinstance(got[2], LandedBlock) and bytes(got[2][64:]) == payloads[2][:100]
        assert not out[2].any()


def test_get_many_into_makes_a_blocks_targets_when_its_reply_comes(daemon):
    """Targets given as functions: called for the blocks that came (once each), never for a miss."""
    import numpy as np

    from kvtier.client import BlockClient
    from kvtier.client.scatter_plan import LandedBlock
    from kvtier.common.blockformat import encode_block

    ns_id = b"m" * 16
    payloads = [np.random.default_rng(20 + i).integers(0, 255, 8 + (64 << 10), dtype=np.uint8).tobytes()
                for i in range(2)]  # past the first receive chunk: the reply lands in the targets
    keys = [bytes([0x60 + i]) * 16 for i in range(2)] + [bytes([0x6f]) * 16]  # the last is a miss
    out = np.zeros((3, 64 << 10), np.uint8)
    made: list[int] = []

    def target(i: int):
        made.append(i)
        return [memoryview(out[i])]
    with BlockClient(daemon.data_addr) as c:
        c.put_many([(k, encode_block(k, ns_id, 0, pl)) for k, pl in zip(keys, payloads)], ns_id=ns_id)
        got = c.get_many_into(keys, [lambda i=i: target(i) for i in range(3)], head_nbytes=64 + 8, ns_id=ns_id)
    assert [type(g) for g in got[:2]] == [LandedBlock, LandedBlock] and got[2] is None
    assert sorted(made) == [0, 1] and all(out[i].tobytes() == payloads[i][8:] for i in range(2))


def test_a_get_into_place_reads_each_landed_byte_once_for_its_crc_as_it_arrives(daemon):
    """recv + one CRC pass: every payload byte of the blocks landed in place is folded into
    their CRCs right after its receive, none at the check, none twice."""
    import numpy as np

    from kvtier.client import BlockClient
    from kvtier.client import transport_ops as ops
    from kvtier.client.scatter_plan import FOLD_RECEIVE_BYTES_MAX, LandedBlock, ScatterPlan
    from kvtier.common.blockformat import encode_block

    ns_id = b"f" * 16
    half = FOLD_RECEIVE_BYTES_MAX * 3 // 2  # each block takes several receives
    payloads = [np.random.default_rng(10 + i).integers(0, 255, 8 + 2 * half, dtype=np.uint8).tobytes()
                for i in range(3)]
    keys = [bytes([0x50 + i]) * 16 for i in range(3)]
    out = np.zeros((3, 2, half), np.uint8)
    with BlockClient(daemon.data_addr) as c:
        c.put_many([(k, encode_block(k, ns_id, 0, pl)) for k, pl in zip(keys, payloads)], ns_id=ns_id)
        plan = ScatterPlan(64 + 8, [[memoryview(out[i, 0]), memoryview(out[i, 1])] for i in range(3)])
        got, corrupt = c._call(lambda: ops.op_get_into(keys, ns_id, c.limits, plan, c._reader_verifies), into=plan)
    assert corrupt == 0 and all(isinstance(g, LandedBlock) for g in got)
    assert all(out[i].tobytes() == payloads[i][8:] for i in range(3))
    assert plan.statistics().bytes_on_arrival == sum(len(pl) for pl in payloads)
    assert plan.statistics().bytes_at_check == 0


def test_a_landed_block_is_checked_over_the_bytes_where_it_landed():
    from kvtier.client.scatter_plan import LandedBlock, verify_landed
    from kvtier.common.blockformat import encode_block

    key = b"k" * 16
    block = bytearray(encode_block(key, b"n" * 16, 0, bytes(range(256)) * 64))
    head, first, second = memoryview(block)[:72], memoryview(block)[72:5000], memoryview(block)[5000:]
    assert isinstance(verify_landed((head, first, second), key, 72), LandedBlock)
    assert verify_landed((head, first, second), b"x" * 16, 72) is None  # another key
    assert verify_landed((head, first), key, 72) is None  # short
    block[6000] ^= 1  # one flipped bit in the second target
    assert verify_landed((head, first, second), key, 72) is None
    block[6000] ^= 1
    block[70] ^= 1  # in the codec header part of the head scratch
    assert verify_landed((head, first, second), key, 72) is None


def test_concurrent_loads_each_get_their_own_bytes(daemon):
    """Threads loading at once from one KVCache over the pooled outputs: every block exact."""
    import threading

    space = ns("concurrent-loads")
    keys = space.keys(list(range(64 * LAYOUT.block_tokens)))
    g = torch.Generator().manual_seed(7)
    blocks = [torch.randn(LAYOUT.block_shape, generator=g).half() for _ in keys]
    wrong = []
    with KVCache(space, [daemon.data_addr], hot_pool_bytes=0) as cache:
        cache.store_blocks(keys, blocks)
        cache.flush()

        def load(first: int):
            for _ in range(5):
                got = cache.load_blocks(keys[first:first + 32])
                wrong.extend(i for i, (a, b) in enumerate(zip(got, blocks[first:first + 32]))
                             if a is None or not torch.equal(a, b))

        threads = [threading.Thread(target=load, args=(first,)) for first in (0, 32, 0, 32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert wrong == []
