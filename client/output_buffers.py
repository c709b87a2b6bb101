"""Reusable host memory for what a load returns: tensors over pooled buffers whose pages
are faulted in once.

A load hands the engine tensors it keeps for as long as it likes, so a buffer is free
again only once every tensor (and view, and array) over it is gone. Each buffer is an
anonymous ``mmap`` (page-aligned, pre-faulted by the kernel when it is mapped, no
zero-fill pass of ours; its pages stay); a tensor made by :func:`tensor_over` (``torch.from_numpy``
of an ``np.frombuffer`` array: the array holds a buffer export on the mmap, the
tensor's storage holds the array) keeps that export for as long as its storage lives,
and an mmap with an export refuses to be resized: :func:`buffer_exported` asks exactly
that. (``torch.frombuffer`` keeps no export: its tensors would look free.)::

    take(n) -> an array over a free pooled buffer of >= n bytes (the smallest), else
               over a new one (kept in the pool while the pool is under its byte limit);
               the array holds the export from the moment it is chosen, under the lock
    tensor over it -> given to the engine -> dropped -> the buffer is free again
"""
from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

OUTPUT_BUFFERS_BYTES_MAX = 2 << 30  # host memory the pool keeps for reuse (in use or idle); more is not kept
# pre-faulted in one pass by the kernel (about half the CPU of faulting each page on first write)
_POOLED_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


@dataclass(frozen=True)
class OutputBuffersStatistics:
    buffers: int  # kept in the pool, in use or free
    bytes_kept: int
    takes: int
    reused: int  # takes answered by a free pooled buffer (no fresh pages)
    allocated_bytes: int  # fresh buffers made (kept or not)


class OutputBuffers:
    """See the module doc; thread-safe. ``bytes_max=0`` keeps nothing (every take is fresh)."""

    def __init__(self, bytes_max: int = OUTPUT_BUFFERS_BYTES_MAX) -> None:
        if bytes_max < 0:
            raise ValueError(f"output buffers bytes_max must be >= 0, got {bytes_max}")
        self.bytes_max = bytes_max
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._takes = self._reused = self._allocated = 0

    def take(self, nbytes: int):
        """A uint8 NumPy array over a buffer of at least ``nbytes`` that nothing else
        references. The array holds the buffer's export from inside the lock on, so two
        concurrent takes can never be handed the same buffer; the buffer is free again once
        this array and everything made from it (see :func:`tensor_over`) are gone."""
        import numpy as np

        if nbytes < 0:
            raise ValueError(f"cannot take a buffer of {nbytes} bytes")
        with self._lock:
            self._takes += 1
            free = [b for b in self._buffers if len(b) >= nbytes and not buffer_exported(b)]
            if free:
                self._reused += 1
                return np.frombuffer(min(free, key=len), np.uint8)  # exported before the lock is let go
            kept = sum(len(b) for b in self._buffers)
            if kept + nbytes > self.bytes_max:
                # make room by dropping idle buffers, smallest first (they are the least reusable)
                for idle in sorted((b for b in self._buffers if not buffer_exported(b)), key=len):
                    if kept + nbytes <= self.bytes_max:
                        break
                    self._buffers.remove(idle)
                    kept -= len(idle)
            self._allocated += nbytes
            keep = kept + nbytes <= self.bytes_max
        buf = mmap.mmap(-1, max(1, nbytes), flags=_POOLED_MAP_FLAGS)
        held = np.frombuffer(buf, np.uint8)  # exported before the pool can see it
        if keep:
            with self._lock:
                if sum(len(b) for b in self._buffers) + len(buf) <= self.bytes_max:
                    self._buffers.append(buf)
        return held

    def statistics(self) -> OutputBuffersStatistics:
        with self._lock:
            return OutputBuffersStatistics(len(self._buffers), sum(len(b) for b in self._buffers), self._takes,
                                           self._reused, self._allocated)


def buffer_exported(buf: mmap.mmap) -> bool:
    """True while any export of ``buf`` is alive (a memoryview, a tensor or an array over
    it): an mmap with exports raises BufferError when asked to resize. The probe resizes
    it to its own size (no pages touched)."""
    try:
        buf.resize(len(buf))
    except BufferError:
        return True
    return False


def tensor_over(held, shape: tuple, dtype):
    """A ``shape`` tensor of ``dtype`` over the start of ``held`` (a uint8 array from
    :meth:`OutputBuffers.take`, at least the tensor's bytes long); the tensor keeps the
    array, and so the buffer's export, alive."""
    import math

    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    bits = held[:math.prod(shape) * itemsize].view(f"i{itemsize}")
    return torch.from_numpy(bits).view(dtype).view(shape)


class LoadOutputs:
    """The output tensors of one layout's loads on ``device``: over pooled buffers on the
    host (``bytes_max`` of them kept), plain ``torch.empty`` on a GPU."""

    def __init__(self, layout, device, bytes_max: int = OUTPUT_BUFFERS_BYTES_MAX) -> None:
        self.layout = layout
        self.device = device
        self.buffers = OutputBuffers(bytes_max)

    def kv(self, num_blocks: int):
        """Uninitialised ``[L, 2, 1, H, n*B, D]`` output of a load of ``num_blocks`` blocks."""
        from .block_payload import empty_kv, torch_dtype

        if str(self.device) != "cpu":
            return empty_kv(self.layout, num_blocks, self.device)
        lay = self.layout
        shape = (lay.num_layers, 2, 1, lay.num_kv_heads, num_blocks * lay.block_tokens, lay.head_dim)
        return tensor_over(self.buffers.take(num_blocks * lay.block_raw_bytes), shape, torch_dtype(lay))

    def block(self):
        """An uninitialised ``block_shape`` tensor."""
        import torch

        from .block_payload import torch_dtype

        if str(self.device) != "cpu":
            return torch.empty(self.layout.block_shape, dtype=torch_dtype(self.layout), device=self.device)
        return tensor_over(self.buffers.take(self.layout.block_raw_bytes), self.layout.block_shape,
                           torch_dtype(self.layout))
