"""vLLM 0.33's per-layer KV tensors as 5-axis views for :mod:`kvtier.kernels.paged`.

vLLM 0.33 (RFC #42082) hands every layer's cache to connectors as a logical
``[B, H, N, C]`` view (blocks, KV heads, tokens per block, content) whose
content ``C = 2 * head_size`` holds K and V. Where K and V sit inside C is
the attention backend's convention:

    GPU backends (FLASH_ATTN, TRITON_ATTN, FLASHINFER, ...):
        C = [K | V] per token   -> split the last axis:   [B, H, N, 2, D]
    CPU_ATTN (vllm/v1/attention/backends/cpu_attn.py):
        the block's [N, 2D] rows are read as [2N, D]: all N keys, then all N values
                                 -> view as               [B, H, 2, N, D]

:func:`paged_view` returns those 5-axis views (no copy; writes go through to
vLLM's cache) and the :class:`PagedLayout` naming their axes, which is what
``gather_blocks`` / ``scatter_blocks`` take.

CPU_ATTN's kernels may pack a block's interior for the CPU's matrix ISA; a
CPU vLLM's blocks are therefore kept in their own namespace (``page_family``)
and round-trip byte for byte, but are not shared with other engines.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtier.kernels.paged import PagedLayout

PAGE_FAMILIES = ("kv_last", "cpu")
_LAYOUTS = {
    "kv_last": PagedLayout(("block", "head", "token", "kv", "dim")),
    "cpu": PagedLayout(("block", "head", "kv", "token", "dim")),
}


@dataclass(frozen=True)
class PagedGeometry:
    """What the namespace's layout says one layer's cache must look like."""

    num_kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: str  # "float16", "bfloat16", "float32"


def paged_layout(family: str) -> PagedLayout:
    if family not in _LAYOUTS:
        raise ValueError(f"page family must be one of {PAGE_FAMILIES}, got {family!r}")
    return _LAYOUTS[family]


def paged_view(layer, family: str, geo: PagedGeometry):
    """One layer's ``[B, H, N, 2D]`` cache as a 5-axis view (see the module doc).

    ValueError when the tensor does not have the geometry of the namespace."""
    shape = tuple(layer.shape)
    want = (geo.num_kv_heads, geo.block_tokens, 2 * geo.head_dim)
    if len(shape) != 4 or shape[1:] != want:
        raise ValueError(f"vLLM KV cache layer of shape {shape}; expected [num_blocks, {want[0]}, {want[1]}, "
                         f"{want[2]}] (heads, block tokens, 2 x head size)")
    dtype = str(layer.dtype).removeprefix("torch.")
    if dtype != geo.dtype:
        raise ValueError(f"vLLM KV cache layer dtype {dtype}, namespace dtype {geo.dtype}")
    b = shape[0]
    if family == "kv_last":
        return layer.unflatten(-1, (2, geo.head_dim))
    if family == "cpu":
        if layer.stride(-1) != 1 or layer.stride(-2) != 2 * geo.head_dim:
            raise ValueError(f"CPU_ATTN cache with strides {layer.stride()} cannot be read as [2N, D] rows")
        return layer.view(b, geo.num_kv_heads, 2, geo.block_tokens, geo.head_dim)
    raise ValueError(f"page family must be one of {PAGE_FAMILIES}, got {family!r}")
