"""Engine KV <-> blocks: the array a block's payload encodes.

An engine holds, per layer, K and V as ``[batch=1, kv_heads, tokens, head_dim]``
(transformers' ``DynamicCache`` layout). A block holds every layer's K and V
for ``block_tokens`` consecutive tokens, ``KVLayout.block_shape``::

    block i = [layers, 2 (K, V), kv_heads, block_tokens, head_dim]
              covering tokens [i*B, (i+1)*B)

:func:`blocks_from_kv` cuts engine KV into blocks (one gather);
:func:`kv_from_blocks` writes blocks back into per-layer tensors (one copy
per block, straight into the output). Pure tensor code, no I/O.
"""
from __future__ import annotations

from typing import Sequence

from kvtier.common.keys import KVLayout, repeated_key


def torch_dtype(layout: KVLayout):
    import torch

    return getattr(torch, layout.dtype)


def check_kv(kv: Sequence, layout: KVLayout) -> int:
    """Validate per-layer ``(k, v)`` against ``layout``; the token count.
    ValueError naming the first layer and field that does not fit."""
    if len(kv) != layout.num_layers:
        raise ValueError(f"kv has {len(kv)} layers, the namespace layout has {layout.num_layers}")
    want_dtype = torch_dtype(layout)
    tokens = None
    for i, pair in enumerate(kv):
        if len(pair) < 2:
            raise ValueError(f"kv layer {i} must be a (k, v) pair")
        for name, t in zip("kv", pair[:2]):
            shape = tuple(t.shape)
            if len(shape) != 4 or shape[0] != 1 or shape[1] != layout.num_kv_heads or shape[3] != layout.head_dim:
                raise ValueError(f"kv layer {i} {name} has shape {shape}, expected "
                                 f"[1, {layout.num_kv_heads}, tokens, {layout.head_dim}]")
            if t.dtype != want_dtype:
                raise ValueError(f"kv layer {i} {name} is {t.dtype}, the namespace layout is {layout.dtype}")
            if tokens is None:
                tokens = shape[2]
            elif shape[2] != tokens:
                raise ValueError(f"kv layer {i} {name} has {shape[2]} tokens, layer 0 has {tokens}")
    return tokens or 0


def check_blocks(keys: list[bytes], blocks: Sequence, layout: KVLayout) -> None:
    """ValueError unless there is one ``block_shape`` block of the layout's dtype per key, each key once."""
    if len(keys) != len(blocks):
        raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
    repeat = repeated_key(keys)
    if repeat is not None:
        raise ValueError(f"keys {repeat}: store each key once")
    for i, block in enumerate(blocks):
        if tuple(block.shape) != layout.block_shape:
            raise ValueError(f"block {i} has shape {tuple(block.shape)}, expected {layout.block_shape}")
        if str(block.dtype).rpartition(".")[2] != layout.dtype:
            raise ValueError(f"block {i} is {block.dtype}, the namespace layout is {layout.dtype}")


def out_tokens(out, layout: KVLayout, device) -> int:
    """The tokens a caller's load output holds: ``out`` must be an ``[L, 2, 1, H, T, D]`` tensor of
    the layout's dtype on ``device``; ValueError naming what does not fit."""
    import torch

    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch tensor [L, 2, 1, H, T, D], got {type(out).__name__}")
    want = (layout.num_layers, 2, 1, layout.num_kv_heads, layout.head_dim)
    shape = tuple(out.shape)
    if len(shape) != 6 or shape[:4] + shape[5:] != want:
        raise ValueError(f"out has shape {shape}, expected [{layout.num_layers}, 2, 1, {layout.num_kv_heads}, "
                         f"tokens, {layout.head_dim}]")
    if out.dtype != torch_dtype(layout):
        raise ValueError(f"out is {out.dtype}, the namespace layout is {layout.dtype}")
    want_device = torch.device(device)
    if out.device.type != want_device.type or want_device.index not in (None, out.device.index):
        raise ValueError(f"out is on {out.device}, the cache loads to {device}")
    return shape[4]


def blocks_from_kv(kv: Sequence, layout: KVLayout, first_block: int, num_blocks: int):
    """Blocks ``first_block .. first_block+num_blocks`` of ``kv`` as one
    contiguous tensor ``[num_blocks, *block_shape]`` on kv's device."""
    import torch

    tokens = check_kv(kv, layout)
    b = layout.block_tokens
    start, end = first_block * b, (first_block + num_blocks) * b
    if first_block < 0 or num_blocks < 0 or end > tokens:
        raise ValueError(f"blocks {first_block}..{first_block + num_blocks} need tokens up to {end}, "
                         f"kv holds {tokens}")
    # [L, 2, H, n*B, D] -> [L, 2, H, n, B, D] -> [n, L, 2, H, B, D]
    stacked = torch.stack([torch.stack((k[0, :, start:end], v[0, :, start:end])) for k, v, *_ in kv])
    shaped = stacked.view(layout.num_layers, 2, layout.num_kv_heads, num_blocks, b, layout.head_dim)
    return shaped.permute(3, 0, 1, 2, 4, 5).contiguous()


def empty_kv(layout: KVLayout, num_blocks: int, device):
    """Uninitialised output for :func:`kv_from_blocks`: ``[L, 2, 1, H, n*B, D]``."""
    import torch

    return torch.empty((layout.num_layers, 2, 1, layout.num_kv_heads, num_blocks * layout.block_tokens,
                        layout.head_dim), dtype=torch_dtype(layout), device=device)


def kv_from_blocks(blocks: Sequence, layout: KVLayout, device) -> list:
    """Per-layer ``(k, v)``, each ``[1, H, n*B, D]`` on ``device``, from the
    ``block_shape`` tensors ``blocks`` (in token order)."""
    out = empty_kv(layout, len(blocks), device)
    for i, block in enumerate(blocks):
        if tuple(block.shape) != layout.block_shape:
            raise ValueError(f"block {i} has shape {tuple(block.shape)}, expected {layout.block_shape}")
        copy_block_into(out, i, block, layout)
    return layers_of(out)


def copy_block_into(out, index: int, block, layout: KVLayout) -> None:
    """``out[:, :, 0, :, tokens of block index] = block``.

    Host tensors are copied with NumPy (bit patterns, so bf16 works too):
    one thread, no OpenMP team to wake - torch's parallel copy is slower
    for these sizes and collapses when the cores are oversubscribed. Device
    tensors use torch's copy (a kernel)."""
    b = layout.block_tokens
    copy_tensor(out[:, :, 0, :, index * b:(index + 1) * b], block)


def copy_tensor(dst, src) -> None:
    """``dst[...] = src`` (same shape and dtype); NumPy for host tensors, see
    :func:`copy_block_into`."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype:
        import numpy as np

        np.copyto(host_bits(dst), host_bits(src))
    else:
        dst.copy_(src, non_blocking=False)


def host_bits(t):
    """A NumPy view of a CPU tensor's bits (int16 / int32 by item size)."""
    import torch

    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def layers_of(out) -> list:
    """``[(k, v), ...]`` views of an ``[L, 2, 1, H, T, D]`` tensor."""
    return [(out[layer, 0], out[layer, 1]) for layer in range(out.shape[0])]


def as_tensor(block):
    import torch

    return block if isinstance(block, torch.Tensor) else torch.from_numpy(block)


def as_token_list(tokens) -> list[int]:
    """Token ids as a Python list (accepts lists, NumPy arrays, 1-D or
    ``[1, T]`` torch tensors)."""
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu()
        if tokens.dim() == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D or [1, T], got shape {tuple(tokens.shape)}")
        return tokens.tolist()
    return list(tokens)
