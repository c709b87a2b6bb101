"""kvtierd's NIXL agent: the UCX backend, the daemon's registered read buffers, the client peers,
and WRITEs into a client's descriptors.

The daemon is the initiator of every transfer, so its agent runs no progress
thread: the connection thread that posted a WRITE polls it to completion (the
client, the waiting side, keeps its progress thread). Connection threads share
the agent, so it is made thread-safe (``NIXL_THREAD_SYNC_STRICT``).

The buffers a GET's blocks are read into (request arenas, transient buffers) are
registered the first time a transfer uses them and stay registered while the
daemon holds them, within ``REGISTERED_BYTES_MAX``: beyond it the least recently
used registration not in use is dropped. The cache holds a reference to each
registered buffer, so memory NIXL knows of is never freed under it.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvtier.common.ucx_env import TransportPlan, apply_ucx_environment

log = logging.getLogger("kvtier.daemon.nixl")

TRANSFER_TIMEOUT_S = 5.0  # a WRITE not DONE by then is abandoned (a dead or stalled client): 256 MiB at 50 MB/s
REGISTERED_BYTES_MAX = 2 << 30  # daemon buffers kept registered: every arena (512 MiB) and idle transient buffer


class NixlUnavailable(RuntimeError):
    """NIXL is not installed here, or its UCX backend cannot be created; the message says which."""


class NixlTransferError(RuntimeError):
    """A NIXL transfer failed or did not complete in time (``timed_out``)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def load_nixl():
    """The ``nixl_cu12._api`` module (NixlUnavailable names the extra when it is missing)."""
    try:
        from nixl_cu12 import _api
    except ImportError as exc:
        raise NixlUnavailable(f"NIXL is not importable ({exc}): pip install 'kvtier[nixl]' "
                              "(torch==2.13.0 first on machines without a GPU)") from None
    if "NIXL_LOG_LEVEL" not in os.environ:
        logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout, not to our log
    return _api


def buffer_address(view) -> int:
    """The address of the first byte of a bytes-like object (read-only ones included)."""
    return int(np.frombuffer(view, np.uint8).ctypes.data) if memoryview(view).nbytes else 0


@dataclass(frozen=True)
class AgentStatistics:
    name: str
    transport: str  # the best UCX transport this agent allows ("sm", "rdma", "tcp")
    ucx_tls: str
    peers: int
    registered_buffers: int
    registered_bytes: int
    writes: int
    bytes_written: int
    failures: int
    timeouts: int


class DaemonAgent:
    """One NIXL agent with the UCX backend for the whole daemon."""

    def __init__(self, loopback_only: bool, tls_override: str | None = None,
                 transfer_timeout_s: float = TRANSFER_TIMEOUT_S):
        api = load_nixl()
        self.plan: TransportPlan = apply_ucx_environment(True, loopback_only, tls_override)
        self.name = f"kvtierd-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self._agent = api.nixl_agent(self.name, config)
        except Exception as exc:
            raise NixlUnavailable(f"the NIXL agent could not be created: {type(exc).__name__}: {exc}") from None
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable("NIXL's UCX backend is not available here")
        self._timeout_s = transfer_timeout_s
        self._lock = threading.Lock()
        self._registered: OrderedDict[tuple[int, int], tuple[object, object]] = OrderedDict()  # -> (buffer, descs)
        self._in_use: dict[tuple[int, int], int] = {}
        self._peers: dict[str, int] = {}  # remote agent -> sessions that loaded it
        self._writes = self._bytes_written = self._failures = self._timeouts = 0

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    # -- peers --------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        """Load a client agent's metadata; its name (ValueError when it does not load)."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise ValueError(f"the NIXL agent metadata does not load: {type(exc).__name__}: {exc}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            self._peers[name] = self._peers.get(name, 0) + 1
        return name

    def remove_peer(self, name: str) -> None:
        """A session that loaded ``name`` ended; the last one unloads it."""
        with self._lock:
            left = self._peers.get(name, 0) - 1
            if left > 0:
                self._peers[name] = left
                return
            self._peers.pop(name, None)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone: nothing else holds it
            log.info("event=nixl_peer_remove_failed agent=%s error=%s", name, exc)

    # -- registration ---------------------------------------------------------
    def _register(self, buffer: memoryview) -> tuple[int, int]:
        key = (buffer_address(buffer), buffer.nbytes)
        with self._lock:
            if key in self._registered:
                self._registered.move_to_end(key)
            else:
                descs = self._agent.register_memory([(key[0], key[1], 0, "")], "DRAM", backends=["UCX"])
                self._registered[key] = (buffer, descs)
                self._evict()
            self._in_use[key] = self._in_use.get(key, 0) + 1
        return key

    def _release(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._in_use[key] -= 1
                if not self._in_use[key]:
                    del self._in_use[key]
            self._evict()

    def _evict(self) -> None:
        total = sum(k[1] for k in self._registered)
        for key in list(self._registered):
            if total <= REGISTERED_BYTES_MAX:
                break
            if key in self._in_use:
                continue
            _, descs = self._registered.pop(key)
            self._agent.deregister_memory(descs, backends=["UCX"])
            total -= key[1]

    # -- transfers ------------------------------------------------------------
    def write(self, peer: str, buffers: list[memoryview], local: list[tuple[int, int]],
              remote: list[tuple[int, int]], notification: bytes) -> None:
        """WRITE ``local[i] = (address, length)`` (inside ``buffers``) to the peer's ``remote[i]``,
        then notify it; returns once DONE (NixlTransferError when it fails or times out)."""
        assert len(local) == len(remote) and local, (len(local), len(remote))
        keys = [self._register(b) for b in buffers]
        handle = None
        try:
            local_descs = self._agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
            remote_descs = self._agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
            try:
                handle = self._agent.initialize_xfer("WRITE", local_descs, remote_descs, peer, notification)
                state = self._agent.transfer(handle)
            except Exception as exc:
                self._count(failures=1)
                raise NixlTransferError(f"NIXL WRITE to {peer} could not be posted: {type(exc).__name__}: {exc}") \
                    from None
            deadline = time.monotonic() + self._timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    self._count(timeouts=1)
                    raise NixlTransferError(f"NIXL WRITE to {peer} not done within {self._timeout_s} s "
                                            "(TRANSFER_TIMEOUT_S)", timed_out=True)
                os.sched_yield()  # a busy machine: let the peer (and its progress) run between polls
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                self._count(failures=1)
                raise NixlTransferError(f"NIXL WRITE to {peer} failed (state {state})")
            self._count(writes=1, nbytes=sum(n for _, n in local))
        finally:
            released = True
            if handle is not None:
                try:
                    handle.release()
                except Exception as exc:  # still in flight and not cancellable: NIXL keeps it as leaked
                    log.warning("event=nixl_release_failed agent=%s error=%s", peer, exc)
                    released = False
            if released:  # else its buffers stay registered (in use) for good: it may still read them
                self._release(keys)

    def _count(self, writes: int = 0, nbytes: int = 0, failures: int = 0, timeouts: int = 0) -> None:
        with self._lock:
            self._writes += writes
            self._bytes_written += nbytes
            self._failures += failures
            self._timeouts += timeouts

    def statistics(self) -> AgentStatistics:
        with self._lock:
            return AgentStatistics(self.name, self.plan.name, self.plan.tls, len(self._peers), len(self._registered),
                                   sum(k[1] for k in self._registered), self._writes, self._bytes_written,
                                   self._failures, self._timeouts)
