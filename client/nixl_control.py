"""A NIXL transport's control connection: the data protocol's NIXL_METADATA, NIXL_GET and
NIXL_PUT on a blocking socket, progressing the client agent while a reply is awaited
(:mod:`.nixl_transport`)."""
from __future__ import annotations

import itertools
import os
import select
import socket
import time

from kvtier.wire import connection as p
from kvtier.wire.sockets import receive_some, sendmsg_all

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

    def exchange(self, message, while_waiting=None, poll_s: float = 0.0, timeout_s: float | None = None):
        """The reply to ``message``; ``while_waiting()`` is called until its first bytes arrive,
        every ``poll_s`` (0: without pause). Request ids are unique in the process (they name
        the NIXL notifications, which all arrive at the one agent). ``timeout_s``: this exchange's
        limit instead of the connection's (a timeout leaves the connection unusable: close it)."""
        if timeout_s is not None:
            previous = self.sock.gettimeout()
            self.sock.settimeout(timeout_s)
            try:
                return self.exchange(message, while_waiting, poll_s)
            finally:
                self.sock.settimeout(previous)
        rid = self.last_request_id = next(_REQUEST_IDS)
        sendmsg_all(self.sock, self.conn.send_parts(message, request_id=rid))
        deadline = time.monotonic() + (self.sock.gettimeout() or 0)
        while True:
            event = self.conn.next_event()
            if event is p.NEED_DATA:
                while while_waiting is not None and not select.select([self.sock], [], [], poll_s)[0]:
                    try:
                        while_waiting()
                    except BaseException:
                        self.broken = True  # its reply is still to come: the connection cannot serve another
                        raise
                    os.sched_yield()
                    if time.monotonic() > deadline:
                        raise p.ConnectionLost(f"no reply within {self.sock.gettimeout()} s")
                receive_some(self.sock, self.conn)
                continue
            if event is p.CONNECTION_CLOSED:
                raise p.ConnectionLost("the daemon closed the NIXL control connection")
            if isinstance(event, p.ErrorReply):
                raise p.RemoteError(event.code, event.message, event.request_id)
            return event

    def close(self) -> None:
        self.sock.close()
