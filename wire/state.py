"""The connection's states, after h11's ``_state.py``: one literal table of
transitions, the HELLO-first rule, and the requests a client still awaits.

Receiving goes one frame at a time::

    HEADER --HEADER_READ--> META --META_READ--> PAYLOAD --FRAME_COMPLETE--> HEADER
      |                      |--FRAME_COMPLETE (no payload)----------------> HEADER
      |                      |--FRAME_REFUSED (no payload)-----------------> HEADER
      |                      '--PAYLOAD_REFUSED--> DISCARD --PAYLOAD_SKIPPED--> HEADER
      |                                 PAYLOAD --PAYLOAD_REFUSED--> DISCARD
      '--END_OF_STREAM--> CLOSED
    HEADER, META, PAYLOAD, DISCARD --FRAME_BROKEN--> BROKEN (every later call raises)

Admission (a server made with ``hello_first=True`` starts AWAITING_HELLO)::

    AWAITING_HELLO --HELLO_ACCEPTED--> OPEN

Pure: no I/O, no bytes; the connection feeds it what happened.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.wire.events import HELLO_META_BYTES_MAX, ErrorCode, Op, ProtocolError
from kvtier.wire.frames import FLAG_WANT_LOCATIONS, FLAG_WANT_ORIGIN, FrameHead


class Role(enum.Enum):
    CLIENT = "client"  # sends requests, receives replies
    SERVER = "server"  # receives requests, sends replies


class Receive(enum.Enum):
    """Where the reader is in the current frame."""

    HEADER = 1  # waiting for the 32-byte header
    META = 2  # header checked, waiting for meta_len bytes
    PAYLOAD = 3  # meta checked, waiting for payload_len bytes
    DISCARD = 4  # a refused frame's payload is skipped as it arrives
    CLOSED = 5  # the peer closed between frames
    BROKEN = 6  # framing lost: a fatal ProtocolError was raised


class Admission(enum.Enum):
    """The HELLO-first rule: what a server accepts from its peer."""

    AWAITING_HELLO = 1  # only a HELLO-sized HELLO frame (see check_before_hello)
    OPEN = 2  # any frame within the full limits


class Input(enum.Enum):
    """What happened: each moves one state along a row of TRANSITIONS."""

    HEADER_READ = "header read"
    META_READ = "meta read, payload follows"
    FRAME_COMPLETE = "frame complete"
    FRAME_REFUSED = "frame refused, nothing to skip"
    PAYLOAD_REFUSED = "frame refused, payload to skip"
    PAYLOAD_SKIPPED = "refused payload skipped"
    END_OF_STREAM = "end of stream between frames"
    FRAME_BROKEN = "framing lost"
    HELLO_ACCEPTED = "the peer's HELLO succeeded"


TRANSITIONS: dict[enum.Enum, dict[Input, enum.Enum]] = {
    Receive.HEADER: {
        Input.HEADER_READ: Receive.META,
        Input.END_OF_STREAM: Receive.CLOSED,
        Input.FRAME_BROKEN: Receive.BROKEN,
    },
    Receive.META: {
        Input.META_READ: Receive.PAYLOAD,
        Input.FRAME_COMPLETE: Receive.HEADER,
        Input.FRAME_REFUSED: Receive.HEADER,
        Input.PAYLOAD_REFUSED: Receive.DISCARD,
        Input.FRAME_BROKEN: Receive.BROKEN,
    },
    Receive.PAYLOAD: {
        Input.FRAME_COMPLETE: Receive.HEADER,
        Input.PAYLOAD_REFUSED: Receive.DISCARD,
        Input.FRAME_BROKEN: Receive.BROKEN,
    },
    Receive.DISCARD: {
        Input.PAYLOAD_SKIPPED: Receive.HEADER,
        Input.FRAME_BROKEN: Receive.BROKEN,
    },
    Receive.CLOSED: {},
    Receive.BROKEN: {},
    Admission.AWAITING_HELLO: {
        Input.HELLO_ACCEPTED: Admission.OPEN,
    },
    Admission.OPEN: {
        Input.HELLO_ACCEPTED: Admission.OPEN,
    },
}


class ConnectionState:
    """The two states of one connection, moved only through :data:`TRANSITIONS`."""

    def __init__(self, hello_first: bool = False):
        self.receive = Receive.HEADER
        self.admission = Admission.AWAITING_HELLO if hello_first else Admission.OPEN

    def process(self, what: Input) -> None:
        if what is Input.HELLO_ACCEPTED:
            self.admission = _next(self.admission, what)
        else:
            self.receive = _next(self.receive, what)


def _next(state: enum.Enum, what: Input) -> enum.Enum:
    try:
        return TRANSITIONS[state][what]
    except KeyError:
        raise RuntimeError(f"no transition from {state.name} on {what.name} ({what.value})") from None


def check_before_hello(head: FrameHead) -> None:
    """While AWAITING_HELLO: a frame that is not a HELLO, or larger than the largest valid
    one, is refused from its header alone (nothing is read or allocated for it)."""
    if head.op != Op.HELLO:
        raise ProtocolError(ErrorCode.AUTH, f"the first frame must be HELLO, got op {head.op:#04x}; "
                            "nothing else is read before HELLO succeeds", head.request_id)
    if head.payload_len or head.meta_len > HELLO_META_BYTES_MAX:
        raise ProtocolError(ErrorCode.LIMIT, f"HELLO of {head.meta_len} meta and {head.payload_len} payload "
                            f"bytes is over the before-HELLO limit of {HELLO_META_BYTES_MAX} meta bytes "
                            "and no payload", head.request_id)


# -- the requests a client awaits replies to --------------------------------
ITEM_REPLY_OPS = frozenset({Op.GET, Op.PUT, Op.DELETE, Op.PIN, Op.UNPIN, Op.NIXL_GET, Op.NIXL_PUT})  # one reply item per request item


@dataclass(frozen=True)
class SentRequest:
    """What the reply to one request must match."""

    op: Op
    count: int  # items in the request
    want_locations: bool = False  # LOOKUP: the reply carries one location per key
    want_origin: bool = False  # GET, LOOKUP: the reply carries origin bytes


class OutstandingRequests:
    """Request id -> :class:`SentRequest`, in the order they were sent.

    A reply must answer an outstanding request with that request's op, or be
    an ERROR (which answers any); an ERROR with request id 0 that answers none
    is connection-level (the daemon closes). Batch replies carry one item per
    request item; a LOOKUP reply's leading count is at most its key count."""

    def __init__(self):
        self._sent: dict[int, SentRequest] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._sent

    def record(self, request_id: int, op: Op, count: int, flags: int) -> None:
        if request_id in self._sent:
            raise ValueError(f"request id {request_id} is already awaiting its reply")
        self._sent[request_id] = SentRequest(Op(op), count, bool(flags & FLAG_WANT_LOCATIONS),
                                             bool(flags & FLAG_WANT_ORIGIN))

    def answer(self, head: FrameHead) -> SentRequest | None:
        """The request this reply header answers, taken off the books; None for a
        connection-level ERROR. Raises a fatal ProtocolError for any other mismatch."""
        rid, op = head.request_id, head.base_op
        sent = self._sent.get(rid)
        if sent is None:
            if op == Op.ERROR and rid == 0:
                return None
            raise ProtocolError(ErrorCode.BAD_FRAME, self._not_outstanding(rid), rid)
        if op != Op.ERROR:
            if op != sent.op:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"a {_op_name(op)} reply for request {rid}, "
                                    f"which was a {sent.op.name}", rid)
            _check_items(head, sent)
        del self._sent[rid]
        return sent

    def _not_outstanding(self, rid: int) -> str:
        if not self._sent:
            return f"reply for request {rid}, but no request is awaiting a reply"
        oldest = next(iter(self._sent))
        later = len(self._sent) - 1
        return f"reply for request {rid}, expected {oldest}" + (f" or one of the {later} sent after it" if later else "")


def check_reply_meta(sent: SentRequest, head: FrameHead, parsed) -> None:
    """Checks of a reply against its request that need the reply's meta section."""
    if sent.op is Op.LOOKUP and head.base_op == Op.LOOKUP:
        leading = parsed[0]
        if leading > sent.count:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"LOOKUP reply for request {head.request_id} counts "
                                f"{leading} leading keys of a request of {sent.count}", head.request_id)


def _check_items(head: FrameHead, sent: SentRequest) -> None:
    rid = head.request_id
    if sent.op in (Op.GET, Op.LOOKUP) and bool(head.flags & FLAG_WANT_ORIGIN) != sent.want_origin:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{sent.op.name} reply for request {rid} "
                            f"{'carries' if sent.want_origin is False else 'lacks'} the origins the request "
                            f"{'did not ask for' if sent.want_origin is False else 'asked for'}", rid)
    if sent.op is Op.LOOKUP:
        want = bool(head.flags & FLAG_WANT_LOCATIONS)
        if want != sent.want_locations:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"LOOKUP reply for request {rid} "
                                f"{'carries' if want else 'lacks'} the locations the request "
                                f"{'did not ask for' if want else 'asked for'}", rid)
        if want and head.count != sent.count:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"LOOKUP reply for request {rid} has {head.count} "
                                f"locations for {sent.count} keys", rid)
    elif sent.op in ITEM_REPLY_OPS and head.count != sent.count:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{sent.op.name} reply for request {rid} has {head.count} "
                            f"items for {sent.count} requested", rid)


def _op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"op {op:#04x}"
