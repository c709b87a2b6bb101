"""Engine KV -> blocks ready for the wire, in one pass over the data.

Each block is built in a reusable, page-aligned send buffer that holds its header::

    send buffer:  [ block header (64) | codec payload ............................ ]
                                      raw: the codec header, then the gather lands
                                      in place (the gather is the encode);
                                      other codecs: gather -> a reused scratch block,
                                      then the codec encodes into the buffer

The block header's payload CRC is computed over the buffer where the payload lies, and
the client sends the buffer as it is (``sendmsg`` of a view): no stack, no contiguous
copy, no ``bytes()`` of a payload, no joining of header and payload.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from kvtier.common.aligned import address_of, aligned_buffer, align_up
from kvtier.common.blockformat import HEADER_SIZE, encode_header
from kvtier.common.keys import KVLayout

from .block_payload import copy_tensor, host_bits
from .source_blocks import SourceBlocks, source_blocks, source_blocks_of_tensors

SEND_BUFFERS_BYTES_MAX = 1 << 30  # idle send buffers kept for reuse; more are freed as they come back


class SendBuffers:
    """A free list of page-aligned buffers of one size, keeping at most a byte limit idle.

    ``pinned`` page-locks each buffer for CUDA (``cudaHostRegister``), so a gather from
    device memory is one DMA into the send buffer rather than a staged pageable copy."""

    def __init__(self, buffer_bytes: int, keep_bytes_max: int = SEND_BUFFERS_BYTES_MAX, pinned: bool = False) -> None:
        self.buffer_bytes = align_up(buffer_bytes)
        self.pinned = pinned
        self._keep_max = max(1, keep_bytes_max // self.buffer_bytes)
        self._free: list[memoryview] = []
        self._lock = threading.Lock()
        self.allocated = 0

    def take(self) -> memoryview:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.allocated += 1
        buf = aligned_buffer(self.buffer_bytes)
        if self.pinned:
            _cuda_host_register(buf, True)
        return buf

    def give_back(self, buffers: Sequence[memoryview]) -> None:
        with self._lock:
            room = max(0, self._keep_max - len(self._free))
            self._free.extend(buffers[:room])
        if self.pinned:
            for buf in buffers[room:]:
                _cuda_host_register(buf, False)


def _cuda_host_register(buf: memoryview, register: bool) -> None:
    import torch

    cudart = torch.cuda.cudart()
    address = address_of(buf)
    status = cudart.cudaHostRegister(address, buf.nbytes, 0) if register else cudart.cudaHostUnregister(address)
    if int(status) != 0:
        raise OSError(f"cudaHost{'Register' if register else 'Unregister'} of a {buf.nbytes}-byte send buffer "
                      f"failed: CUDA error {int(status)}")


class EncodedBlocks:
    """Built blocks and the send buffers they live in, until :meth:`release`.

    Built with ``sealed=False``, the payloads are in place but the headers (and so the
    payload CRCs) are not written until :meth:`seal`: a write-behind save copies the KV
    out on the engine's step and checksums it on the background worker."""

    def __init__(self, pool: SendBuffers, ns_id: bytes, codec_id: int) -> None:
        self.blocks: list[memoryview] = []
        self.buffers: list[memoryview] = []
        self._pool = pool
        self._ns_id, self._codec_id = ns_id, codec_id
        self._unsealed: list[bytes] = []  # the keys of blocks whose header is still to write
        self.sealed_blocks = 0  # headers written (CRCs computed)

    def seal(self, first: int = 0) -> None:
        """Write the headers of blocks ``first ..`` (each payload CRC computed where the payload
        lies); blocks before ``first`` stay unsealed (a save skips what the daemon holds)."""
        for key, block in zip(self._unsealed[first:], self.blocks[first:]):
            block[:HEADER_SIZE] = encode_header(key, self._ns_id, self._codec_id, block[HEADER_SIZE:])
        self.sealed_blocks += max(0, len(self._unsealed) - first)
        self._unsealed = []

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def release(self) -> None:
        buffers, self.buffers, self.blocks = self.buffers, [], []
        self._pool.give_back(buffers)

    def __enter__(self) -> list[memoryview]:
        return self.blocks

    def __exit__(self, *exc) -> None:
        self.release()


class BlockEncoder:
    """Builds the blocks of engine KV (per-layer ``(k, v)``, ``[1, kv_heads, T, head_dim]``)
    for one namespace and codec, each in a send buffer; see the module doc. ``layers``
    (a layer group, :meth:`KVLayout.group_layers`) builds objects of those layers only."""

    def __init__(self, layout: KVLayout, ns_id: bytes, codec, layers: range | None = None,
                 pinned: bool = False) -> None:
        from kvtier.kernels.arrays import BF16

        self.layout = layout
        self.ns_id = ns_id
        self.codec = codec
        self.layers = range(layout.num_layers) if layers is None else layers
        self.shape = (len(self.layers), *layout.block_shape[1:])
        self._nbytes = layout.block_raw_bytes // layout.num_layers * len(self.layers)
        self._dtype = BF16 if layout.dtype == "bfloat16" else np.dtype(layout.dtype)
        self._bits = np.dtype(f"i{self._dtype.itemsize}")  # what host_bits() views tensors as
        self._raw_header = codec.payload_header(self.shape, self._dtype) if codec.name == "raw" else None
        self.buffers = SendBuffers(HEADER_SIZE + self._payload_size_max(), pinned=pinned)
        self._scratch = threading.local()

    def _payload_size_max(self) -> int:
        if self._raw_header is not None:
            return len(self._raw_header) + self._nbytes
        probe = np.zeros(self.shape, self._dtype)
        if hasattr(self.codec, "encoded_size_max"):  # mixed, +lz4: the size depends on the data or the length
            return self.codec.encoded_size_max(probe)
        return self.codec.encoded_size(probe)

    def encode(self, kv: Sequence, first_block: int, keys: Sequence[bytes],
               seq_tokens: int | None = None, sealed: bool = True) -> "EncodedBlocks":
        """Blocks ``first_block ..`` (one per key) of ``kv``, each a view of a send buffer
        (header + payload); :meth:`EncodedBlocks.release` (or a ``with``) reuses the buffers.
        ``sealed=False`` leaves the headers to :meth:`EncodedBlocks.seal`."""
        return self._build(keys, lambda i, payload: self._gather_into(kv, first_block + i, payload, seq_tokens),
                           sealed)

    def encode_from_source(self, kv: Sequence, first_block: int, keys: Sequence[bytes]) -> SourceBlocks | None:
        """:meth:`encode`, sealed, with the blocks sent from ``kv`` itself (raw codec, host KV,
        contiguous rows; else None): for a caller that keeps ``kv`` unchanged until the PUT ends."""
        if self._raw_header is None:
            return None
        return source_blocks(kv, self.layout, first_block, keys, self.layers, self.ns_id, self.codec.codec_id,
                             self._raw_header)

    def tensors_from_source(self, blocks: Sequence, keys: Sequence[bytes]) -> SourceBlocks | None:
        """:meth:`encode_tensors`, sealed, sent from the tensors themselves (see :meth:`encode_from_source`)."""
        if self._raw_header is None:
            return None
        return source_blocks_of_tensors(blocks, keys, self.shape, self.ns_id, self.codec.codec_id, self._raw_header)

    def encode_tensors(self, blocks: Sequence, keys: Sequence[bytes], sealed: bool = True) -> "EncodedBlocks":
        """:meth:`encode` of tensors (or arrays) of this encoder's shape, e.g. gathered from a paged cache."""
        return self._build(keys, lambda i, payload: self._tensor_into(blocks[i], payload), sealed)

    def _build(self, keys: Sequence[bytes], fill, sealed: bool) -> "EncodedBlocks":
        built = EncodedBlocks(self.buffers, self.ns_id, self.codec.codec_id)
        try:
            for i, key in enumerate(keys):
                buf = self.buffers.take()
                built.buffers.append(buf)
                size = fill(i, buf[HEADER_SIZE:])
                built.blocks.append(buf[:HEADER_SIZE + size])
                built._unsealed.append(bytes(key))
            if sealed:
                built.seal()
        except BaseException:
            built.release()
            raise
        return built

    def _gather_into(self, kv: Sequence, index: int, payload: memoryview, seq_tokens: int | None) -> int:
        if self._raw_header is not None:
            return self._gather_raw(kv, index, payload)
        return self._encode_other(kv, index, payload, seq_tokens)

    def _tensor_into(self, block, payload: memoryview) -> int:
        if tuple(block.shape) != self.shape:
            raise ValueError(f"block has shape {tuple(block.shape)}, expected {self.shape}")
        if hasattr(block, "device") and block.device.type != "cpu":
            block = block.cpu()
        arr = host_bits(block) if hasattr(block, "device") else np.asarray(block).view(self._bits)
        if hasattr(self.codec, "encode_into"):
            return self.codec.encode_into(arr.view(self._dtype), payload)
        data = self.codec.encode(arr.view(self._dtype))
        payload[:len(data)] = data
        return len(data)

    def _gather_raw(self, kv: Sequence, index: int, payload: memoryview) -> int:
        head = len(self._raw_header)
        payload[:head] = self._raw_header
        count = self._nbytes // self._bits.itemsize
        gather_block(kv, self.layout, index, np.frombuffer(payload, self._bits, count, head).reshape(self.shape),
                     self.layers)
        return head + self._nbytes

    def _encode_other(self, kv: Sequence, index: int, payload: memoryview, seq_tokens: int | None) -> int:
        scratch = getattr(self._scratch, "block", None)
        if scratch is None:
            scratch = self._scratch.block = np.empty(self.shape, self._bits)
        gather_block(kv, self.layout, index, scratch, self.layers)
        block = scratch.view(self._dtype)
        if hasattr(self.codec, "encode_into"):
            return self.codec.encode_into(block, payload)
        if seq_tokens is not None and getattr(self.codec, "takes_seq_tokens", False):
            data = self.codec.encode(block, seq_tokens=seq_tokens)  # mixed: the policy depends on the length
        else:
            data = self.codec.encode(block)  # lz4 stages produce bytes of their own
        payload[:len(data)] = data
        return len(data)


def gather_block(kv: Sequence, layout: KVLayout, index: int, dest, layers: range | None = None) -> None:
    """``dest[j, 0|1] = k|v[0, :, tokens of block index]`` of the j-th of ``layers`` (all by
    default), one copy each. ``dest`` is ``[len(layers), 2, H, B, D]``: a NumPy array of the
    layout's bits (int16 for 2-byte dtypes), or a tensor of the layout's dtype (a hot-pool
    slot, on any device)."""
    b = layout.block_tokens
    start, end = index * b, (index + 1) * b
    for j, layer in enumerate(range(layout.num_layers) if layers is None else layers):
        k, v = kv[layer][:2]
        for which, tensor in ((0, k), (1, v)):
            src = tensor[0, :, start:end]
            if not isinstance(dest, np.ndarray):
                copy_tensor(dest[j, which], src)
            elif src.device.type == "cpu":
                np.copyto(dest[j, which], host_bits(src))
            else:
                import torch

                into = torch.from_numpy(dest[j, which])
                into.copy_(src.view(into.dtype))
