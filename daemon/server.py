"""The data server: threads with blocking sockets around the sans-IO protocol.

Concurrency model (chosen by measurement, see perf/bench_tcp.py and
docs/protocol.md): one thread per connection. The engine is thread-safe and
does blocking device I/O, so threads let requests on different connections
overlap without an executor hop; payloads are received with ``recv_into``
into a buffer sized from the frame header (after its limits are checked) and
sent with ``sendmsg`` of header + memoryviews. A request's payload (PUT) and
its reply's blocks (GET) live in an arena the connection borrows from the
daemon-wide pool (server_arenas) and gives back once the reply is sent.

Before its HELLO succeeds a connection is read under the before-HELLO rule
(``Connection(hello_first=True)``: one HELLO-sized frame, nothing allocated
for anything else) and must say HELLO within ``hello_timeout_s`` of opening,
so unauthenticated peers cost neither memory nor, for long, a connection slot.

Shutdown (:meth:`DataServer.stop`): stop accepting, wake idle connections,
let busy ones finish the requests already received, then return; the caller
then seals and syncs the engine.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time

from kvtier.wire import connection as p
from kvtier.wire.sockets import sendmsg_all
from kvtier.wire.sockets import RECV_CHUNK_BYTES, receive_some
from kvtier.daemon.server_arenas import ReplyArenas, ReplyArenaStatistics
from kvtier.daemon.server_handler import RequestHandler, Session
from kvtier.daemon.server_stats import ServerStatistics, ServerStatsRecorder

log = logging.getLogger("kvtier.daemon.server")

LISTEN_BACKLOG = 512  # pending connections the kernel queues
HELLO_TIMEOUT_S = 5.0  # from accept to a successful HELLO (a client sends it first thing): an idle or
# trickling unauthenticated peer gives its connection slot back this soon (or at the frame timeout, if shorter)
SHUTDOWN_GRACE_S = 30.0  # how long stop() waits for in-flight requests
CLOSE_DRAIN_BYTES_MAX = 4 << 20  # unread bytes swallowed before closing on an error, so the error frame
CLOSE_DRAIN_S = 0.5  # is not destroyed by a TCP reset; bounded in bytes and time


class DataServer:
    """Serves the data protocol for one engine."""

    def __init__(self, engine, host: str, port: int, *, token=lambda: None, region_size_bytes: int,
                 max_connections: int = 1024, frame_timeout_s: float = 30.0,
                 payload_bytes_max: int = p.PAYLOAD_BYTES_MAX, hello_timeout_s: float | None = None,
                 reply_arenas: ReplyArenas | None = None):
        self._engine = engine
        self._host, self._port = host, port
        self._max_connections = max_connections
        self._frame_timeout_s = frame_timeout_s
        self._hello_timeout_s = min(HELLO_TIMEOUT_S, frame_timeout_s) if hello_timeout_s is None else hello_timeout_s
        self._limits = p.Limits(payload_bytes_max=payload_bytes_max,
                                block_bytes_max=min(engine.block_size_max_bytes, payload_bytes_max))
        self._recorder = ServerStatsRecorder()
        self._handler = RequestHandler(engine, self._recorder, token, region_size_bytes, self._limits,
                                       lambda: self.statistics().as_dict(), reply_arenas)
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._accept_thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None

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
        if self._stopping.is_set():
            return
        self._stopping.set()
        os.write(self._wake_w, b"x")  # level-triggered: wakes every poller, now and later
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
        """The request arenas (PUT payloads, GET replies) shared by all connections (see server_arenas)."""
        return self._handler.arenas.statistics()

    @property
    def limits(self) -> p.Limits:
        return self._limits

    # -- accepting ----------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self._listener
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self._stopping.is_set():
                ready = {fd for fd, _ in poller.poll()}
                if self._wake_r in ready:
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
        peer = f"{addr[0]}:{addr[1]}"
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            over = len(self._threads) >= self._max_connections
            if not over:
                t = threading.Thread(target=self._serve, args=(sock, peer), name=f"kvtierd-conn-{peer}", daemon=True)
                self._threads.add(t)
        if over:
            self._recorder.connection_rejected()
            self._recorder.error(p.ErrorCode.BUSY.name)
            log.warning("event=connection_refused peer=%s reason=over_limit limit=%d", peer, self._max_connections)
            threading.Thread(target=self._refuse, args=(sock,), name="kvtierd-refuse", daemon=True).start()
            return
        self._recorder.connection_opened()
        t.start()

    # -- one connection -----------------------------------------------------
    def _serve(self, sock: socket.socket, peer: str) -> None:
        conn = p.Connection(p.Role.SERVER, self._limits, hello_first=True)
        session = Session(peer)
        log.debug("event=connection_open peer=%s", peer)
        try:
            self._serve_loop(sock, conn, session, time.monotonic() + self._hello_timeout_s)
        except p.ProtocolError as exc:
            log.warning("event=protocol_error peer=%s code=%s error=%s", peer, exc.code.name, exc)
            self._recorder.error(exc.code.name)
            self._send_error_quietly(sock, conn, exc.request_id, exc.code, str(exc))
        except socket.timeout:
            self._recorder.error(p.ErrorCode.TIMEOUT.name)
            if conn.awaiting_hello:
                log.warning("event=hello_timeout peer=%s timeout_s=%s", peer, self._hello_timeout_s)
                message = f"no HELLO within {self._hello_timeout_s} s of connecting"
            else:
                log.warning("event=frame_timeout peer=%s timeout_s=%s", peer, self._frame_timeout_s)
                message = f"connection stalled mid-frame for {self._frame_timeout_s} s"
            self._send_error_quietly(sock, conn, 0, p.ErrorCode.TIMEOUT, message)
        except OSError as exc:
            log.info("event=connection_error peer=%s error=%s", peer, exc)
        except Exception:  # never let one connection take the daemon down
            log.exception("event=connection_crashed peer=%s", peer)
            self._recorder.error(p.ErrorCode.INTERNAL.name)
        finally:
            self._handler.reply_sent(session)  # an arena lent to a reply that failed to go out
            sock.close()
            self._recorder.connection_closed()
            with self._lock:
                self._threads.discard(threading.current_thread())
            log.debug("event=connection_closed peer=%s", peer)

    def _serve_loop(self, sock: socket.socket, conn: p.Connection, session: Session, hello_deadline: float) -> None:
        handler, recorder = self._handler, self._recorder
        placed = None
        received_before = 0
        while True:
            event = conn.next_event()
            if event is p.NEED_DATA:
                wait_s = None
                if conn.awaiting_hello:  # one deadline for the whole HELLO, however the bytes trickle in
                    wait_s = hello_deadline - time.monotonic()
                    if wait_s <= 0:
                        raise socket.timeout("no HELLO before the deadline")
                    sock.settimeout(min(wait_s, self._frame_timeout_s))
                if not conn.in_frame and not self._wait_for_request(sock, wait_s):
                    return
                head = conn.pending_head
                refused = None
                if head is not None and head is not placed:
                    placed = head  # an arena if it fits and one is free; else a transient buffer, budget permitting
                    buffer = handler.payload_buffer(session, head.payload_len)
                    if buffer is not None:
                        conn.set_payload_buffer(buffer)
                    elif (why := handler.admit_payload(session, head.payload_len)) is not None:
                        refused = conn.reject_payload(*why)
                if refused is not None:
                    sent = sendmsg_all(sock, conn.send_parts(handler.handle(refused, session)[0]))
                    recorder.request_done("rejected", 0.0, 0, sent)
                    continue
                receive_some(sock, conn)
                continue
            if event is p.CONNECTION_CLOSED:
                return
            started = time.perf_counter()
            reply, close_after = handler.handle(event, session)
            try:
                sent = sendmsg_all(sock, conn.send_parts(reply))
            finally:
                handler.reply_sent(session)
            if conn.awaiting_hello and session.greeted:
                conn.hello_accepted()  # the full limits from the next frame on
                sock.settimeout(self._frame_timeout_s)
            op = type(event).__name__.lower() if not isinstance(event, p.Rejected) else "rejected"
            recorder.request_done(op, time.perf_counter() - started, conn.bytes_received - received_before, sent)
            received_before = conn.bytes_received  # pipelined frames already buffered count for the next one
            if close_after:
                log.warning("event=connection_closed_by_server peer=%s reason=%s", session.peer,
                            getattr(reply, "message", ""))
                _linger(sock)
                return

    def _wait_for_request(self, sock: socket.socket, timeout_s: float | None) -> bool:
        """Block until the idle connection has bytes (True) or we stop (False);
        socket.timeout after ``timeout_s`` (None: wait as long as it takes)."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(None if timeout_s is None else max(1, int(timeout_s * 1000)))}
        if not ready:
            raise socket.timeout(f"idle for {timeout_s} s")
        return self._wake_r not in ready and not self._stopping.is_set()

    def _refuse(self, sock: socket.socket) -> None:
        with sock:
            self._send_error_quietly(sock, p.Connection(p.Role.SERVER), 0, p.ErrorCode.BUSY,
                                     f"too many connections (limit {self._max_connections})")

    @staticmethod
    def _send_error_quietly(sock, conn, request_id, code, message) -> None:
        """Send an error frame, then half-close and drain so it arrives intact."""
        try:
            sock.settimeout(CLOSE_DRAIN_S)
            sendmsg_all(sock, conn.send_parts(p.ErrorReply(request_id, code, message)))
        except OSError:
            return
        _linger(sock)


def _linger(sock: socket.socket) -> None:
    """Half-close, then swallow what the peer still sends (bounded), so the
    frames we sent are not destroyed by a reset when we close."""
    try:
        sock.settimeout(CLOSE_DRAIN_S)
        sock.shutdown(socket.SHUT_WR)
        deadline, drained = time.monotonic() + CLOSE_DRAIN_S, 0
        while drained < CLOSE_DRAIN_BYTES_MAX and time.monotonic() < deadline:
            chunk = sock.recv(RECV_CHUNK_BYTES)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass
