"""Engine KV -> wire blocks in one pass: the same bytes as the reference path, built in
reused send buffers with no block-sized temporaries."""
import tracemalloc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier.client.block_encoder import BlockEncoder, SendBuffers  # noqa: E402
from kvtier.client.block_payload import blocks_from_kv  # noqa: E402
from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, encode_block, verify_block  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
from kvtier.kernels import get_codec  # noqa: E402

CODECS = ["raw", "int8", "fp8", "int4", "raw+lz4", "int8+lz4", "mixed"]


def _kv(layout: KVLayout, tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, layout.dtype)
    return [tuple(torch.randn(1, layout.num_kv_heads, tokens, layout.head_dim, generator=gen).to(dt)
                  for _ in range(2)) for _ in range(layout.num_layers)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("codec_name", CODECS)
def test_blocks_are_the_reference_bytes(dtype, codec_name):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, block_tokens=16)
    ns = Namespace("m", layout, codec=codec_name)
    codec = get_codec(codec_name)
    kv = _kv(layout, 50)
    keys = ns.keys(list(range(50)))
    reference = blocks_from_kv(kv, layout, 1, 2)
    encoder = BlockEncoder(layout, ns.id, codec)
    with encoder.encode(kv, 1, keys[1:3]) as blocks:
        for i, block in enumerate(blocks):
            verify_block(block, expected_key=keys[1 + i])
            assert bytes(block) == encode_block(keys[1 + i], ns.id, codec.codec_id, codec.encode(reference[i]))


def test_send_buffers_are_reused_and_aligned():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=64)
    ns = Namespace("m", layout)
    encoder = BlockEncoder(layout, ns.id, get_codec("raw"))
    kv = _kv(layout, 256)
    keys = ns.keys(list(range(256)))
    for _ in range(3):
        with encoder.encode(kv, 0, keys) as blocks:
            addresses = {np.frombuffer(b, np.uint8).ctypes.data % 4096 for b in blocks}
    assert encoder.buffers.allocated == len(keys)
    assert addresses == {0}


def test_a_raw_store_allocates_no_block_sized_temporaries():
    """The gather is the encode: building 8 blocks of 1 MiB in warm send buffers
    allocates (Python and NumPy heaps) far less than one block."""
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=128, block_tokens=256)
    ns = Namespace("m", layout)
    encoder = BlockEncoder(layout, ns.id, get_codec("raw"))
    kv = _kv(layout, 8 * 256)
    keys = ns.keys(list(range(8 * 256)))
    with encoder.encode(kv, 0, keys):
        pass  # warms the send buffers
    tracemalloc.start()
    try:
        with encoder.encode(kv, 0, keys) as blocks:
            assert len(blocks) == 8
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < layout.block_raw_bytes // 16, f"{peak} bytes allocated while encoding"


def test_send_buffers_keep_at_most_their_limit():
    pool = SendBuffers(4096, keep_bytes_max=2 * 4096)
    bufs = [pool.take() for _ in range(5)]
    pool.give_back(bufs)
    again = [pool.take() for _ in range(5)]
    assert pool.allocated == 8  # two came back from the free list, three were new
    assert all(b.nbytes == 4096 for b in again)


def test_raw_decode_lands_in_a_strided_slice():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16)
    ns = Namespace("m", layout)
    codec = get_codec("raw")
    kv = _kv(layout, 32)
    out = torch.zeros(layout.num_layers, 2, 1, layout.num_kv_heads, 32, layout.head_dim, dtype=torch.float16)
    encoder = BlockEncoder(layout, ns.id, codec)
    with encoder.encode(kv, 0, ns.keys(list(range(32)))) as blocks:
        for i, block in enumerate(blocks):
            codec.decode(block[HEADER_SIZE:], out[:, :, 0, :, i * 16:(i + 1) * 16])
    for layer, (k, v) in enumerate(kv):
        assert torch.equal(out[layer, 0], k) and torch.equal(out[layer, 1], v)


@pytest.mark.parametrize("codec_name", ["raw", "int8", "int8+lz4"])
def test_block_tensors_encode_to_the_reference_bytes(codec_name):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=16)
    ns = Namespace("m", layout, codec=codec_name)
    codec = get_codec(codec_name)
    blocks = blocks_from_kv(_kv(layout, 48), layout, 0, 3)
    keys = ns.keys(list(range(48)))
    encoder = BlockEncoder(layout, ns.id, codec)
    with encoder.encode_tensors(blocks, keys) as built:
        assert [bytes(b) for b in built] == [encode_block(k, ns.id, codec.codec_id, codec.encode(blocks[i]))
                                             for i, k in enumerate(keys)]
    with pytest.raises(ValueError, match="expected"):
        encoder.encode_tensors([blocks[0][:, :1]], keys[:1])
    with encoder.encode_tensors(blocks, keys):
        pass
    assert encoder.buffers.allocated == 3  # the failed build gave its buffer back


def test_gather_into_a_tensor_slot():
    from kvtier.client.block_encoder import gather_block

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16)
    kv = _kv(layout, 32)
    slot = torch.empty(layout.block_shape, dtype=torch.float16)
    gather_block(kv, layout, 1, slot)
    assert torch.equal(slot, blocks_from_kv(kv, layout, 1, 1)[0])


@pytest.mark.gpu
def test_pinned_send_buffers_gather_from_device_memory():
    from cuda_reason import cuda_skip_reason

    if cuda_skip_reason() is not None:
        pytest.skip(str(cuda_skip_reason()))
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=64)
    ns = Namespace("m", layout)
    kv = _kv(layout, 128)
    encoder = BlockEncoder(layout, ns.id, get_codec("raw"), pinned=True)
    keys = ns.keys(list(range(128)))
    with encoder.encode([(k.cuda(), v.cuda()) for k, v in kv], 0, keys) as on_device:
        with BlockEncoder(layout, ns.id, get_codec("raw")).encode(kv, 0, keys) as on_host:
            assert [bytes(b) for b in on_device] == [bytes(b) for b in on_host]


def test_unsealed_blocks_get_their_headers_at_seal():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16)
    ns = Namespace("m", layout)
    codec = get_codec("raw")
    kv = _kv(layout, 32)
    keys = ns.keys(list(range(32)))
    encoder = BlockEncoder(layout, ns.id, codec)
    with encoder.encode(kv, 0, keys) as sealed_now:
        expected = [bytes(b) for b in sealed_now]
    later = BlockEncoder(layout, ns.id, codec).encode(kv, 0, keys, sealed=False)  # fresh, zeroed buffers
    with pytest.raises(BlockFormatError, match="magic"):
        verify_block(later.blocks[0], expected_key=keys[0])  # no header yet
    later.seal()
    with later as blocks:
        assert [bytes(b) for b in blocks] == expected
