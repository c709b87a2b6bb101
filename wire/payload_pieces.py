"""A frame payload received into several buffers in order (a scatter list), pure, no I/O.

A reader that knows where each part of a payload belongs (a GET reply's block headers
into a small scratch, the tensor bytes of each block straight into the engine's output)
hands :meth:`Connection.set_payload_buffers <kvtier.wire.connection.Connection.set_payload_buffers>`
the list of writable views; the I/O layer receives into the unfilled ones
(``recvmsg_into``), and the message builder slices the payload by byte range as usual,
getting the tuple of views that cover each range::

    payload bytes   [ block 0 ........................ | block 1 ............ ]
    pieces          [head0][t0,0][t0,1] ... [t0,511]   [head1][t1,0] ...
    pieces[a:b]  -> (view, view, ...)  the parts of the pieces inside [a, b)
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

RECV_IOV_MAX = 512  # buffers handed to one recvmsg_into, under Linux's IOV_MAX of 1024


class PayloadPieces:
    """Writable views that together hold one payload, in order. ``receive_bytes_max``: what
    one receive may take (:meth:`unfilled`), for a reader that reads each receive's bytes
    again while they are still in the cache; None: as much as the views hold."""

    def __init__(self, views: Sequence, receive_bytes_max: int | None = None) -> None:
        if receive_bytes_max is not None and receive_bytes_max <= 0:
            raise ValueError(f"receive_bytes_max must be positive, got {receive_bytes_max}")
        self.receive_bytes_max = receive_bytes_max
        self.views = [as_bytes_view(v) for v in views]
        for i, view in enumerate(self.views):
            if view.readonly:
                raise ValueError(f"payload piece {i} is read-only")
        self.starts: list[int] = []
        total = 0
        for view in self.views:
            self.starts.append(total)
            total += view.nbytes
        self.nbytes = total
        self._last = 0  # the piece _locate found last

    def _locate(self, offset: int) -> tuple[int, int]:
        """(piece index, offset inside it) of byte ``offset`` (< nbytes)."""
        i = self._last  # receives fill the pieces in order: mostly the piece found last
        if not self.starts[i] <= offset < self.starts[i] + self.views[i].nbytes:
            i = bisect_right(self.starts, offset) - 1
            while self.views[i].nbytes == 0:  # an empty piece starts where the next does
                i += 1
            self._last = i
        return i, offset - self.starts[i]

    def unfilled(self, filled: int, views_max: int = RECV_IOV_MAX) -> list[memoryview]:
        """The views past the first ``filled`` bytes (at most ``views_max`` of them, the last
        one cut where they hold ``receive_bytes_max``)."""
        if filled >= self.nbytes:
            return []
        i, inside = self._locate(filled)
        room = self.nbytes - filled if self.receive_bytes_max is None else min(self.receive_bytes_max,
                                                                                self.nbytes - filled)
        views, last = self.views, min(len(self.views), i + views_max)
        first = views[i]
        take = min(first.nbytes - inside, room)
        out = [first if take == first.nbytes else first[inside:inside + take]]
        room -= take
        i += 1
        while room and i < last:
            view = views[i]
            if view.nbytes:
                out.append(view if view.nbytes <= room else view[:room])
                room -= out[-1].nbytes
            i += 1
        return out

    def write(self, offset: int, data) -> None:
        """Copy ``data`` in at byte ``offset`` (bytes that arrived with the frame's head)."""
        data = memoryview(data).cast("B")
        if offset + data.nbytes > self.nbytes:
            raise ValueError(f"{data.nbytes} bytes at {offset} overrun a {self.nbytes}-byte payload")
        pos = 0
        while pos < data.nbytes:
            i, inside = self._locate(offset + pos)
            take = min(self.views[i].nbytes - inside, data.nbytes - pos)
            self.views[i][inside:inside + take] = data[pos:pos + take]
            pos += take

    def __getitem__(self, span: slice) -> tuple[memoryview, ...]:
        start, stop, step = span.indices(self.nbytes)
        if step != 1:
            raise ValueError("payload pieces are sliced by contiguous byte ranges")
        out: list[memoryview] = []
        if start >= stop:
            return ()
        i, inside = self._locate(start)
        views, pos = self.views, start
        while pos < stop:  # from the first piece on, in order (an empty piece adds nothing)
            view = views[i]
            take = min(view.nbytes - inside, stop - pos)
            if take:
                out.append(view if take == view.nbytes else view[inside:inside + take])
            pos += take
            i, inside = i + 1, 0
        return tuple(out)

    def __len__(self) -> int:
        return self.nbytes


def as_bytes_view(buffer) -> memoryview:
    """``buffer`` as a flat memoryview of bytes (itself when it is one already)."""
    if isinstance(buffer, memoryview) and buffer.format == "B" and buffer.ndim == 1:
        return buffer
    return memoryview(buffer).cast("B")
