"""One data connection, served on its own thread with a blocking socket around the sans-IO protocol.

Payloads are received with ``recv_into`` into a buffer sized from the frame
header (after its limits are checked) and replies sent with ``sendmsg`` of
header + memoryviews. A request's payload (PUT) and its reply's blocks (GET)
live in a buffer the request borrows (:mod:`.request_buffers`) and gives
back once the reply is sent.

Before its HELLO succeeds a connection is read under the before-HELLO rule
(``Connection(hello_first=True)``: one HELLO-sized frame, nothing allocated
for anything else) and must say HELLO within ``hello_timeout_s`` of opening,
so unauthenticated peers cost neither memory nor, for long, a connection slot.
An authenticated connection that sits idle between requests for
``idle_timeout_s`` is told so (ERROR TIMEOUT, request id 0) and closed.
After HELLO every frame has one deadline: ``frame_timeout_s`` plus its payload at
PAYLOAD_RATE_MIN_BYTES_S from when its header is in (its header and meta, within the timeout plus
the largest meta at that rate). A PUT being received into the open region holds it (every other
writer waits, see ``engine.puts``), so its deadline is RESERVED_PAYLOAD_STALL_S (at most the frame
timeout) plus its payload at RESERVED_PAYLOAD_RATE_MIN_BYTES_S. A peer that stalls, or sends a byte
now and then, cannot hold a buffer, the transient budget or the open region past it: it is told
so (ERROR TIMEOUT) and closed.
An idle connection wakes when the server stops; a busy one finishes the
requests already received first.
"""
from __future__ import annotations

import logging
import select
import socket
import time

from kvtier.common.cluster_url import REPAIR_CLIENT_NAME
from kvtier.daemon.server.closing import linger, send_error_quietly
from kvtier.daemon.server.handler import RequestHandler
from kvtier.daemon.server.session import Session
from kvtier.daemon.server.slots import ConnectionSlots, Slot
from kvtier.daemon.server.stats import ServerStatsRecorder
from kvtier.daemon.server.stop_signal import StopSignal
from kvtier.wire import connection as p
from kvtier.wire.sockets import receive_some, sendmsg_all

log = logging.getLogger("kvtier.daemon.server")

RESERVED_PAYLOAD_STALL_S = 2.0  # a frame's deadline in the open region, before its payload's time
# After HELLO a frame must arrive whole in time, however its bytes trickle in: within the frame
# timeout (RESERVED_PAYLOAD_STALL_S in the open region) plus its payload at these rates at least.
PAYLOAD_RATE_MIN_BYTES_S = 32 << 20
RESERVED_PAYLOAD_RATE_MIN_BYTES_S = 32 << 20


class ConnectionLoop:
    """Serves connections of one data server, one :meth:`serve` call per connection."""

    def __init__(self, handler: RequestHandler, recorder: ServerStatsRecorder, limits: p.Limits, stop: StopSignal,
                 slots: ConnectionSlots, frame_timeout_s: float, hello_timeout_s: float, idle_timeout_s: float):
        self._handler = handler
        self._slots = slots
        self._buffers = handler.buffers
        self._recorder = recorder
        self._limits = limits
        self._stop = stop
        self._frame_timeout_s = frame_timeout_s
        self._reserved_stall_s = min(frame_timeout_s, RESERVED_PAYLOAD_STALL_S)
        self._hello_timeout_s = hello_timeout_s
        self._idle_timeout_s = idle_timeout_s

    def serve(self, sock: socket.socket, peer: str, slot: Slot) -> None:
        """Serve one connection until it closes, fails, is evicted or the server stops; then close it."""
        conn = p.Connection(p.Role.SERVER, self._limits, hello_first=True)
        session = Session(peer, peer_gone=lambda: peer_shut_down(sock))
        log.debug("event=connection_open peer=%s", peer)
        try:
            self._serve_requests(sock, conn, session, slot, time.monotonic() + self._hello_timeout_s)
            if slot.evicted:
                raise _Evicted()
        except _Evicted:
            self._recorder.connection_evicted()
            log.info("event=connection_evicted peer=%s", peer)
            send_error_quietly(sock, conn, 0, p.ErrorCode.BUSY,
                               f"closed: every connection slot (max_connections {self._slots.max_connections}) was "
                               f"taken and this one had gone longest without a request other than PING; "
                               f"reconnect when there is work")
        except p.ProtocolError as exc:
            log.warning("event=protocol_error peer=%s code=%s error=%s", peer, exc.code.name, exc)
            self._recorder.error(exc.code.name)
            send_error_quietly(sock, conn, exc.request_id, exc.code, str(exc))
        except _IdleTimeout:
            self._recorder.connection_idle_closed()
            log.info("event=idle_timeout peer=%s timeout_s=%s", peer, self._idle_timeout_s)
            send_error_quietly(sock, conn, 0, p.ErrorCode.TIMEOUT,
                               f"idle for {self._idle_timeout_s} s between requests (idle_timeout): closed")
        except _FrameTooSlow as exc:
            self._recorder.error(p.ErrorCode.TIMEOUT.name)
            log.warning("event=frame_too_slow peer=%s payload_bytes=%d allowed_s=%.1f", peer, exc.nbytes,
                        exc.allowed_s)
            send_error_quietly(sock, conn, 0, p.ErrorCode.TIMEOUT, str(exc))
        except socket.timeout:
            self._recorder.error(p.ErrorCode.TIMEOUT.name)
            if conn.awaiting_hello:
                log.warning("event=hello_timeout peer=%s timeout_s=%s", peer, self._hello_timeout_s)
                message = f"no HELLO within {self._hello_timeout_s} s of connecting"
            else:
                log.warning("event=frame_timeout peer=%s timeout_s=%s", peer, self._frame_timeout_s)
                message = f"connection stalled mid-frame for {self._frame_timeout_s} s"
            send_error_quietly(sock, conn, 0, p.ErrorCode.TIMEOUT, message)
        except OSError as exc:
            log.info("event=connection_error peer=%s error=%s", peer, exc)
        except Exception:  # never let one connection take the daemon down
            log.exception("event=connection_crashed peer=%s", peer)
            self._recorder.error(p.ErrorCode.INTERNAL.name)
        finally:
            self._handler.abort_in_place(session)  # a PUT payload cut off mid-way: nothing of it is stored
            self._handler.connection_closed(session)  # its NIXL peer, if it loaded one
            self._buffers.reply_sent(session)  # a buffer lent to a reply that failed to go out
            sock.close()
            self._recorder.connection_closed()
            log.debug("event=connection_closed peer=%s", peer)

    def _serve_requests(self, sock: socket.socket, conn: p.Connection, session: Session, slot: Slot,
                        hello_deadline: float) -> None:
        handler, buffers, recorder = self._handler, self._buffers, self._recorder
        placed = None
        frame_deadline: _FrameDeadline | None = None  # after HELLO: when the frame being received must be in
        received_before = 0
        while True:
            event = conn.next_event()
            if event is p.NEED_DATA:
                wait_s = None if conn.awaiting_hello else self._idle_timeout_s
                if conn.awaiting_hello:  # one deadline for the whole HELLO, however the bytes trickle in
                    wait_s = hello_deadline - time.monotonic()
                    if wait_s <= 0:
                        raise socket.timeout("no HELLO before the deadline")
                    sock.settimeout(min(wait_s, self._frame_timeout_s))
                if not conn.in_frame:
                    if not self._wait_for_request(sock, wait_s, conn.awaiting_hello):
                        return
                    if not self._slots.begin(slot):  # a frame begins: the slot is not evicted from now on
                        raise _Evicted()
                head = conn.pending_head
                refused = None
                if head is not None and head is not placed:
                    placed = head  # a PUT into the open region; else an arena if it fits and one is free;
                    # else a transient buffer, budget permitting
                    buffer = handler.payload_in_place(session, head, conn.pending_meta) if session.greeted else None
                    in_place = buffer is not None
                    if not in_place:
                        buffer = buffers.payload_buffer(session, head.payload_len)
                    if buffer is not None:
                        conn.set_payload_buffer(buffer)
                    elif (why := buffers.admit_payload(session, head.payload_len)) is not None:
                        refused = conn.reject_payload(*why)
                    if session.greeted:
                        frame_deadline = self._payload_deadline(head.payload_len, in_place)
                if refused is not None:
                    frame_deadline = None
                    sent = sendmsg_all(sock, conn.send_parts(handler.handle(refused, session)[0]))
                    recorder.request_done("rejected", 0.0, 0, sent)
                    continue
                if frame_deadline is None and session.greeted and conn.in_frame:
                    allowed_s = self._frame_timeout_s + self._limits.meta_bytes_max / PAYLOAD_RATE_MIN_BYTES_S
                    frame_deadline = _FrameDeadline(time.monotonic() + allowed_s, 0, allowed_s, False)  # header, meta
                if frame_deadline is not None:
                    if frame_deadline.left() <= 0:
                        raise frame_deadline.too_slow()
                    sock.settimeout(frame_deadline.left())
                try:
                    receive_some(sock, conn)
                except socket.timeout:
                    if frame_deadline is not None:
                        raise frame_deadline.too_slow() from None
                    raise
                continue
            if frame_deadline is not None:
                frame_deadline = None
                sock.settimeout(self._frame_timeout_s)
            if event is p.CONNECTION_CLOSED:
                return
            started = time.perf_counter()
            if not self._slots.begin(slot):
                raise _Evicted()
            try:
                reply, close_after = handler.handle(event, session)
            finally:
                handler.abort_in_place(session)  # a reservation its request did not commit
                self._slots.end(slot, work=not isinstance(event, p.Ping))
            if isinstance(event, p.Hello) and session.greeted and (refusal := self._slots.greeted(slot)):
                recorder.connection_rejected()
                recorder.error(p.ErrorCode.BUSY.name)
                log.warning("event=connection_refused peer=%s reason=%s", session.peer, refusal)
                reply, close_after = p.ErrorReply(event.request_id, p.ErrorCode.BUSY, refusal), True
            if reply is None:  # the peer gave the request up (shut down its side): it ends without a reply
                log.info("event=request_abandoned_by_peer peer=%s op=%s", session.peer, type(event).__name__)
                return
            try:
                sent = sendmsg_all(sock, conn.send_parts(reply))
            finally:
                buffers.reply_sent(session)
            if conn.awaiting_hello and session.greeted:
                conn.hello_accepted()  # the full limits from the next frame on
                sock.settimeout(self._frame_timeout_s)
            op = type(event).__name__.lower() if not isinstance(event, p.Rejected) else "rejected"
            recorder.request_done(op, time.perf_counter() - started, conn.bytes_received - received_before, sent)
            if op == "put" and session.client_name == REPAIR_CLIENT_NAME:
                recorder.repair_received(conn.bytes_received - received_before)
            received_before = conn.bytes_received  # pipelined frames already buffered count for the next one
            if close_after:
                log.warning("event=connection_closed_by_server peer=%s reason=%s", session.peer,
                            getattr(reply, "message", ""))
                linger(sock)
                return

    def _payload_deadline(self, nbytes: int, in_place: bool) -> "_FrameDeadline":
        bound, rate = ((self._reserved_stall_s, RESERVED_PAYLOAD_RATE_MIN_BYTES_S) if in_place
                       else (self._frame_timeout_s, PAYLOAD_RATE_MIN_BYTES_S))
        allowed_s = bound + nbytes / rate
        return _FrameDeadline(time.monotonic() + allowed_s, nbytes, allowed_s, in_place)

    def _wait_for_request(self, sock: socket.socket, timeout_s: float | None, before_hello: bool) -> bool:
        """Block until the idle connection has bytes (True) or we stop (False);
        after ``timeout_s`` (None: wait as long as it takes) socket.timeout
        before HELLO, _IdleTimeout after it."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(self._stop.fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(None if timeout_s is None else max(1, int(timeout_s * 1000)))}
        if not ready:
            raise socket.timeout(f"idle for {timeout_s} s") if before_hello else _IdleTimeout()
        return self._stop.fd not in ready and not self._stop.is_set()


def peer_shut_down(sock: socket.socket) -> bool:
    """Whether the peer has shut down its side of ``sock`` (a FIN, even behind bytes not read yet) or the
    connection is gone (reset, closed), without blocking."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)  # POLLHUP and POLLERR are always reported
    return bool(poller.poll(0))


class _FrameDeadline:
    """When the frame being received must be in (a monotonic time), and what it carries."""

    def __init__(self, at: float, nbytes: int, allowed_s: float, in_place: bool) -> None:
        self.at, self.nbytes, self.allowed_s, self.in_place = at, nbytes, allowed_s, in_place

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def too_slow(self) -> "_FrameTooSlow":
        return _FrameTooSlow(self.nbytes, self.allowed_s, self.in_place)


class _FrameTooSlow(Exception):
    """A frame did not arrive whole by its deadline (its bytes trickled in)."""

    def __init__(self, nbytes: int, allowed_s: float, in_place: bool):
        where = " into the open region (other writers wait for it)" if in_place else ""
        rate = (RESERVED_PAYLOAD_RATE_MIN_BYTES_S if in_place else PAYLOAD_RATE_MIN_BYTES_S) >> 20
        what = f"a frame with a {nbytes}-byte payload{where}" if nbytes else "a frame's header and meta"
        super().__init__(f"{what} did not arrive within {allowed_s:.1f} s (the timeout plus the payload at "
                         f"{rate} MiB/s): closed")
        self.nbytes, self.allowed_s = nbytes, allowed_s


class _Evicted(Exception):
    """The connection's slot went to a newcomer (it had gone longest without work)."""


class _IdleTimeout(Exception):
    """An authenticated connection sat idle between requests for the idle timeout."""
