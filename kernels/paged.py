"""Gather/scatter between an engine's paged KV tensors and contiguous block buffers.

An engine (vLLM) keeps one KV tensor per layer, paged by block; backends order
the axes differently, so the layout is a parameter naming the five axes::

    FLASH_ATTN  [2, num_blocks, block_size, num_kv_heads, head_size]   ("kv", "block", "token", "head", "dim")
    FLASHINFER  [num_blocks, 2, block_size, num_kv_heads, head_size]   ("block", "kv", "token", "head", "dim")
    HND         [num_blocks, 2, num_kv_heads, block_size, head_size]   ("block", "kv", "head", "token", "dim")

A stored block is one contiguous buffer (what a codec encodes)::

    buf[n] = [num_layers, 2, num_kv_heads, block_size, head_size]   for block_ids[n]

``gather_blocks`` copies the listed blocks out of the layers into ``buf``
``[n, num_layers, 2, num_kv_heads, block_size, head_size]``; ``scatter_blocks``
writes them back. CPU tensors use torch (``index_select`` / ``index_copy_``,
one call per layer, no loop over tokens); CUDA tensors use one CuPy kernel for
all layers and blocks, copying 16-byte words where alignment allows. The launch
is asynchronous; the device arrays made for it (the layer-pointer table, the block
ids) are held until the stream has run the kernel (launch_holds.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

from .cuda_sources import PAGED_WORDS, paged_kernel_names, paged_source
from .launch_holds import LaunchHolds

AXES = frozenset({"kv", "block", "token", "head", "dim"})
CANONICAL = ("block", "kv", "head", "token", "dim")  # the order of a stored block (after the block axis)
THREADS_PER_BLOCK = 256  # plain copy kernel; no shared memory
MAX_LAYERS = 1024  # guards a corrupt layer list; far above any model
LAUNCH_HOLDS = LaunchHolds()  # each CUDA launch's pointer table and ids, until its stream has run it


@dataclass(frozen=True)
class PagedLayout:
    """The axis order of one layer's paged KV tensor."""

    axes: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.axes) != 5 or set(self.axes) != AXES:
            raise ValueError(f"paged layout {self.axes!r} must order exactly the axes {sorted(AXES)}")

    def permutation(self) -> tuple[int, ...]:
        """Axis indices that view a layer as [block, kv, head, token, dim]."""
        return tuple(self.axes.index(a) for a in CANONICAL)


FLASH_ATTN = PagedLayout(("kv", "block", "token", "head", "dim"))
FLASHINFER = PagedLayout(("block", "kv", "token", "head", "dim"))
HND = PagedLayout(("block", "kv", "head", "token", "dim"))


@dataclass(frozen=True)
class PagedGeometry:
    num_layers: int
    num_blocks: int
    heads: int
    tokens: int
    head_size: int

    def buffer_shape(self, n: int) -> tuple[int, ...]:
        return (n, self.num_layers, 2, self.heads, self.tokens, self.head_size)


def _geometry(layers: Sequence[Any], layout: PagedLayout) -> PagedGeometry:
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"need 1..{MAX_LAYERS} layer tensors, got {len(layers)}")
    first = layers[0]
    for i, t in enumerate(layers):
        if t.dim() != 5:
            raise ValueError(f"layer {i} has {t.dim()} dims; paged KV tensors have 5 ({layout.axes})")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; layer 0 is "
                             f"{tuple(first.shape)} {first.dtype} on {first.device}")
    nb, kv, heads, tokens, dim = (int(first.shape[i]) for i in layout.permutation())
    if kv != 2:
        raise ValueError(f"the 'kv' axis has size {kv}, expected 2 (keys, values) for layout {layout.axes}")
    return PagedGeometry(len(layers), nb, heads, tokens, dim)


def _block_ids(block_ids: Any, geo: PagedGeometry, device: Any, *, unique: bool) -> Any:
    import torch

    ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("block_ids is empty")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= geo.num_blocks:
        raise ValueError(f"block ids {lo}..{hi} outside 0..{geo.num_blocks - 1}")
    if unique and torch.unique(ids).numel() != ids.numel():
        raise ValueError("block_ids repeats a block; a scatter to it would be ambiguous")
    return ids.to(device)


def _check_buffer(buf: Any, geo: PagedGeometry, n: int, like: Any) -> None:
    want = geo.buffer_shape(n)
    if tuple(buf.shape) != want:
        raise ValueError(f"block buffer shape {tuple(buf.shape)}, expected {want}")
    if buf.dtype != like.dtype or buf.device != like.device:
        raise ValueError(f"block buffer is {buf.dtype} on {buf.device}; layers are {like.dtype} on {like.device}")
    if not buf.is_contiguous():
        raise ValueError("block buffer must be contiguous")


def gather_blocks(layers: Sequence[Any], block_ids: Any, layout: PagedLayout, out: Any = None) -> Any:
    """Copy ``block_ids`` out of the paged ``layers`` into ``out`` [n, L, 2, H, T, D] (allocated if None)."""
    import torch

    geo = _geometry(layers, layout)
    ids = _block_ids(block_ids, geo, layers[0].device, unique=False)
    if out is None:
        out = torch.empty(geo.buffer_shape(ids.numel()), dtype=layers[0].dtype, device=layers[0].device)
    _check_buffer(out, geo, ids.numel(), layers[0])
    if layers[0].is_cuda:
        _run_cuda("gather", layers, ids, out, geo, layout)
        return out
    perm = layout.permutation()
    for i, t in enumerate(layers):
        out[:, i].copy_(t.permute(perm).index_select(0, ids))
    return out


def scatter_blocks(buf: Any, layers: Sequence[Any], block_ids: Any, layout: PagedLayout) -> None:
    """Write ``buf`` [n, L, 2, H, T, D] into the paged ``layers`` at ``block_ids`` (distinct ids)."""
    geo = _geometry(layers, layout)
    ids = _block_ids(block_ids, geo, layers[0].device, unique=True)
    _check_buffer(buf, geo, ids.numel(), layers[0])
    if layers[0].is_cuda:
        _run_cuda("scatter", layers, ids, buf, geo, layout)
        return
    perm = layout.permutation()
    for i, t in enumerate(layers):
        t.permute(perm).index_copy_(0, ids, buf[:, i])


# ---- CUDA ----

@functools.lru_cache(maxsize=1)
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=paged_source(), options=("-std=c++17",))


def word_bytes(layers: Sequence[Any], buf: Any, layout: PagedLayout) -> int:
    """The widest copy word that divides the head row, every stride and every pointer."""
    elem = layers[0].element_size()
    dim_axis = layout.axes.index("dim")
    if layers[0].stride(dim_axis) != 1:
        raise ValueError("the CUDA paged kernel needs the head_size axis contiguous (stride 1)")
    sizes = [int(layers[0].shape[dim_axis]) * elem]
    sizes += [s * elem for s in layers[0].stride()]
    sizes += [t.data_ptr() for t in layers] + [buf.data_ptr()]
    for w in sorted(PAGED_WORDS, reverse=True):
        if w >= elem and all(s % w == 0 for s in sizes):
            return w
    return elem


def _run_cuda(op: str, layers: Sequence[Any], ids: Any, buf: Any, geo: PagedGeometry, layout: PagedLayout) -> None:
    import cupy
    import numpy as np

    w = word_bytes(layers, buf, layout)
    elem = layers[0].element_size()
    strides = {a: layers[0].stride(i) * elem // w for i, a in enumerate(layout.axes)}
    words = geo.head_size * elem // w
    name = f"kv_paged_{op}_w{w}"
    assert name in paged_kernel_names(), name
    total = ids.numel() * geo.num_layers * 2 * geo.heads * geo.tokens * words
    blocks = (total + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    device = layers[0].device.index  # a CUDA tensor's device always has an index
    stream = cupy.cuda.ExternalStream(torch_stream_ptr(layers[0]), device)
    with cupy.cuda.Device(device), stream:
        ptrs = cupy.asarray(np.array([t.data_ptr() for t in layers], np.uint64))
        ids_dev = cupy.from_dlpack(ids)
        _module().get_function(name)(
            (blocks,), (THREADS_PER_BLOCK,),
            (ptrs, np.uint64(buf.data_ptr()), ids_dev, np.int64(ids.numel()), np.int32(geo.num_layers),
             np.int32(geo.heads), np.int32(geo.tokens), np.int32(words), np.int64(strides["kv"]),
             np.int64(strides["block"]), np.int64(strides["head"]), np.int64(strides["token"])))
        ran = cupy.cuda.Event(block=False, disable_timing=True)
        ran.record(stream)
    # the launch only queued the kernel: its pointer table and ids must outlive it on the stream
    LAUNCH_HOLDS.hold(ran, (ptrs, ids_dev, ids))


def torch_stream_ptr(t: Any) -> int:
    """The current torch CUDA stream of ``t``'s device, so the copy orders with the engine's work."""
    import torch

    return torch.cuda.current_stream(t.device).cuda_stream
