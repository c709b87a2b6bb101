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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import crc32c

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, check_header, decode_header, verify_block
from kvtier.wire.frames import DEFERRED_LENGTH
from kvtier.wire.payload_pieces import as_bytes_view


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
    land in, in order. The op says which items each frame carries (:meth:`expect`, before
    the frames go out), the connection which request id each went out as (:meth:`sent`),
    and the reader asks for a reply's scatter list by its request id (:meth:`views_for`)."""

    def __init__(self, head_nbytes: int, targets: Sequence[Sequence[memoryview]]) -> None:
        if head_nbytes < HEADER_SIZE:
            raise ValueError(f"head_nbytes {head_nbytes} is shorter than the {HEADER_SIZE}-byte block header")
        self.head_nbytes = head_nbytes
        self.targets = [[as_bytes_view(v) for v in views] for views in targets]
        self.block_nbytes = [head_nbytes + sum(v.nbytes for v in views) for views in self.targets]
        self._heads = memoryview(bytearray(head_nbytes * len(self.targets)))
        self._queued: list[list[int]] = []
        self._by_request: dict[int, list[int]] = {}

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
        for i, length in zip(chunk, lengths):
            if length == DEFERRED_LENGTH or length == 0:
                continue
            if length == self.block_nbytes[i]:
                views.append(self.head_of(i))
                views.extend(self.targets[i])
            else:
                views.append(memoryview(bytearray(length)))
        return views

    def head_of(self, i: int) -> memoryview:
        return self._heads[i * self.head_nbytes:(i + 1) * self.head_nbytes]


def verify_landed(pieces: tuple, key: bytes, head_nbytes: int) -> LandedBlock | memoryview | None:
    """A GET reply item as :class:`~kvtier.wire.payload_pieces.PayloadPieces` gave it: the
    :class:`LandedBlock` if it landed in the plan's views and checks out there, a read-only
    view of it if it landed apart (one piece) and checks out, else None (a corrupt block)."""
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
