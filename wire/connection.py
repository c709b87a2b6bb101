"""The data protocol as a sans-IO connection, after h11.

::

    conn = Connection(Role.SERVER)
    conn.receive_data(bytes_from_socket)     # b"" means the peer closed
    event = conn.next_event()                # a message, NEED_DATA or CONNECTION_CLOSED
    wire = conn.send(reply)                  # bytes to write (send_parts: header + memoryviews)

The states and their transitions are :mod:`kvtier.wire.state` (one table),
the bytes :mod:`kvtier.wire.readers` and :mod:`kvtier.wire.writers`, the
messages :mod:`kvtier.wire.events` (re-exported here). No sockets here:
:mod:`kvtier.wire.sockets` is the one module that touches one.

A server connection made with ``hello_first=True`` accepts only a HELLO frame
(no payload, at most HELLO_META_BYTES_MAX of meta) until the server calls
:meth:`Connection.hello_accepted`; any other frame is a fatal error raised
from its header alone, before anything is allocated for it.

A client connection knows the requests it sent and awaits: a reply that
answers none of them, or not with its op (an ERROR answers any), or with
another number of items, is a fatal :class:`ProtocolError`, raised from the
reply's header before its payload is received.

Zero-copy receive: while a payload is pending, :meth:`Connection.payload_view`
returns the unfilled part of the payload buffer (allocated only after the
limits were checked, or supplied with :meth:`Connection.set_payload_buffer`);
the I/O layer ``recv_into``\\ s it and reports :meth:`Connection.payload_received`.
A payload may also be scattered over several buffers
(:meth:`Connection.set_payload_buffers`, :meth:`Connection.payload_views`).
"""
from __future__ import annotations

from kvtier.wire import readers, writers
from kvtier.wire.frames import FRAME_HEADER_SIZE, REQUEST_ID_MAX, FrameHead, flags_taken, pack_header
from kvtier.wire.payload_pieces import PayloadPieces
from kvtier.wire.readers import PackedKeys  # noqa: F401  (re-exported)
from kvtier.wire.state import (Admission, ConnectionState, Input, OutstandingRequests, Receive, SentRequest,
                               check_before_hello, check_reply_meta)
from kvtier.wire.state import Role  # noqa: F401  (re-exported)
from kvtier.wire.events import (  # noqa: F401  (re-exported)
    BATCH_COUNT_MAX, DEFAULT_LIMITS, FEATURE_GET_READER_VERIFIES, FEATURE_UPSTREAM, HELLO_META_BYTES_MAX, KEY_SIZE, META_BYTES_MAX,
    PAYLOAD_BYTES_MAX, FEATURE_PIN_TTL, FEATURE_PUT_SKIP_DELETED,
    PROTOCOL_VERSION, REPLY_BIT, REPLY_TYPES, REQUEST_TYPES, ClientError, ConnectionLost, Delete, DeleteReply,
    ErrorCode, ErrorReply, Flush, FlushReply, Get, GetReply, Hello, HelloReply, Limits, Location, LocationRecords,
    BlockParts, Lookup, LookupReply, Op, Pin, PinReply, Ping, PingReply, ProtocolError, Put, PutReply, Rejected, RemoteError,
    Stats, StatsReply, Unpin, UnpinReply, DEFERRED)


class _Sentinel:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return self._name


NEED_DATA = _Sentinel("NEED_DATA")
CONNECTION_CLOSED = _Sentinel("CONNECTION_CLOSED")


class Connection:
    """One side of one connection: frames in, messages out, and back.

    ``check_replies=False`` (client only) takes every reply as it comes, for a
    reader of replies to frames it did not send itself (tests that write raw
    frames to a daemon)."""

    def __init__(self, role: Role, limits: Limits = DEFAULT_LIMITS, *, hello_first: bool = False,
                 check_replies: bool = True):
        if hello_first and role is not Role.SERVER:
            raise ValueError("hello_first is a server-side rule")
        self.role = role
        self.limits = limits
        self._state = ConnectionState(hello_first)
        self._decoders = readers.REQUEST_DECODERS if role is Role.SERVER else readers.REPLY_DECODERS
        self._outstanding = OutstandingRequests() if role is Role.CLIENT and check_replies else None
        self._buf = bytearray()
        self._eof = False
        self._head: FrameHead | None = None
        self._answers: SentRequest | None = None  # the request the pending reply answers
        self._parsed = None
        self._payload: memoryview | None = None
        self._filled = 0
        self._discard_left = 0
        self._error: ProtocolError | None = None
        self.bytes_received = 0
        self.bytes_sent = 0

    # -- the before-HELLO rule ------------------------------------------------
    @property
    def awaiting_hello(self) -> bool:
        """True while only a HELLO frame is accepted (see the module doc)."""
        return self._state.admission is Admission.AWAITING_HELLO

    def hello_accepted(self) -> None:
        """The peer's HELLO succeeded: frames up to the full limits are accepted from now on."""
        self._state.process(Input.HELLO_ACCEPTED)

    # -- requests awaiting replies (client) -------------------------------------
    @property
    def outstanding(self) -> int:
        """How many requests sent on this connection await their reply (client; 0 untracked)."""
        return len(self._outstanding) if self._outstanding is not None else 0

    # -- receiving ----------------------------------------------------------
    def receive_data(self, data) -> None:
        """Feed bytes from the peer; ``b""`` marks end of stream."""
        if not data:
            self._eof = True
            return
        self.bytes_received += len(data)
        if self._state.receive is Receive.DISCARD and not self._buf:
            take = min(len(data), self._discard_left)
            self._discard_left -= take
            data = memoryview(data)[take:]
        self._buf += data

    @property
    def peer_closed(self) -> bool:
        """True once the end of the stream was fed (``receive_data(b"")``)."""
        return self._eof

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has arrived (for mid-frame timeouts)."""
        return self._state.receive in (Receive.META, Receive.PAYLOAD, Receive.DISCARD) or bool(self._buf)

    @property
    def pending_head(self) -> FrameHead | None:
        """The header of the frame whose payload is being received."""
        return self._head if self._state.receive is Receive.PAYLOAD else None

    @property
    def pending_meta(self):
        """The parsed meta section of that frame (e.g. GET reply lengths)."""
        return self._parsed if self._state.receive is Receive.PAYLOAD else None

    def set_payload_buffer(self, buffer) -> None:
        """Receive the pending payload into ``buffer`` (at least payload_len bytes)."""
        if self._state.receive is not Receive.PAYLOAD or self._payload is not None:
            raise RuntimeError("set_payload_buffer needs a pending payload whose buffer is not yet chosen")
        view = memoryview(buffer).cast("B")
        if view.readonly or view.nbytes < self._head.payload_len:
            raise ValueError(f"payload buffer of {view.nbytes} bytes (writable={not view.readonly}) "
                             f"cannot hold {self._head.payload_len}")
        self._payload = view[:self._head.payload_len]
        self._drain_into_payload()

    def set_payload_buffers(self, views, receive_bytes_max: int | None = None) -> None:
        """Receive the pending payload into ``views`` in order (a scatter list, see
        :mod:`~kvtier.wire.payload_pieces`; their sizes add up to payload_len), at most
        ``receive_bytes_max`` a receive (None: no cap); the message builder then gets the
        payload as :class:`~kvtier.wire.payload_pieces.PayloadPieces`."""
        if self._state.receive is not Receive.PAYLOAD or self._payload is not None:
            raise RuntimeError("set_payload_buffers needs a pending payload whose buffer is not yet chosen")
        pieces = PayloadPieces(views, receive_bytes_max)
        if pieces.nbytes != self._head.payload_len:
            raise ValueError(f"payload pieces of {pieces.nbytes} bytes for a {self._head.payload_len}-byte payload")
        self._payload = pieces
        self._drain_into_payload()

    def reject_payload(self, code: ErrorCode, message: str) -> Rejected:
        """Refuse the pending frame before a buffer for its payload is chosen: the payload is
        skipped as it arrives, and the returned event is answered like any Rejected one."""
        if self._state.receive is not Receive.PAYLOAD or self._payload is not None:
            raise RuntimeError("reject_payload needs a pending payload whose buffer is not yet chosen")
        head = self._head
        self._state.process(Input.PAYLOAD_REFUSED)
        self._head = self._parsed = self._answers = None
        self._discard_left = head.payload_len
        return Rejected(head.request_id, code, message)

    def payload_view(self) -> memoryview | None:
        """The unfilled part of the pending payload for ``recv_into``, or None."""
        if self._state.receive is not Receive.PAYLOAD:
            return None
        if self._payload is None:
            self._payload = memoryview(bytearray(self._head.payload_len))
            self._drain_into_payload()
        if self._filled >= self._head.payload_len:
            return None
        if isinstance(self._payload, PayloadPieces):
            return self._payload.unfilled(self._filled, 1)[0]
        return self._payload[self._filled:]

    def payload_views(self) -> list[memoryview] | None:
        """:meth:`payload_view` as a list for ``recvmsg_into``: the unfilled pieces of a
        scattered payload, else the one view (None when no payload is pending)."""
        if isinstance(self._payload, PayloadPieces) and self._state.receive is Receive.PAYLOAD:
            return self._payload.unfilled(self._filled) or None
        view = self.payload_view()
        return None if view is None else [view]

    @property
    def payload_filled(self) -> int:
        """Bytes of the pending payload in its buffer so far (0 when none is pending)."""
        return self._filled if self._state.receive is Receive.PAYLOAD else 0

    def payload_received(self, nbytes: int) -> None:
        """``nbytes`` were written into the view :meth:`payload_view` returned."""
        if self._state.receive is not Receive.PAYLOAD or self._payload is None:
            raise RuntimeError("payload_received without a payload view")
        if nbytes <= 0 or self._filled + nbytes > self._head.payload_len:
            raise ValueError(f"payload_received({nbytes}) with {self._head.payload_len - self._filled} bytes left")
        self._filled += nbytes
        self.bytes_received += nbytes

    def _drain_into_payload(self) -> None:
        take = min(len(self._buf), self._head.payload_len - self._filled)
        if take:
            if isinstance(self._payload, PayloadPieces):
                self._payload.write(self._filled, self._buf[:take])
            else:
                self._payload[self._filled:self._filled + take] = self._buf[:take]
            del self._buf[:take]
            self._filled += take

    def next_event(self):
        """The next complete message, :data:`NEED_DATA` or :data:`CONNECTION_CLOSED`.

        Raises :class:`ProtocolError` when the framing is lost (the connection
        is then unusable); a request refused with the framing intact comes
        back as a :class:`Rejected` event instead."""
        if self._state.receive is Receive.BROKEN:
            raise ProtocolError(self._error.code, f"connection already failed: {self._error}", self._error.request_id)
        try:
            return self._next_event()
        except ProtocolError as exc:
            if exc.fatal:
                self._state.process(Input.FRAME_BROKEN)
                self._error = exc
            raise

    def _next_event(self):
        while True:
            state = self._state.receive
            if state is Receive.CLOSED:
                return CONNECTION_CLOSED
            if state is Receive.HEADER:
                if len(self._buf) < FRAME_HEADER_SIZE:
                    return self._need(FRAME_HEADER_SIZE)
                self._head = self._admit(readers.parse_header(self._buf, self.limits))
                del self._buf[:FRAME_HEADER_SIZE]
                self._state.process(Input.HEADER_READ)
            elif state is Receive.META:
                head = self._head
                if len(self._buf) < head.meta_len:
                    return self._need(head.meta_len)
                meta = bytes(self._buf[:head.meta_len])
                del self._buf[:head.meta_len]
                event = self._parse_meta(head, meta)
                if event is not None:
                    return event
            elif state is Receive.PAYLOAD:
                size = self._head.payload_len
                if self._payload is None:
                    if len(self._buf) < size:
                        return self._need(size)
                    self._payload = memoryview(bytearray(size))
                self._drain_into_payload()
                if self._filled < size:
                    return self._need(size)
                return self._finish(self._decoders[self._head.base_op][1](self._head, self._parsed, self._payload))
            elif state is Receive.DISCARD:
                take = min(len(self._buf), self._discard_left)
                del self._buf[:take]
                self._discard_left -= take
                if self._discard_left:
                    return self._need(self._discard_left)
                self._state.process(Input.PAYLOAD_SKIPPED)

    def _need(self, nbytes: int):
        if self._eof:
            state = self._state.receive
            if state is Receive.HEADER and not self._buf:
                self._state.process(Input.END_OF_STREAM)
                return CONNECTION_CLOSED
            got = self._filled if self._payload is not None else len(self._buf)
            raise ProtocolError(ErrorCode.BAD_FRAME, f"connection closed mid-frame in {state.name.lower()} "
                                f"(truncated frame: {got} of {nbytes} bytes)",
                                self._head.request_id if self._head and state is not Receive.HEADER else 0)
        return NEED_DATA

    def _admit(self, head: FrameHead) -> FrameHead:
        """The header-only rules: a client reads replies (to its own requests), a server
        before HELLO only a HELLO."""
        if self.role is Role.CLIENT:
            if not head.is_reply:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"expected a reply, got request op {head.op:#x}",
                                    head.request_id)
            if self._outstanding is not None:
                self._answers = self._outstanding.answer(head)
        elif self._state.admission is Admission.AWAITING_HELLO:
            check_before_hello(head)
        return head

    def _parse_meta(self, head: FrameHead, meta: bytes):
        decoder = self._decoders.get(head.base_op) if head.is_reply == (self.role is Role.CLIENT) else None
        try:
            if decoder is None:
                raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {head.op:#04x}", head.request_id, fatal=False)
            readers.check_flags(head)
            self._parsed = decoder[0](head, meta, self.limits)
            if self._answers is not None:
                check_reply_meta(self._answers, head, self._parsed)
        except ProtocolError as exc:
            if exc.fatal or self.role is Role.CLIENT:
                exc.fatal = True
                raise
            rejected = Rejected(head.request_id, exc.code, str(exc))
            self._state.process(Input.PAYLOAD_REFUSED if head.payload_len else Input.FRAME_REFUSED)
            self._head = self._parsed = None
            self._discard_left = head.payload_len
            return rejected  # at once: the reply need not wait for the skipped payload
        if head.payload_len == 0:
            return self._finish(decoder[1](head, self._parsed, memoryview(b"")))
        self._state.process(Input.META_READ)
        self._payload, self._filled = None, 0
        return None

    def _finish(self, event):
        self._state.process(Input.FRAME_COMPLETE)
        self._head = self._parsed = self._payload = self._answers = None
        self._filled = 0
        return event

    # -- sending ------------------------------------------------------------
    def send_parts(self, message, request_id: int | None = None) -> list:
        """``[header + meta, payload views...]`` for ``sendmsg`` (no payload copy).
        ``request_id`` replaces the message's own (a client numbers frames as it
        sends them, without a copy of the message). A client connection records
        the request as awaiting its reply."""
        is_request = isinstance(message, REQUEST_TYPES)
        if is_request != (self.role is Role.CLIENT):
            raise TypeError(f"a {self.role.value} cannot send {type(message).__name__}")
        op, flags, rid, count, meta, payload, status = writers.encode_message(message)
        assert not flags & ~flags_taken(op), f"{type(message).__name__} encoded with flags {flags:#x}, not its op's"
        if request_id is not None:
            rid = request_id
        if not 0 <= rid <= REQUEST_ID_MAX:
            raise ValueError(f"request id {rid} does not fit 64 bits")
        payload_len = sum(map(writers.payload_nbytes, payload))
        if count > self.limits.batch_count_max or len(meta) > self.limits.meta_bytes_max \
                or payload_len > self.limits.payload_bytes_max:
            raise ValueError(f"{type(message).__name__} of {count} items, {len(meta)} meta bytes and {payload_len} "
                             f"payload bytes is over the frame limits {self.limits}")
        if self._outstanding is not None:
            self._outstanding.record(rid, op, count, flags)
        head = pack_header(op, flags, rid, count, len(meta), payload_len, status)
        self.bytes_sent += len(head) + len(meta) + payload_len
        return [head + meta, *payload]

    def send(self, message) -> bytes:
        """The whole frame as one bytes object (copies the payload)."""
        return b"".join(bytes(p) for p in self.send_parts(message))
