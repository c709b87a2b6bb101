"""Paged gather/scatter: byte-exact round trips for every backend layout (torch on CPU, CuPy under gpu)."""
from __future__ import annotations

import pytest
import torch

from cuda_reason import cuda_skip_reason
from kvtier.kernels.paged import FLASH_ATTN, FLASHINFER, HND, PagedLayout, gather_blocks, scatter_blocks

LAYOUTS = {"flash_attn": FLASH_ATTN, "flashinfer": FLASHINFER, "hnd": HND}
SIZES = {"block": 12, "kv": 2, "token": 16, "head": 3, "dim": 8}


def make_layers(layout, dtype, num_layers=4, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = [SIZES[a] for a in layout.axes]
    bits = torch.randint(-(2**15), 2**15, [num_layers, *shape], generator=g, dtype=torch.int32).to(torch.int16)
    layers = [b.view(torch.float16) for b in bits]  # any bit pattern, NaNs included: copies must be exact
    if dtype == torch.uint8:
        layers = [t.view(torch.uint8)[..., : SIZES["dim"]].contiguous() for t in layers]
    elif dtype != torch.float16:
        layers = [t.view(torch.int16).view(dtype) if dtype == torch.bfloat16 else t.float() for t in layers]
    return [t.to(device) for t in layers]


def expected_block(layers, layout, block):
    """[L, 2, H, T, D] of one block, built by plain indexing (independent of the implementation)."""
    per_layer = []
    for t in layers:
        index = [slice(None)] * 5
        index[layout.axes.index("block")] = block
        view = t[tuple(index)]
        rest = [a for a in layout.axes if a != "block"]
        per_layer.append(view.permute([rest.index(a) for a in ("kv", "head", "token", "dim")]))
    return torch.stack(per_layer)


def raw_bytes(t):
    return t.contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8], ids=str)
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_gather_matches_indexing_and_scatter_round_trips(layout_name, dtype):
    layout = LAYOUTS[layout_name]
    layers = make_layers(layout, dtype)
    ids = [7, 0, 11, 3]
    buf = gather_blocks(layers, ids, layout)
    assert buf.shape == (4, 4, 2, SIZES["head"], SIZES["token"], SIZES["dim"])
    for n, block in enumerate(ids):
        assert torch.equal(raw_bytes(buf[n]), raw_bytes(expected_block(layers, layout, block)))
    fresh = [torch.zeros_like(t) for t in layers]
    scatter_blocks(buf, fresh, ids, layout)
    bidx = layout.axes.index("block")
    for t, f in zip(layers, fresh):
        for block in range(SIZES["block"]):
            a, b = t.select(bidx, block), f.select(bidx, block)
            if block in ids:
                assert torch.equal(raw_bytes(a), raw_bytes(b))
            else:
                assert not raw_bytes(b).any()


def test_gather_into_a_given_buffer_and_repeated_ids():
    layers = make_layers(FLASH_ATTN, torch.float16)
    out = torch.empty(3, 4, 2, 3, 16, 8, dtype=torch.float16)
    assert gather_blocks(layers, torch.tensor([5, 5, 2]), FLASH_ATTN, out=out) is out
    assert torch.equal(raw_bytes(out[0]), raw_bytes(out[1]))


def test_bad_arguments():
    layers = make_layers(FLASH_ATTN, torch.float16)
    with pytest.raises(ValueError, match=r"block ids 0..12 outside 0..11"):
        gather_blocks(layers, [0, 12], FLASH_ATTN)
    with pytest.raises(ValueError, match="block ids -1"):
        gather_blocks(layers, [-1], FLASH_ATTN)
    with pytest.raises(ValueError, match="empty"):
        gather_blocks(layers, [], FLASH_ATTN)
    buf = gather_blocks(layers, [1, 2], FLASH_ATTN)
    with pytest.raises(ValueError, match="repeats a block"):
        scatter_blocks(torch.cat([buf[:1], buf[:1]]), layers, [1, 1], FLASH_ATTN)
    with pytest.raises(ValueError, match="block buffer shape"):
        scatter_blocks(buf[:1], layers, [1, 2], FLASH_ATTN)
    with pytest.raises(ValueError, match="block buffer is torch.float32"):
        scatter_blocks(buf.float(), layers, [1, 2], FLASH_ATTN)
    with pytest.raises(ValueError, match="'kv' axis has size 12"):
        gather_blocks(layers, [0], FLASHINFER)
    with pytest.raises(ValueError, match="layer 1 is"):
        gather_blocks([layers[0], layers[1].float()], [0], FLASH_ATTN)
    with pytest.raises(ValueError, match="must order exactly the axes"):
        PagedLayout(("kv", "block", "token", "head", "head"))
    with pytest.raises(ValueError, match="has 4 dims"):
        gather_blocks([layers[0][0]], [0], FLASH_ATTN)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8], ids=str)
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_cuda_kernel_matches_torch_reference(layout_name, dtype):
    layout = LAYOUTS[layout_name]
    cpu = make_layers(layout, dtype)
    gpu = [t.cuda() for t in cpu]
    ids = [7, 0, 11, 3]
    ref = gather_blocks(cpu, ids, layout)
    got = gather_blocks(gpu, ids, layout)
    assert torch.equal(raw_bytes(got), raw_bytes(ref))
    fresh = [torch.zeros_like(t) for t in gpu]
    scatter_blocks(got, fresh, ids, layout)
    ref_fresh = [torch.zeros_like(t) for t in cpu]
    scatter_blocks(ref, ref_fresh, ids, layout)
    for a, b in zip(fresh, ref_fresh):
        assert torch.equal(raw_bytes(a), raw_bytes(b))
