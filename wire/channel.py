"""One blocking connection to a kvtierd: connected, greeted (HELLO), requests pipelined and their
replies read in order, each socket wait bounded by the connection's timeout or a caller's deadline.

The protocol is the sans-IO :class:`~kvtier.wire.connection.Connection`, the socket work
:mod:`kvtier.wire.sockets`; this is the one driver of both on a blocking socket. The block client
chooses where reply payloads land (:meth:`Channel._place_payload`), the daemon's upstream client
bounds each call by a deadline, the NIXL control channel progresses its agent while it waits.
:class:`AsyncChannel` is its asyncio twin, for the AsyncBlockClient.
"""
from __future__ import annotations

import asyncio
import select
import time

from . import connection as p
from .sockets import connect, receive_some, sendmsg_all

PIPELINE_FRAMES_MAX = 8  # frames in flight per connection: bounds buffering on both sides
READ_CHUNK_BYTES = 1 << 20  # one stream read of the asyncio twin; large so big payloads take few wakeups


def accept_reply(reply, expected_id: int, first_error: p.RemoteError | None) -> p.RemoteError | None:
    """Check that one pipelined reply is the next one due -- an error reply too -- and return
    the first error reply so far (the rest of the pipeline is still read). The connection has
    already refused a reply that answers none of its outstanding requests, or not with their
    op; here a reply out of order, or a connection-level error (request id 0: the daemon
    closes), raises now."""
    if reply.request_id != expected_id and not (isinstance(reply, p.ErrorReply) and reply.request_id == 0):
        raise p.ProtocolError(p.ErrorCode.BAD_FRAME, f"reply for request {reply.request_id}, expected {expected_id}")
    if isinstance(reply, p.ErrorReply):
        first_error = first_error or p.RemoteError(reply.code, reply.message, reply.request_id)
        if reply.request_id == 0:
            raise first_error
    return first_error


def bound_until(sock, deadline: float | None) -> None:
    """Give ``sock``'s next blocking call what is left until ``deadline`` (time.monotonic();
    TimeoutError, as socket.timeout, when nothing is); None leaves its timeout as it is."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        sock.settimeout(left)


class Channel:
    """A connection that has said HELLO and holds the daemon's HELLO document (``info``)."""

    def __init__(self, host: str, port: int, timeout_s: float, token: str | None, name: str,
                 deadline: float | None = None):
        """Connect and HELLO, each within ``timeout_s`` (or before ``deadline``); OSError or a
        ClientError when that fails, the socket closed."""
        self.sock = connect(host, port, timeout_s if deadline is None else max(deadline - time.monotonic(), 1e-3))
        self.conn = p.Connection(p.Role.CLIENT)
        self.next_request_id = 1
        self.wire_bytes_sent = 0  # what the kernel took: >0 since an op began means the daemon may have it
        self.info: dict = {}
        try:
            (reply,) = Channel.exchange(self, [p.Hello(0, name, token or "")], deadline=deadline)
            self.info = dict(reply.info)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def idle_and_open(self) -> bool:
        """True if this idle pooled connection can take a request: nothing has arrived on it since
        its last reply (an EOF, a reset, or an error frame the daemon sent before closing all mean
        it is gone)."""
        if self.sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLPRI)
        return not poller.poll(0)

    def send(self, message, request_id: int | None = None, deadline: float | None = None) -> int:
        """Send one request (the next request id of this connection unless given); returns its id."""
        rid = self.next_request_id if request_id is None else request_id
        self.next_request_id = max(self.next_request_id, rid) + 1
        bound_until(self.sock, deadline)
        self.wire_bytes_sent += sendmsg_all(self.sock, self.conn.send_parts(message, request_id=rid))
        return rid

    def exchange(self, messages: list, into=None, deadline: float | None = None, on_sent=None) -> list:
        """Pipeline ``messages`` (at most PIPELINE_FRAMES_MAX ahead) and return their replies in
        order; an error reply raises RemoteError after every reply was read (the connection stays
        usable). ``into``: where payloads land (:meth:`_place_payload`); ``on_sent(request_id)``
        after each request went out."""
        replies, first_error, sent, ids = [], None, 0, []
        while len(replies) < len(messages):
            while sent < len(messages) and sent - len(replies) < PIPELINE_FRAMES_MAX:
                ids.append(self.send(messages[sent], deadline=deadline))
                if on_sent is not None:
                    on_sent(ids[-1])
                sent += 1
            reply = self.read_reply(into, deadline)
            first_error = accept_reply(reply, ids[len(replies)], first_error)
            replies.append(reply)
        if first_error is not None:
            raise first_error
        return replies

    def read_reply(self, into=None, deadline: float | None = None):
        """The next reply, its payload placed by :meth:`_place_payload`."""
        conn, placed = self.conn, None
        while True:
            event = conn.next_event()
            if event is p.NEED_DATA:
                head = conn.pending_head
                if head is not None and head is not placed:
                    placed = head
                    if self._place_payload(head, into):
                        continue
                bound_until(self.sock, deadline)
                receive_some(self.sock, conn)
                continue
            if event is p.CONNECTION_CLOSED:
                raise p.ConnectionLost("the daemon closed the connection")
            return self._received(event)

    def _place_payload(self, head, into) -> bool:
        """Where the payload of the reply ``head`` announces lands: a subclass sets the connection's
        payload buffer (or receives the payload itself and returns True); by default the
        connection keeps it in its own buffer."""
        return False

    def _received(self, reply):
        """The reply as the caller gets it (a subclass copies blocks out of a reused buffer)."""
        return reply


class AsyncChannel:
    """The asyncio twin of :class:`Channel`: the same HELLO and pipelining on asyncio streams, each
    wait bounded by ``timeout_s``; payloads are copied once out of the stream buffer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float):
        self.reader, self.writer, self.timeout_s = reader, writer, timeout_s
        self.conn = p.Connection(p.Role.CLIENT)
        self._next_id = 1
        self.info: dict = {}

    @classmethod
    async def open(cls, host: str, port: int, timeout_s: float, token: str | None, name: str) -> "AsyncChannel":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=READ_CHUNK_BYTES),
                                                timeout_s)
        ch = cls(reader, writer, timeout_s)
        try:
            (reply,) = await ch.exchange([p.Hello(0, name, token or "")])
        except BaseException:
            ch.close()
            raise
        ch.info = dict(reply.info)
        return ch

    def close(self) -> None:
        self.writer.close()

    def idle_and_open(self) -> bool:
        """False once the daemon closed this idle pooled connection (as far as the loop has seen)."""
        return not (self.reader.at_eof() or self.reader.exception() is not None or self.writer.is_closing())

    async def exchange(self, messages: list) -> list:
        replies, first_error, sent = [], None, 0
        while len(replies) < len(messages):
            while sent < len(messages) and sent - len(replies) < PIPELINE_FRAMES_MAX:
                self.writer.writelines(self.conn.send_parts(messages[sent], request_id=self._next_id))
                self._next_id += 1
                sent += 1
            await asyncio.wait_for(self.writer.drain(), self.timeout_s)
            reply = await asyncio.wait_for(self._read_reply(), self.timeout_s)
            first_error = accept_reply(reply, self._next_id - (sent - len(replies)), first_error)
            replies.append(reply)
        if first_error is not None:
            raise first_error
        return replies

    async def _read_reply(self):
        while True:
            event = self.conn.next_event()
            if event is p.NEED_DATA:
                view = self.conn.payload_view()
                want = READ_CHUNK_BYTES if view is None else min(view.nbytes, READ_CHUNK_BYTES)
                data = await self.reader.read(want)
                if view is not None and data:
                    view[:len(data)] = data
                    self.conn.payload_received(len(data))
                else:
                    self.conn.receive_data(data)
                continue
            if event is p.CONNECTION_CLOSED:
                raise p.ConnectionLost("the daemon closed the connection")
            return event
