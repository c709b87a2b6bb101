"""kvtierd's NIXL agent: the UCX backend, the daemon's registered read buffers, the client peers,
WRITEs into a client's descriptors and READs of a client's blocks.

The daemon is the initiator of every transfer, so its agent runs no progress
thread: the connection thread that posted a WRITE polls it to completion (the
client, the waiting side, keeps its progress thread). Connection threads share
the agent, so it is made thread-safe (``NIXL_THREAD_SYNC_STRICT``).

A client is handed what it needs to be reached and nothing more: the agent's connection
information, no memory section (:meth:`DaemonAgent.metadata`), so no client learns an address or
remote key of the daemon's. And the agent holds registered only the memory of the transfers in
flight: a request's buffer (arena, transient buffer) is registered when its transfer is posted and
deregistered when the transfer ends (a parked one keeps it until NIXL has ended it), so what a
peer could reach at any moment holds only the requests in flight, never the devices or the open
region. The registration holds a reference to its buffer, so memory NIXL knows of is never freed
under it.
A NIXL_GET's WRITEs are one :class:`Transfer`, posted part by part, none once the client has
shut down its side of the connection (:class:`NixlPeerGone`); a NIXL_PUT's READs are another. A NIXL
release does not stop a transfer in flight, so one given up on while a part is still in flight is
*parked* instead of released: its handles, registrations and the memory it reads (a WRITE's source
buffers) or writes (a READ's landing room) are held until NIXL says every part ended (checked
whenever a transfer is made or statistics are read), then released and given back. What one client
has parked is :meth:`DaemonAgent.parked_bytes_of` it; the service posts nothing more for a client
over its limit.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvtier.common.backoff import Backoff
from kvtier.common.ucx_env import TransportPlan, apply_ucx_environment
from kvtier.wire.nixl_frames import part_notification

log = logging.getLogger("kvtier.daemon.nixl")

TRANSFER_TIMEOUT_S = 5.0  # a WRITE not DONE by then is abandoned (a dead or stalled client): 256 MiB at 50 MB/s
# NIXL's transfer states are polled: the first poll after WAIT_FIRST_S, each next twice as late up to
# WAIT_MAX_S (a WRITE over TCP moves only while we progress: the cap keeps its pace)
WAIT_FIRST_S = 10e-6
WAIT_MAX_S = 50e-6
PARKED_WAIT_MAX_S = 0.005  # parked transfers, checked while a request waits for them to end


class NixlUnavailable(RuntimeError):
    """NIXL is not installed here, or its UCX backend cannot be created; the message says which."""


class NixlTransferError(RuntimeError):
    """A NIXL transfer failed or did not complete in time (``timed_out``)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class NixlTransferNotReleased(NixlTransferError):
    """A transfer that failed or timed out and that NIXL could not release: a READ may still write
    into this daemon's memory, a WRITE may still send what that memory holds next into a client's.
    Neither may be used again: the caller fails closed."""


class NixlPeerGone(RuntimeError):
    """The client shut down its side of the connection (or closed it) before a part was posted: it gave the
    request up, so nothing more is posted for it."""


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
    registered_buffers: int  # the buffers of the transfers in flight (and parked), registered for them alone
    registered_bytes: int
    writes: int
    bytes_written: int
    reads: int  # NIXL_PUTs' READs of client memory
    bytes_read: int
    failures: int
    timeouts: int
    writes_parked: int  # WRITEs given up on while in flight: held, not released, until NIXL ended them
    reads_parked: int  # READs (a NIXL_PUT's) given up on while in flight, held the same way
    parked_now: int  # of those, not ended yet: the memory they read or write stays out of use
    parked_bytes: int  # the memory they hold (arenas, transient buffers, open-region images)


class DaemonAgent:
    """One NIXL agent with the UCX backend for the whole daemon."""

    def __init__(self, loopback_only: bool, tls_override: str | None = None,
                 transfer_timeout_s: float = TRANSFER_TIMEOUT_S):
        self._api = api = load_nixl()
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
        self._registered: dict[tuple[int, int], list] = {}  # (address, length) -> [buffer, descs, transfers]
        self._peers: dict[str, int] = {}  # remote agent -> sessions (and parked transfers) that hold it
        self._parked: list[tuple[Transfer, Callable[[], None], int]] = []  # (transfer, give back its sources, bytes)
        self._reaping = threading.Lock()  # one thread checks the parked transfers at a time
        self._writes = self._bytes_written = self._reads = self._bytes_read = self._failures = self._timeouts = 0
        self._parked_counts = {"WRITE": 0, "READ": 0}

    def metadata(self) -> bytes:
        """What a client needs to be reached by this agent: its connection information, no memory
        section (a client never transfers on its own; a section would hand it an address and key)."""
        nothing = self._api.nixlBind.nixlRegDList(self._agent.nixl_mems["DRAM"], [])
        return bytes(self._agent.get_partial_agent_metadata(nothing, True, ["UCX"]))

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
        """Register ``buffer`` for a transfer (a second transfer of the same buffer shares it)."""
        key = (buffer_address(buffer), buffer.nbytes)
        with self._lock:
            if key not in self._registered:
                descs = self._agent.register_memory([(key[0], key[1], 0, "")], "DRAM", backends=["UCX"])
                self._registered[key] = [buffer, descs, 0]
            self._registered[key][2] += 1
        return key

    def _release(self, keys) -> None:
        """The transfers of ``keys`` ended: a buffer no transfer uses any more is deregistered."""
        with self._lock:
            for key in keys:
                entry = self._registered[key]
                entry[2] -= 1
                if not entry[2]:
                    del self._registered[key]
                    self._agent.deregister_memory(entry[1], backends=["UCX"])

    # -- transfers ------------------------------------------------------------
    def transfer(self, peer: str, request_id: int, op: str = "WRITE", hold=None, peer_gone=None) -> "Transfer":
        """The WRITEs of one NIXL_GET to ``peer`` (or with ``op="READ"`` the READs of one NIXL_PUT
        from it, not notified): posted part by part, then waited for. ``hold()``: take the memory the
        transfer reads or writes from its owner, returning ``(give_back, nbytes)``; given, a transfer
        left with a part in flight is parked. ``peer_gone()``: whether the client gave the request up."""
        self.reap_parked()
        return Transfer(self, peer, request_id, op, hold, peer_gone)

    def _park(self, transfer: "Transfer", give_back: Callable[[], None], nbytes: int) -> None:
        with self._lock:
            self._parked.append((transfer, give_back, nbytes))
            self._peers[transfer.peer] = self._peers.get(transfer.peer, 0) + 1  # unloaded once it has ended
            self._parked_counts[transfer.op] += 1
        log.warning("event=nixl_transfer_parked op=%s agent=%s request=%d bytes=%d", transfer.op, transfer.peer,
                    transfer.request_id, nbytes)

    def parked_bytes_of(self, peer: str, below: int | None = None, settle_s: float = 0.0) -> int:
        """The memory the parked transfers of client agent ``peer`` hold, after reaping those that
        ended. With ``below``: while that is ``below`` or more, reap again for up to ``settle_s``
        (a client waiting for a reply progresses its agent, which ends what it left in flight)."""
        deadline = time.monotonic() + settle_s
        backoff = Backoff(WAIT_FIRST_S, PARKED_WAIT_MAX_S)
        while True:
            self.reap_parked()
            with self._lock:
                held = sum(nbytes for transfer, _, nbytes in self._parked if transfer.peer == peer)
            if below is None or held < below or time.monotonic() >= deadline:
                return held
            backoff.sleep(deadline)

    def reap_parked(self) -> None:
        """Release the parked transfers NIXL has ended (no part in flight) and give their sources back."""
        if not self._parked or not self._reaping.acquire(blocking=False):
            return
        try:
            with self._lock:
                parked = list(self._parked)
            ended = [entry for entry in parked if not entry[0].leaked and not entry[0].in_flight()]
            for transfer, give_back, nbytes in ended:
                try:
                    transfer.release()
                except NixlTransferNotReleased:  # NIXL kept it: it stays parked, its sources never reused
                    transfer.leaked = True
                    continue
                with self._lock:
                    self._parked.remove((transfer, give_back, nbytes))
                give_back()
                self.remove_peer(transfer.peer)
                log.info("event=nixl_transfer_unparked op=%s agent=%s request=%d bytes=%d", transfer.op,
                         transfer.peer, transfer.request_id, nbytes)
        finally:
            self._reaping.release()

    def _count(self, op: str = "WRITE", transfers: int = 0, nbytes: int = 0, failures: int = 0,
               timeouts: int = 0) -> None:
        with self._lock:
            if op == "WRITE":
                self._writes += transfers
                self._bytes_written += nbytes
            else:
                self._reads += transfers
                self._bytes_read += nbytes
            self._failures += failures
            self._timeouts += timeouts

    def statistics(self) -> AgentStatistics:
        self.reap_parked()
        with self._lock:
            return AgentStatistics(self.name, self.plan.name, self.plan.tls, len(self._peers), len(self._registered),
                                   sum(k[1] for k in self._registered), self._writes, self._bytes_written,
                                   self._reads, self._bytes_read, self._failures, self._timeouts,
                                   self._parked_counts["WRITE"], self._parked_counts["READ"], len(self._parked),
                                   sum(e[2] for e in self._parked))


class Transfer:
    """The WRITEs of one NIXL_GET, posted part by part as their bytes are ready, each notified to the
    peer when it is done (:func:`~kvtier.wire.nixl_frames.part_notification`); or the READs of one
    NIXL_PUT (``op="READ"``: ``local`` is where the bytes land, ``remote`` where they are read, and
    nothing is notified). Leaving the ``with`` block releases every handle, and the buffers
    registered for it once none is still in flight; with ``hold``, one left with a part in flight
    (a WRITE may still read its sources, a READ write into its landing room) is parked instead
    (:meth:`DaemonAgent.reap_parked` releases it once NIXL has ended it)."""

    def __init__(self, agent: DaemonAgent, peer: str, request_id: int, op: str = "WRITE", hold=None,
                 peer_gone=None):
        assert op in ("WRITE", "READ"), op
        self._owner, self._agent = agent, agent._agent
        self.peer, self.request_id, self.op = peer, request_id, op
        self._hold, self._peer_gone = hold, peer_gone
        self._handles: list = []
        self._keys: list = []
        self._bytes = 0
        self._done = False  # every part posted was seen DONE
        self.leaked = False  # parked, and NIXL refused to release it once it had ended: held for good

    def __enter__(self) -> "Transfer":
        return self

    def post(self, parts: list, buffers=()) -> None:
        """WRITE each part's ``local[i] = (address, length)`` (inside ``buffers``, registered now
        and held until the transfer ends, or inside registered device memory) to the peer's
        ``remote[i]``. NixlTransferError when NIXL refuses one; NixlPeerGone, and nothing more is
        posted, once the client has given the request up."""
        assert all(part.local and len(part.local) == len(part.remote) for part in parts)
        try:
            for buffer in buffers:
                self._keys.append(self._owner._register(buffer))
            for part in parts:
                if self._peer_gone is not None and self._peer_gone():
                    raise NixlPeerGone(f"{self.peer} shut down its side of the connection: request "
                                       f"{self.request_id} is not written")
                local_descs = self._agent.get_xfer_descs([(a, n, 0) for a, n in part.local], "DRAM")
                remote_descs = self._agent.get_xfer_descs([(a, n, 0) for a, n in part.remote], "DRAM")
                notification = part_notification(self.request_id, part.ranges) if self.op == "WRITE" else b""
                self._handles.append(self._agent.initialize_xfer(self.op, local_descs, remote_descs, self.peer,
                                                                 notification))
                state = self._agent.transfer(self._handles[-1])
                if state not in ("PROC", "DONE"):
                    raise RuntimeError(f"state {state}")
                self._bytes += part.nbytes
        except NixlPeerGone:
            raise
        except Exception as exc:
            self._owner._count(failures=1)
            raise NixlTransferError(f"NIXL {self.op} {self._direction} {self.peer} could not be posted: "
                                    f"{type(exc).__name__}: {exc}") from None

    @property
    def _direction(self) -> str:
        return "to" if self.op == "WRITE" else "from"

    def wait(self) -> None:
        """Until every part posted is DONE (NixlTransferError: one failed, or not all were done within
        the agent's transfer timeout)."""
        deadline = time.monotonic() + self._owner._timeout_s
        pending = list(self._handles)
        backoff = Backoff(WAIT_FIRST_S, WAIT_MAX_S)
        while pending:
            try:
                states = [self._agent.check_xfer_state(h) for h in pending]
            except Exception as exc:  # NIXL's own errors (a peer gone): this transfer failed, the daemon serves on
                self._owner._count(failures=1)
                raise NixlTransferError(f"NIXL {self.op} {self._direction} {self.peer} failed: "
                                        f"{type(exc).__name__}: {exc}") from None
            if any(state not in ("PROC", "DONE") for state in states):
                self._owner._count(failures=1)
                raise NixlTransferError(f"NIXL {self.op} {self._direction} {self.peer} failed "
                                        f"(states {sorted(set(states))})")
            still = [h for h, state in zip(pending, states) if state == "PROC"]
            if len(still) < len(pending):
                backoff.reset()
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    self._owner._count(timeouts=1)
                    raise NixlTransferError(f"NIXL {self.op} {self._direction} {self.peer} not done within "
                                            f"{self._owner._timeout_s} s (TRANSFER_TIMEOUT_S)", timed_out=True)
                backoff.sleep(deadline)
        self._done = True
        if self._handles:
            self._owner._count(self.op, transfers=1, nbytes=self._bytes)

    def in_flight(self) -> bool:
        """Whether a part posted may still move (NIXL says PROC); one NIXL cannot tell about has ended."""
        if self._done:
            return False
        for handle in self._handles:
            try:
                if self._agent.check_xfer_state(handle) == "PROC":
                    return True
            except Exception:  # a failed part: it moves no more
                continue
        return False

    def __exit__(self, *exc_info) -> None:
        if self._hold is not None and self.in_flight():  # a release would not stop it: hold what it reads
            self._owner._park(self, *self._hold())
            return
        self.release()

    def release(self) -> None:
        """Release every handle, then the registrations (NixlTransferNotReleased: NIXL kept one)."""
        released = True
        for handle in self._handles:
            try:
                handle.release()
            except Exception as exc:  # still in flight and not cancellable: NIXL keeps it as leaked
                log.warning("event=nixl_release_failed agent=%s error=%s", self.peer, exc)
                released = False
        if released:
            self._owner._release(self._keys)
        else:  # its buffers stay registered (in use) for good
            raise NixlTransferNotReleased(
                f"a NIXL {self.op} {self._direction} {self.peer} (request {self.request_id}) could not be "
                f"released: it may still {'write into' if self.op == 'READ' else 'read'} the memory it was given")
