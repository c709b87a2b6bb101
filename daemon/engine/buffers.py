"""A pool of aligned read buffers, so flash reads reuse faulted-in memory
instead of mapping (and page-faulting) fresh pages for every block. Buffers of
2 MiB and more are backed by transparent huge pages where the kernel allows."""
from __future__ import annotations

import threading

import numpy as np

from kvtier.common.aligned import aligned_buffer

POOL_BYTES_MAX = 64 << 20  # idle buffers kept: about 32 in-flight 2 MiB blocks
_SMALL_CLASS_BYTES = 64 << 10  # sizes below 1 MiB round up to a power of two from here
_LARGE_STEP_BYTES = 1 << 20  # sizes above round up to a whole MiB


def copy_bytes(dst: memoryview, src) -> None:
    """``dst[:] = src`` for byte buffers of one size, without holding the GIL: a memoryview
    slice assignment copies under it, ``numpy.copyto`` lets the daemon's other threads
    (receiving, checking CRCs, sending) run during a multi-MiB copy."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def size_class(nbytes: int) -> int:
    if nbytes > _LARGE_STEP_BYTES:
        return -(-nbytes // _LARGE_STEP_BYTES) * _LARGE_STEP_BYTES
    size = _SMALL_CLASS_BYTES
    while size < nbytes:
        size *= 2
    return size


class BufferPool:
    def __init__(self, capacity_bytes: int = POOL_BYTES_MAX):
        self._capacity = capacity_bytes
        self._idle: dict[int, list[memoryview]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A buffer of at least ``nbytes`` (its first ``nbytes`` are for the caller; contents undefined)."""
        cls = size_class(nbytes)
        with self._lock:
            idle = self._idle.get(cls)
            if idle:
                self._idle_bytes -= cls
                return idle.pop()
        return aligned_buffer(cls, populate=True, huge=True)

    def give(self, buf: memoryview) -> None:
        with self._lock:
            if self._idle_bytes + buf.nbytes <= self._capacity:
                self._idle.setdefault(buf.nbytes, []).append(buf)
                self._idle_bytes += buf.nbytes
