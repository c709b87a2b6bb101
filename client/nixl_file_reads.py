"""Direct reads of sealed regions through NIXL's file backends: the ``nixl`` backend of
:class:`~.direct_reader.DirectReader`.

The reader plans the aligned spans and checks every block (key, sequence, CRC)
as it does for its own O_DIRECT ``preadv`` loop, which stays the fallback; only
the reads go through NIXL here, every piece of a batch in one transfer::

    pieces (device fd, device offset, host view)  ->  one NIXL READ  FILE_SEG -> DRAM_SEG

Backends: POSIX into host memory (any Linux host). GDS_MT and GDS read files
straight into GPU memory; they need libcufile and a GPU, so :func:`gds_backend`
reports what this host has (``perf/gpu_check.py`` uses it) and the host-memory
reads here use POSIX. The device files are registered once (the fds the reader
opened, O_DIRECT where the filesystem allows); the host buffers per read.

NIXL is imported only when a reader with this backend is made.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Sequence

import numpy as np

READ_TIMEOUT_S = 30.0  # one batch of reads: 16 MiB spans on a slow or failing device, with room
GDS_BACKENDS = ("GDS_MT", "GDS")  # GPU-memory file backends, best first


def _load_nixl():
    from .nixl_agent import NixlUnavailable, load_nixl

    try:
        return load_nixl()
    except NixlUnavailable as exc:
        raise ValueError(f"the nixl direct-read backend needs NIXL: {exc}") from None


def gds_backend() -> tuple[str | None, str]:
    """``(backend, why)``: the GPU-memory file backend NIXL can create here (GDS_MT first), or
    None and the reason none can (no NIXL, no plugin, no libcufile or GPU)."""
    try:
        api = _load_nixl()
    except ValueError as exc:
        return None, str(exc)
    agent = api.nixl_agent(f"kvtier-gds-probe-{uuid.uuid4().hex[:8]}", api.nixl_agent_config(
        enable_prog_thread=False, backends=[]))
    reasons = []
    for name in GDS_BACKENDS:
        if name not in agent.get_plugin_list():
            reasons.append(f"{name}: no plugin")
            continue
        try:
            agent.create_backend(name)
            return name, f"{name} created"
        except Exception as exc:  # NIXL_ERR_NOT_FOUND where libcufile or the GPU is missing
            reasons.append(f"{name}: {type(exc).__name__} {exc}")
    return None, "no GPU-memory file backend here (" + "; ".join(reasons) + "; needs libcufile and a GPU)"


def _address(view) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


class NixlFileReads:
    """Reads ``(device index, device offset, host view)`` pieces of the files behind ``fds``."""

    def __init__(self, fds: Sequence[int], backend: str = "POSIX", timeout_s: float = READ_TIMEOUT_S):
        api = _load_nixl()
        self.backend = backend
        self._timeout_s = timeout_s
        self._name = f"kvtier-files-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = api.nixl_agent(self._name, api.nixl_agent_config(
            enable_prog_thread=False, backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        try:
            self._agent.create_backend(backend)
        except Exception as exc:
            raise ValueError(f"NIXL's {backend} backend cannot be created here: {type(exc).__name__}: {exc}") \
                from None
        self._fds = list(fds)
        self._files = self._agent.register_memory(
            [(0, max(os.lseek(fd, 0, os.SEEK_END), 1), fd, "") for fd in self._fds], "FILE", backends=[backend])
        self._lock = threading.Lock()

    def read(self, pieces: Sequence[tuple[int, int, memoryview]]) -> None:
        """Fill every view from its device offset; OSError when the transfer fails or stalls."""
        if not pieces:
            return
        views = [view for _, _, view in pieces]
        local = [(_address(v), v.nbytes, 0) for v in views]
        registered = self._agent.register_memory([(a, n, 0, "") for a, n, _ in local], "DRAM",
                                                 backends=[self.backend])
        handle = None
        try:
            try:
                handle = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(local, "DRAM"),
                    self._agent.get_xfer_descs([(off, v.nbytes, self._fds[dev]) for dev, off, v in pieces], "FILE"),
                    self._name)
                state = self._agent.transfer(handle)
            except Exception as exc:  # NIXL's own errors: a range past a file's end, a backend that refuses
                raise OSError(5, f"NIXL {self.backend} read of {len(pieces)} pieces could not be posted: "
                                 f"{type(exc).__name__}: {exc}") from None
            deadline = time.monotonic() + self._timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise OSError(110, f"NIXL {self.backend} read of {len(pieces)} pieces not done within "
                                       f"{self._timeout_s} s (READ_TIMEOUT_S)")
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(5, f"NIXL {self.backend} read of {len(pieces)} pieces failed (state {state})")
        finally:
            if handle is not None:
                handle.release()
            self._agent.deregister_memory(registered, backends=[self.backend])

    def close(self) -> None:
        self._agent.deregister_memory(self._files, backends=[self.backend])
