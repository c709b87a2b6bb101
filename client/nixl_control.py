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
from kvtier.wire.sockets import receive_some, sendmsg_all

WAIT_FIRST_S = 10e-6  # the first wait on the socket between calls of while_waiting
WAIT_MAX_S = 0.001  # the longest (a caller whose transfers move only while it progresses passes less)
_REQUEST_IDS = itertools.count(1)  # every control connection's request ids, process-wide (next() is atomic)


class ControlChannel:
    """One data-protocol connection for NIXL_METADATA and NIXL_GET."""

    def __init__(self, host: str, port: int, timeout_s: float, token: str | None, name: str,
                 setup_timeout_s: float | None = None):
        """Connect and HELLO within ``setup_timeout_s`` each (``timeout_s`` when None); later
        exchanges wait ``timeout_s`` for their reply unless they name their own limit."""
        setup_timeout_s = timeout_s if setup_timeout_s is None else setup_timeout_s
        self.sock = socket.create_connection((host, port), timeout=setup_timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = p.Connection(p.Role.CLIENT)
        self.broken = False  # an exchange ended before its reply came
        self.last_request_id = 0
        self.generation = -1  # the agent generation this connection's daemon last loaded
        try:
            self.info = dict(self.exchange(p.Hello(0, name, token or "")).info)
            self.sock.settimeout(timeout_s)
        except BaseException:
            self.sock.close()
            raise

    @property
    def same_host(self) -> bool:
        """A connection to an address of this host (loopback, or one of our own)."""
        local, peer = self.sock.getsockname()[0], self.sock.getpeername()[0]
        return local == peer or peer.startswith("127.") or peer == "::1"

    def exchange(self, message, while_waiting=None, wait_max_s: float = WAIT_MAX_S, timeout_s: float | None = None):
        """The reply to ``message``; ``while_waiting()`` is called until its first bytes arrive, between
        waits on the socket that double from WAIT_FIRST_S to ``wait_max_s`` (back to the first after a
        call that returned true: progress). Request ids are unique in the process (they name the NIXL
        notifications, which all arrive at the one agent). ``timeout_s``: this exchange's limit instead
        of the connection's (a timeout leaves the connection unusable: close it)."""
        if timeout_s is not None:
            previous = self.sock.gettimeout()
            self.sock.settimeout(timeout_s)
            try:
                return self.exchange(message, while_waiting, wait_max_s)
            finally:
                self.sock.settimeout(previous)
        rid = self.last_request_id = next(_REQUEST_IDS)
        sendmsg_all(self.sock, self.conn.send_parts(message, request_id=rid))
        deadline = time.monotonic() + (self.sock.gettimeout() or 0)
        backoff = Backoff(WAIT_FIRST_S, wait_max_s)
        while True:
            event = self.conn.next_event()
            if event is p.NEED_DATA:
                while while_waiting is not None and not select.select([self.sock], [], [], backoff.next_s())[0]:
                    try:
                        if while_waiting():
                            backoff.reset()
                    except BaseException:
                        self.broken = True  # its reply is still to come: the connection cannot serve another
                        raise
                    if time.monotonic() > deadline:
                        raise p.ConnectionLost(f"no reply within {self.sock.gettimeout()} s")
                receive_some(self.sock, self.conn)
                continue
            if event is p.CONNECTION_CLOSED:
                raise p.ConnectionLost("the daemon closed the NIXL control connection")
            if isinstance(event, p.ErrorReply):
                raise p.RemoteError(event.code, event.message, event.request_id)
            return event

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

    def close(self) -> None:
        self.sock.close()
