"""Raw blocks sent from the engine's own memory: no gather, no send buffer.

A synchronous store of host KV in the raw codec holds the caller until the PUT is acknowledged, so
the KV cannot change under it. Its blocks are then sent as they lie::

    block i = [ block header + codec header ][ layer 0 K, head 0 rows ][ head 1 ] ... [ layer L-1 V, head H-1 ]
                 built here (64 + few bytes)    views of the engine's tensors, in payload order

``sendmsg`` gathers the views, so the kernel's copy into the socket is the only pass over the KV
besides the CRC, which is chained over the same views in the same order. KV on a device, another
codec, or rows that are not contiguous take the send-buffer encoder instead.
"""
from __future__ import annotations

from typing import Sequence

import crc32c
import numpy as np

from kvtier.common.blockformat import header_for_crc
from kvtier.common.keys import KVLayout
from kvtier.wire.events import BlockParts

from .block_payload import host_bits


class SourceBlocks:
    """Blocks as :class:`BlockParts` over the engine's tensors; the same interface as
    :class:`~.block_encoder.EncodedBlocks` (they are sealed when built, and hold no buffers)."""

    def __init__(self, blocks: list[BlockParts]) -> None:
        self.blocks = blocks
        self.sealed_blocks = len(blocks)

    def seal(self, first: int = 0) -> None:
        pass  # headers are written when the blocks are built

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def release(self) -> None:
        self.blocks = []  # the views go; the engine's tensors were never ours


def layer_bits(kv: Sequence, layers: range) -> list | None:
    """``kv`` (per-layer ``(k, v)``, ``[1, H, T, D]``) as ``[H, T, D]`` NumPy views of the bits of
    each of ``layers``' K and V, in that order, taken once for every block of a store; None unless
    every tensor is on the host."""
    bits = []
    for layer in layers:
        for tensor in kv[layer][:2]:
            if tensor.device.type != "cpu":
                return None
            bits.append(host_bits(tensor[0]))
    return bits


def block_rows(bits: list, layout: KVLayout, index: int) -> list[np.ndarray] | None:
    """Block ``index``'s payload rows out of :func:`layer_bits`; None unless each is contiguous.

    The rows stay NumPy arrays, which the garbage collector does not track: a block in flight
    holds hundreds of them, and as memoryviews they would outlive young collections and make
    the host process's full collections frequent."""
    start, end = index * layout.block_tokens, (index + 1) * layout.block_tokens
    rows: list[np.ndarray] = []
    for tensor_bits in bits:
        block = tensor_bits[:, start:end]  # [H, block_tokens, D]
        if block.flags.c_contiguous:
            rows.append(block)
            continue
        for head in block:
            if not head.flags.c_contiguous:
                return None
            rows.append(head)
    return rows


def tensor_rows(block, shape: tuple) -> list[np.ndarray] | None:
    """A ``shape`` block tensor's bits as arrays (see :func:`block_rows`), one per contiguous layer
    (``[2, H, T, D]``), or None unless it is on the host and every layer of it is contiguous."""
    if getattr(block, "device", None) is None or block.device.type != "cpu" or tuple(block.shape) != tuple(shape):
        return None
    if block.is_contiguous():
        return [host_bits(block)]
    rows = [host_bits(layer) for layer in block]
    if not all(row.flags.c_contiguous for row in rows):
        return None
    return rows


def source_blocks(kv: Sequence, layout: KVLayout, first_block: int, keys: Sequence[bytes], layers: range,
                  ns_id: bytes, codec_id: int, codec_header: bytes) -> SourceBlocks | None:
    """Blocks ``first_block ..`` (one per key) of ``kv`` in the raw codec, sent from where they
    lie; None where :func:`layer_bits` or :func:`block_rows` says they cannot be."""
    bits = layer_bits(kv, layers)
    if bits is None:
        return None
    return _sealed(keys, lambda i: block_rows(bits, layout, first_block + i), ns_id, codec_id, codec_header)


def source_blocks_of_tensors(blocks: Sequence, keys: Sequence[bytes], shape: tuple, ns_id: bytes, codec_id: int,
                             codec_header: bytes) -> SourceBlocks | None:
    """Block tensors (``shape``, e.g. one layer group of ``block_shape``) in the raw codec, sent
    from where they lie; None where :func:`tensor_rows` says they cannot be."""
    return _sealed(keys, lambda i: tensor_rows(blocks[i], shape), ns_id, codec_id, codec_header)


def _sealed(keys: Sequence[bytes], rows_of, ns_id: bytes, codec_id: int, codec_header: bytes) -> SourceBlocks | None:
    blocks = []
    for i, key in enumerate(keys):
        rows = rows_of(i)
        if rows is None:
            return None
        crc = crc32c.crc32c(codec_header)
        for row in rows:
            crc = crc32c.crc32c(row, crc)
        payload_len = len(codec_header) + sum(row.nbytes for row in rows)
        head = header_for_crc(bytes(key), ns_id, codec_id, payload_len, crc)
        blocks.append(BlockParts((head + codec_header, *rows)))
    return SourceBlocks(blocks)


def host_spans(kv: Sequence) -> list[tuple[int, int]]:
    """``(address, length)`` of the memory each host tensor of ``kv`` (per-layer ``(k, v)``, or
    block tensors) spans, from its first element to its last."""
    spans = []
    for item in kv:
        for tensor in (item if isinstance(item, (tuple, list)) else (item,)):
            if getattr(tensor, "device", None) is None or tensor.device.type != "cpu" or not tensor.numel():
                continue
            last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
            spans.append((tensor.data_ptr(), (last + 1) * tensor.element_size()))
    return spans
