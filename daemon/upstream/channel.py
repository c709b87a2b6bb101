"""One authenticated connection to the upstream daemon, every call bounded by a deadline.

The socket work is :mod:`kvtier.wire.sockets`, the protocol a client-role
:class:`~kvtier.wire.connection.Connection`; this file only sets each blocking send and
receive's timeout to what is left of the caller's deadline, so no call outlives it.
A channel that failed in any way (a timeout mid-reply included) is closed, never reused.
"""
from __future__ import annotations

import select
import socket
import time

from kvtier.wire import connection as p
from kvtier.wire.sockets import receive_some, sendmsg_all

from .errors import UpstreamAuthError, UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable

PIPELINE_FRAMES_MAX = 8  # frames in flight on one connection, as the block clients do


def remaining_s(deadline: float) -> float:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value); UpstreamTimeout when none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise UpstreamTimeout("the upstream did not answer within the timeout")
    return left


class Channel:
    """A connection that has said HELLO (with the upstream token) and holds the upstream's HELLO document."""

    def __init__(self, host: str, port: int, token: str | None, client_name: str, deadline: float):
        try:
            self.sock = socket.create_connection((host, port), timeout=remaining_s(deadline))
        except socket.timeout:
            raise UpstreamTimeout(f"connecting to the upstream {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamUnavailable(f"cannot connect to the upstream {host}:{port}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = p.Connection(p.Role.CLIENT)
        self._next_id = 1
        self.info: dict = {}
        try:
            (reply,) = self.exchange([p.Hello(0, client_name, token or "")], deadline)
        except UpstreamProtocolError as exc:
            self.close()
            if exc.code == p.ErrorCode.AUTH:
                raise UpstreamAuthError(f"the upstream {host}:{port} refused our token: {exc}") from None
            raise
        except BaseException:
            self.close()
            raise
        self.info = dict(reply.info)

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(self.info.get("features", ()))

    def close(self) -> None:
        self.sock.close()

    def idle_and_open(self) -> bool:
        """True if this idle pooled connection can take a request: nothing (an EOF, a reset, an
        error frame before a close) has arrived on it since its last reply."""
        if self.sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLPRI)
        return not poller.poll(0)

    def exchange(self, messages: list, deadline: float) -> list:
        """Pipeline ``messages`` and return their replies in order, all before ``deadline``.
        An ERROR reply raises UpstreamProtocolError (with its code) once every reply is read."""
        replies, first_error, sent = [], None, 0
        try:
            while len(replies) < len(messages):
                while sent < len(messages) and sent - len(replies) < PIPELINE_FRAMES_MAX:
                    self.sock.settimeout(remaining_s(deadline))
                    sendmsg_all(self.sock, self.conn.send_parts(messages[sent], request_id=self._next_id))
                    self._next_id += 1
                    sent += 1
                reply = self._read_reply(deadline)
                expected = self._next_id - (sent - len(replies))
                if isinstance(reply, p.ErrorReply):
                    first_error = first_error or UpstreamProtocolError(reply.code, reply.message)
                    if reply.request_id == 0:
                        raise first_error
                elif reply.request_id != expected:
                    raise UpstreamProtocolError(p.ErrorCode.BAD_FRAME, f"reply for request {reply.request_id}, "
                                                f"expected {expected}")
                replies.append(reply)
        except socket.timeout:
            raise UpstreamTimeout("the upstream did not answer within the timeout") from None
        except p.ProtocolError as exc:
            raise UpstreamProtocolError(exc.code, f"the upstream broke the protocol: {exc}") from None
        except OSError as exc:
            raise UpstreamUnavailable(f"the upstream connection failed: {exc}") from None
        if first_error is not None:
            raise first_error
        return replies

    def _read_reply(self, deadline: float):
        while True:
            event = self.conn.next_event()
            if event is p.NEED_DATA:
                self.sock.settimeout(remaining_s(deadline))
                before = self.conn.bytes_received
                receive_some(self.sock, self.conn)
                if self.conn.bytes_received == before:  # the end of the stream, mid-reply
                    raise UpstreamUnavailable("the upstream closed the connection mid-reply")
                continue
            if event is p.CONNECTION_CLOSED:
                raise UpstreamUnavailable("the upstream closed the connection")
            return event
