"""A NIXL transport's control connection: the data protocol's NIXL_METADATA, NIXL_GET and
NIXL_PUT on a blocking socket, progressing the client agent while a reply is awaited
(:mod:`.nixl_transport`), and settled when a request ended without its reply (:meth:`ControlChannel.settle`)."""
from __future__ import annotations

import itertools
import select
import socket
import time

from kvtier.common.backoff import Backoff
from kvtier.wire import connection as p
from kvtier.wire.channel import Channel
from kvtier.wire.sockets import receive_some

WAIT_FIRST_S = 10e-6  # the first wait on the socket between calls of while_waiting
WAIT_MAX_S = 0.001  # the longest (a caller whose transfers move only while it progresses passes less)
_REQUEST_IDS = itertools.count(1)  # every control connection's request ids, process-wide (next() is atomic)


class ControlChannel(Channel):
    """One data-protocol connection for NIXL_METADATA, NIXL_GET and NIXL_PUT."""

    def __init__(self, host: str, port: int, timeout_s: float, token: str | None, name: str,
                 setup_timeout_s: float | None = None):
        """Connect and HELLO within ``setup_timeout_s`` each (``timeout_s`` when None); later
        exchanges wait ``timeout_s`` for their reply unless they name their own limit."""
        self.broken = False  # an exchange ended before its reply came
        self.last_request_id = 0
        self.generation = -1  # the agent generation this connection's daemon last loaded
        super().__init__(host, port, timeout_s if setup_timeout_s is None else setup_timeout_s, token, name)
        self.sock.settimeout(timeout_s)

    @property
    def same_host(self) -> bool:
        """A connection to an address of this host (loopback, or one of our own)."""
        local, peer = self.sock.getsockname()[0], self.sock.getpeername()[0]
        return local == peer or peer.startswith("127.") or peer == "::1"

    def exchange(self, message, while_waiting=None, wait_max_s: float = WAIT_MAX_S, timeout_s: float | None = None):
        """The reply to ``message``; ``while_waiting()`` is called until its
        first bytes arrive, between waits on the socket that double from WAIT_FIRST_S to ``wait_max_s``
        (back to the first after a call that returned true: progress). Request ids are unique in the
        process (they name the NIXL notifications, which all arrive at the one agent). ``timeout_s``:
        this exchange's limit instead of the connection's (a timeout leaves the connection unusable:
        close it)."""
        if timeout_s is not None:
            previous = self.sock.gettimeout()
            self.sock.settimeout(timeout_s)
            try:
                return self.exchange(message, while_waiting, wait_max_s)
            finally:
                self.sock.settimeout(previous)
        rid = self.last_request_id = self.send(message, request_id=next(_REQUEST_IDS))
        deadline = time.monotonic() + (self.sock.gettimeout() or 0)
        backoff = Backoff(WAIT_FIRST_S, wait_max_s)
        while while_waiting is not None and not select.select([self.sock], [], [], backoff.next_s())[0]:
            try:
                if while_waiting():
                    backoff.reset()
            except BaseException:
                self.broken = True  # its reply is still to come: the connection cannot serve another
                raise
            if time.monotonic() > deadline:
                raise p.ConnectionLost(f"no reply within {self.sock.gettimeout()} s")
        reply = self.read_reply()
        if isinstance(reply, p.ErrorReply):
            raise p.RemoteError(reply.code, reply.message, reply.request_id)
        if reply.request_id != rid:
            raise p.ProtocolError(p.ErrorCode.BAD_FRAME, f"reply for request {reply.request_id}, expected {rid}")
        return reply

    def settle(self, timeout_s: float, while_waiting=None, wait_max_s: float = WAIT_MAX_S):
        """After an exchange that ended before its reply: close our side of the connection and wait up
        to ``timeout_s`` for the daemon to end the request. kvtierd reads our end of the stream only
        once the request it serves is over, then closes its side. Returns the request's reply (an
        ``ErrorReply`` for an error) if it came, ``CONNECTION_CLOSED`` if the daemon closed (or reset)
        the connection without one, None if neither came in time or what came does not parse.
        ``while_waiting()`` is called between waits meanwhile, as in :meth:`exchange`. The connection is
        unusable after."""
        self.broken = True
        deadline = time.monotonic() + timeout_s
        backoff = Backoff(WAIT_FIRST_S, wait_max_s)
        try:
            self.sock.shutdown(socket.SHUT_WR)
            while True:
                event = self.conn.next_event()
                if event is p.CONNECTION_CLOSED or (event is not p.NEED_DATA and event.request_id != 0):
                    return event  # a connection-level ERROR (request id 0) comes before the daemon's close
                if event is not p.NEED_DATA:
                    continue
                if (left := deadline - time.monotonic()) <= 0:
                    return None
                if select.select([self.sock], [], [], left if while_waiting is None else min(left, backoff.next_s()))[0]:
                    receive_some(self.sock, self.conn)
                elif while_waiting is not None and while_waiting():
                    backoff.reset()
        except p.ProtocolError:
            return None
        except OSError:  # reset, or never connected: the daemon's side of it is gone
            return p.CONNECTION_CLOSED

