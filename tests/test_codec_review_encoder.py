"""BlockEncoder with the mixed and +lz4 codecs: the policy sees the sequence length, blocks fit the buffers."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvtier.client.block_encoder import BlockEncoder  # noqa: E402
from kvtier.common.blockformat import HEADER_SIZE, verify_block  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
from kvtier.kernels import MixedPrecisionPolicy, get_codec  # noqa: E402

LONG_TOKENS = 9000  # past the default policy's 8 K tokens


def _kv(layout: KVLayout, tokens: int):
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, layout.dtype)
    return [tuple(torch.randn(1, layout.num_kv_heads, tokens, layout.head_dim, generator=gen).to(dt)
                  for _ in range(2)) for _ in range(layout.num_layers)]


@pytest.mark.parametrize("codec_name", ["mixed", "mixed+lz4"])
def test_block_encoder_passes_the_sequence_length_to_the_mixed_policy(codec_name):
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_tokens=16)
    ns = Namespace("m", layout, codec=codec_name)
    codec = get_codec(codec_name, policy=MixedPrecisionPolicy(min_tokens=LONG_TOKENS))
    kv = _kv(layout, 32)
    keys = ns.keys(list(range(32)))
    encoder = BlockEncoder(layout, ns.id, codec)
    with encoder.encode(kv, 0, keys[:2], seq_tokens=LONG_TOKENS) as blocks:
        for i, block in enumerate(blocks):
            verify_block(block, expected_key=keys[i])
            out = torch.empty(layout.block_shape, dtype=torch.float16)
            codec.decode(block[HEADER_SIZE:], out)
            for layer in (0, layout.num_layers - 1):  # kept raw by the policy: exact
                want = torch.stack([kv[layer][0][0, :, i * 16:(i + 1) * 16], kv[layer][1][0, :, i * 16:(i + 1) * 16]])
                assert torch.equal(out[layer], want), f"layer {layer} of block {i} is not raw"


def test_mixed_blocks_with_raw_layers_fit_the_send_buffers():
    """A long sequence's blocks keep layers raw, so they are larger than the all-quantized probe."""
    layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_tokens=64)
    ns = Namespace("m", layout, codec="mixed")
    codec = get_codec("mixed", policy=MixedPrecisionPolicy(min_tokens=LONG_TOKENS))
    kv = _kv(layout, 64)
    encoder = BlockEncoder(layout, ns.id, codec)
    with encoder.encode(kv, 0, ns.keys(list(range(64)))[:1], seq_tokens=LONG_TOKENS) as blocks:
        out = torch.empty(layout.block_shape, dtype=torch.float16)
        codec.decode(blocks[0][HEADER_SIZE:], out)
        assert torch.equal(out[0, 0], kv[0][0][0])


@pytest.mark.parametrize("codec_name", ["raw+lz4", "int8+lz4", "fp8+lz4", "mixed+lz4"])
def test_incompressible_lz4_blocks_fit_the_send_buffers(codec_name):
    """Random KV does not compress: the lz4 stage stores the base payload, which the buffer must hold."""
    layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_tokens=64)
    ns = Namespace("m", layout, codec=codec_name)
    codec = get_codec(codec_name)
    kv = _kv(layout, 64)
    keys = ns.keys(list(range(64)))[:1]
    with BlockEncoder(layout, ns.id, codec).encode(kv, 0, keys) as blocks:
        verify_block(blocks[0], expected_key=keys[0])
        out = torch.empty(layout.block_shape, dtype=torch.float16)
        codec.decode(blocks[0][HEADER_SIZE:], out)
