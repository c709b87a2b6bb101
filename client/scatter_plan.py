"""Where each block of a GET reply lands: straight into its destination (pure, no I/O).

A raw block's bytes after its headers are the tensor's bytes, so a reader that knows
the destination of each block receives them there (one ``recvmsg_into`` over the
list, no intermediate copy)::

    GET reply payload   [ block 0                          | block 1 ... ]
    landed              [ head scratch 0 | target views 0 ] [ head 1 | ...
                          (block header + codec header)     (the output tensor's pieces)

Items of another size than the plan expects (another codec, another layout) land in a
buffer of their own and are returned as ordinary blocks. Each landed block is checked
where it lies: its header, its key, and the payload CRC over the head scratch's codec
header and the target views, in order (:func:`verify_landed`). The codec header's
bytes are the caller's to check (:class:`LandedBlock`).

The payload CRC is folded as the bytes come in: the reader reports how much of the reply
has arrived (:meth:`ScatterPlan.landed`) and each landed block's CRC is extended over
those bytes while they are still in the cache; the check once the reply is in folds what
no report covered and compares (:meth:`ScatterPlan.payload_crc`)::

    reply payload   [ head0 | t0,0 t0,1 ... t0,511 | head1 | ... ]
    received        [==== recv 1 ====][==== recv 2 ====][= recv 3 ...
    folded          crc0 over recv 1's bytes past head0's block header, then recv 2's, ...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import crc32c

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, check_header, decode_header, verify_block
from kvtier.wire.frames import DEFERRED_LENGTH
from kvtier.wire.payload_pieces import as_bytes_view


FOLD_RECEIVE_BYTES_MAX = 256 << 10  # one receive, folded right after it lands: more leaves the core's L2 first
FOLD_GIL_RELEASE = 0  # crc32c's gil_release_mode: hold it; a piece is microseconds, handing the GIL over costs more


class _Fold:
    """The payload CRC of one landed block, extended over its bytes in order as they arrive."""

    __slots__ = ("views", "start", "nbytes", "checked", "crc", "_view", "_inside")

    def __init__(self, views: list[memoryview], start: int, nbytes: int) -> None:
        self.views = [v for v in views if v.nbytes]  # the payload's views, past the block header
        self.start = start  # where the block begins in its reply's payload
        self.nbytes = nbytes  # the whole block, header included
        self.checked = HEADER_SIZE  # bytes of the block [0, checked) are folded (the header is not in the CRC)
        self.crc = 0
        self._view = self._inside = 0  # where ``checked`` lies: view index, offset inside it

    def fold(self, end: int) -> None:
        """Extend the CRC over the block's bytes [checked, end)."""
        end = min(end, self.nbytes)
        checked, crc, i, inside, views = self.checked, self.crc, self._view, self._inside, self.views
        while checked < end:
            view = views[i]
            left = view.nbytes - inside
            if end - checked >= left:  # the rest of this view
                crc = crc32c.crc32c(view[inside:] if inside else view, crc, FOLD_GIL_RELEASE)
                checked, i, inside = checked + left, i + 1, 0
            else:
                take = end - checked
                crc = crc32c.crc32c(view[inside:inside + take], crc, FOLD_GIL_RELEASE)
                checked, inside = end, inside + take
        self.checked, self.crc, self._view, self._inside = checked, crc, i, inside
        if checked == self.nbytes:
            self.views = []  # folded whole: the target views are let go (many, and tracked by the GC)


@dataclass(frozen=True)
class FoldStatistics:
    bytes_on_arrival: int  # payload bytes folded into their CRCs right after a receive landed them
    bytes_at_check: int  # payload bytes no receive report covered, folded when the block was checked


@dataclass(frozen=True)
class LandedBlock:
    """A verified block whose payload past ``head`` lies in the caller's target views;
    ``head`` holds the block header and the codec header (``head[HEADER_SIZE:]``)."""

    head: memoryview
    nbytes: int

    def __len__(self) -> int:
        return self.nbytes


class ScatterPlan:
    """The destinations of one batch's blocks, for the GET frames that fetch them.

    ``targets[i]`` are the writable views block i's bytes past its first ``head_nbytes``
    land in, in order, or a function that makes them: then they are made when block i's
    reply comes and let go once it is checked, not held for the whole batch (a raw block has a
    view per row it lands in; objects that live that long cost the garbage collector). The op
    says which items each frame carries (:meth:`expect`, before the frames go out), the
    connection which request id each went out as (:meth:`sent`), and the reader asks for a
    reply's scatter list by its request id (:meth:`views_for`)."""

    def __init__(self, head_nbytes: int, targets: Sequence[Sequence[memoryview] | Callable[[], Sequence]]) -> None:
        if head_nbytes < HEADER_SIZE:
            raise ValueError(f"head_nbytes {head_nbytes} is shorter than the {HEADER_SIZE}-byte block header")
        self.head_nbytes = head_nbytes
        self._targets = list(targets)
        self._heads = memoryview(bytearray(head_nbytes * len(self._targets)))
        self._queued: list[list[int]] = []
        self._by_request: dict[int, list[int]] = {}
        self._folds: dict[int, _Fold] = {}  # block index -> the CRC of its latest landing
        self._arriving: list[_Fold] = []  # the landed blocks of the reply being received, in order
        self._folded = 0  # bytes of that reply's payload folded into their CRCs
        self._on_arrival = self._at_check = 0  # FoldStatistics

    def expect(self, chunks: Sequence[Sequence[int]]) -> None:
        """The item indexes of each frame about to be sent, in order."""
        self._queued = [list(c) for c in chunks]

    def sent(self, request_id: int) -> None:
        """The next expected frame went out as ``request_id``."""
        if self._queued:
            self._by_request[request_id] = self._queued.pop(0)

    def views_for(self, request_id: int, lengths: Sequence[int]) -> list[memoryview] | None:
        """The scatter list of the reply to ``request_id`` whose items are ``lengths`` long
        (None: not a reply this plan expects)."""
        chunk = self._by_request.pop(request_id, None)
        if chunk is None or len(chunk) != len(lengths):
            return None
        views: list[memoryview] = []
        self._arriving, self._folded, start = [], 0, 0
        for i, length in zip(chunk, lengths):
            if length == DEFERRED_LENGTH or length == 0:
                continue
            targets = self.targets(i)
            if length == self.head_nbytes + sum(v.nbytes for v in targets):
                views.append(self.head_of(i))
                views.extend(targets)
                self._folds[i] = _Fold([self.head_of(i)[HEADER_SIZE:], *targets], start, length)
                self._arriving.append(self._folds[i])
            else:
                self._folds.pop(i, None)
                views.append(memoryview(bytearray(length)))
            start += length
        return views

    def landed(self, filled: int) -> None:
        """The first ``filled`` bytes of the reply whose scatter list :meth:`views_for` gave last
        are in: fold them into their blocks' CRCs."""
        if filled <= self._folded:
            return
        while self._arriving and self._arriving[0].start < filled:
            fold = self._arriving[0]
            before = fold.checked
            fold.fold(filled - fold.start)
            self._on_arrival += fold.checked - before
            if fold.checked < fold.nbytes:
                break
            self._arriving.pop(0)
        self._folded = filled

    def payload_crc(self, i: int) -> int | None:
        """The payload CRC of block ``i``'s latest landing in the plan's views (folding what
        :meth:`landed` did not cover), or None where it did not land in them."""
        fold = self._folds.get(i)
        if fold is None:
            return None
        before = fold.checked
        fold.fold(fold.nbytes)
        self._at_check += fold.checked - before
        return fold.crc

    def statistics(self) -> FoldStatistics:
        return FoldStatistics(self._on_arrival, self._at_check)

    def targets(self, i: int) -> list[memoryview]:
        """Block ``i``'s target views (made now where the plan was given a function for them)."""
        views = self._targets[i]
        return [as_bytes_view(v) for v in (views() if callable(views) else views)]

    def head_of(self, i: int) -> memoryview:
        return self._heads[i * self.head_nbytes:(i + 1) * self.head_nbytes]


def verify_landed(pieces: tuple, key: bytes, head_nbytes: int,
                  payload_crc: int | None = None) -> LandedBlock | memoryview | None:
    """A GET reply item as :class:`~kvtier.wire.payload_pieces.PayloadPieces` gave it: the
    :class:`LandedBlock` if it landed in the plan's views and checks out there, a read-only
    view of it if it landed apart (one piece) and checks out, else None (a corrupt block).
    ``payload_crc``: the CRC of the landed pieces' payload bytes, folded as they arrived
    (:meth:`ScatterPlan.payload_crc`); None computes it here."""
    if len(pieces) == 1:
        block = memoryview(pieces[0]).cast("B")
        try:
            verify_block(block, expected_key=key)
        except BlockFormatError:
            return None
        return block.toreadonly()
    head = pieces[0]
    if head.nbytes != head_nbytes:
        return None
    nbytes = sum(piece.nbytes for piece in pieces)
    try:
        header = decode_header(head)
        check_header(header, nbytes, key)
    except BlockFormatError:
        return None
    crc = payload_crc
    if crc is None:
        crc = crc32c.crc32c(head[HEADER_SIZE:])
        for piece in pieces[1:]:
            crc = crc32c.crc32c(piece, crc)
    if crc != header.payload_crc:
        return None
    return LandedBlock(head.toreadonly(), nbytes)


@dataclass(frozen=True)
class Landing:
    """Where a fetch's raw blocks land: ``views(i, group)`` are the destination views of
    layer group ``group`` of the fetch's block ``i``, past its first ``head_nbytes``; ``region``
    (or None), the memory they all lie in (a transport registers it to write there)."""

    head_nbytes: int
    views: Callable[[int, int], list[memoryview]]
    region: memoryview | None = None
