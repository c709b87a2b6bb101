"""The data server: listens, accepts, and gives each admitted connection a thread.

Concurrency model: one thread per connection (:mod:`.connection_loop`). The
engine is thread-safe and does blocking device I/O, so threads let requests
on different connections overlap without an executor hop. A connection past
``max_connections_per_peer`` from one client address is answered BUSY naming
the limit and closed; past ``max_connections``, a newcomer that greets takes the
slot of the connection idle longest (:mod:`.slots`). An authenticated
connection idle for ``idle_timeout_s`` between requests is closed (clients
reconnect: a pooled connection the daemon closed is dropped before use).

Shutdown (:meth:`DataServer.stop`): stop accepting, wake idle connections,
let busy ones finish the requests already received, then return; the caller
then seals and syncs the engine.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time

from kvtier.daemon.server.arenas import ReplyArenas, ReplyArenaStatistics
from kvtier.daemon.server.closing import send_error_quietly
from kvtier.daemon.server.connection_loop import ConnectionLoop
from kvtier.daemon.server.handler import RequestHandler
from kvtier.daemon.server.slots import ConnectionSlots, Slot
from kvtier.daemon.server.stats import ServerStatistics, ServerStatsRecorder
from kvtier.daemon.server.stop_signal import StopSignal
from kvtier.wire import connection as p

log = logging.getLogger("kvtier.daemon.server")

LISTEN_BACKLOG = 512  # pending connections the kernel queues
HELLO_TIMEOUT_S = 5.0  # from accept to a successful HELLO (a client sends it first thing): an idle or
# trickling unauthenticated peer gives its connection slot back this soon (or at the frame timeout, if shorter)
SHUTDOWN_GRACE_S = 30.0  # how long stop() waits for in-flight requests
IDLE_TIMEOUT_S_DEFAULT = 600.0  # an authenticated connection idle this long gives its slot back


class DataServer:
    """Serves the data protocol for one engine."""

    def __init__(self, engine, host: str, port: int, *, token=lambda: None, region_size_bytes: int,
                 max_connections: int = 1024, frame_timeout_s: float = 30.0,
                 payload_bytes_max: int = p.PAYLOAD_BYTES_MAX, hello_timeout_s: float | None = None,
                 reply_arenas: ReplyArenas | None = None, max_connections_per_peer: int | None = None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S_DEFAULT):
        self._host, self._port = host, port
        self._slots = ConnectionSlots(max_connections,
                                      max_connections if max_connections_per_peer is None else max_connections_per_peer)
        self._limits = p.Limits(payload_bytes_max=payload_bytes_max,
                                block_bytes_max=min(engine.block_size_max_bytes, payload_bytes_max))
        self._recorder = ServerStatsRecorder()
        self._handler = RequestHandler(engine, self._recorder, token, region_size_bytes, self._limits,
                                       lambda: self.statistics().as_dict(), reply_arenas)
        self._stop = StopSignal()
        self._connections = ConnectionLoop(
            self._handler, self._recorder, self._limits, self._stop, self._slots, frame_timeout_s,
            min(HELLO_TIMEOUT_S, frame_timeout_s) if hello_timeout_s is None else hello_timeout_s, idle_timeout_s)
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._accept_thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None

    def add_feature(self, name: str) -> None:
        """Name a capability in HELLO's ``features`` (e.g. ``kv_events``); before :meth:`start`."""
        self._handler.extra_features.append(name)

    def attach_nixl(self, service) -> None:
        """Answer NIXL_METADATA / NIXL_GET / NIXL_PUT with ``service`` (kvtier.daemon.nixl) and list "nixl"
        and "nixl_put" in HELLO's ``features``; before :meth:`start`."""
        from kvtier.wire.events import FEATURE_NIXL, FEATURE_NIXL_PUT
        self._handler.attach_nixl(service)
        self.add_feature(FEATURE_NIXL)
        self.add_feature(FEATURE_NIXL_PUT)

    def set_upstream(self, pull_through) -> None:
        """Answer LOOKUP and GET misses from an upstream (``kvtier.daemon.upstream.PullThrough``);
        before :meth:`start`. HELLO then lists ``upstream`` and replies carry origins when asked."""
        self._handler.upstream = pull_through
        self.add_feature(p.FEATURE_UPSTREAM)

    def set_chain_observer(self, observe) -> None:
        """Hand ``observe(ns_id, packed keys)`` every LOOKUP and GET chain (pre-placement's
        popularity counts; it must be cheap: it runs on the request's thread); before :meth:`start`."""
        self._handler.observe_chain = observe

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> tuple[str, int]:
        """Bind, listen and start accepting; returns the real (host, port)."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        sock.listen(LISTEN_BACKLOG)
        self._listener = sock
        self.address = sock.getsockname()[:2]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvtierd-accept", daemon=True)
        self._accept_thread.start()
        return self.address

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop accepting, finish in-flight requests, close every connection."""
        if not self._stop.set():
            return
        if self._accept_thread is not None:
            self._accept_thread.join()
        deadline = time.monotonic() + grace_s
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            log.warning("event=shutdown_grace_expired connections=%d", sum(t.is_alive() for t in threads))

    def statistics(self) -> ServerStatistics:
        return self._recorder.snapshot()

    def reply_arena_statistics(self) -> ReplyArenaStatistics:
        """The request arenas (PUT payloads, GET replies) shared by all connections (see :mod:`.arenas`)."""
        return self._handler.buffers.statistics()

    @property
    def limits(self) -> p.Limits:
        return self._limits

    # -- accepting ----------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self._listener
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        poller.register(self._stop.fd, select.POLLIN)
        try:
            while not self._stop.is_set():
                ready = {fd for fd, _ in poller.poll()}
                if self._stop.fd in ready:
                    break
                try:
                    sock, addr = listener.accept()
                except OSError as exc:
                    log.warning("event=accept_failed error=%s", exc)
                    continue
                self._admit(sock, addr)
        finally:
            listener.close()

    def _admit(self, sock: socket.socket, addr) -> None:
        peer, host = f"{addr[0]}:{addr[1]}", addr[0]
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        slot = self._slots.open(host)
        if isinstance(slot, str):
            self._recorder.connection_rejected()
            self._recorder.error(p.ErrorCode.BUSY.name)
            log.warning("event=connection_refused peer=%s reason=%s", peer, slot)
            threading.Thread(target=self._refuse, args=(sock, slot), name="kvtierd-refuse", daemon=True).start()
            return
        slot.wake = lambda: _shut_reading(sock)
        t = threading.Thread(target=self._serve, args=(sock, peer, slot), name=f"kvtierd-conn-{peer}", daemon=True)
        with self._lock:
            self._threads.add(t)
        self._recorder.connection_opened()
        t.start()

    def _serve(self, sock: socket.socket, peer: str, slot: Slot) -> None:
        try:
            self._connections.serve(sock, peer, slot)
        finally:
            self._slots.close(slot)
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _refuse(self, sock: socket.socket, message: str) -> None:
        with sock:
            send_error_quietly(sock, p.Connection(p.Role.SERVER), 0, p.ErrorCode.BUSY, message)


def _shut_reading(sock: socket.socket) -> None:
    """Wake a connection's loop (blocked reading) to close it: it reads the end of the stream."""
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass  # closed meanwhile
