"""The memory of NIXL_PUTs that failed after the daemon may have posted its READ: kept alive (pure).

Over UCX TCP a READ of this process's memory is served by this process's own agent, whenever it
next progresses. A NIXL_PUT that fails once the daemon may have posted its READ (the daemon gave it
up, TIMEOUT, or this side's wait failed) can leave that READ pending here: the daemon discards what
it brings, but the agent still reads the memory the PUT pointed at, so that memory must not be
unmapped first. Whether the READ ended is not visible from here, so the PUT's buffers (the views
of the caller's KV, which keep its tensors alive) are held for the life of the process's agent::

    failed NIXL_PUT ──may have posted──> hold(pieces) ──under HELD_PUT_BYTES_MAX──> NIXL PUTs go on
                                                      └─over it──> puts_stopped: PUTs go over TCP

A failure the daemon answered before posting anything (a refusal) holds nothing.
"""
from __future__ import annotations

import threading
from typing import Sequence

from kvtier.wire import events as m

HELD_PUT_BYTES_MAX = 256 << 20  # memory held for failed NIXL_PUTs; past it this process PUTs over TCP
POSTED_ERROR_CODES = frozenset({m.ErrorCode.TIMEOUT, m.ErrorCode.INTERNAL})  # answers after a READ was posted


def may_have_posted(exc: BaseException) -> bool:
    """Whether a NIXL_PUT that raised ``exc`` may have left the daemon's READ of our memory pending:
    any failure but an answer from the daemon that it refused the PUT before reading."""
    return not isinstance(exc, m.RemoteError) or exc.code in POSTED_ERROR_CODES


class HeldPutMemory:
    """Buffers of failed NIXL_PUTs, kept referenced (never given back), and the bound on them."""

    def __init__(self, bytes_max: int = HELD_PUT_BYTES_MAX) -> None:
        self.bytes_max = bytes_max
        self._held: list[Sequence] = []
        self._lock = threading.Lock()
        self.puts = 0  # failed NIXL_PUTs whose buffers are held
        self.nbytes = 0

    def hold(self, pieces: Sequence) -> None:
        """Keep ``pieces`` (the views one NIXL_PUT pointed the daemon at) referenced from now on."""
        views = tuple(memoryview(piece) for piece in pieces)  # our own exports: a caller's release() of its
        nbytes = sum(view.nbytes for view in views)  # views leaves these, and the memory under them, in place
        with self._lock:
            self._held.append(views)
            self.puts += 1
            self.nbytes += nbytes

    @property
    def puts_stopped(self) -> bool:
        """True once the held memory reached the bound: no more NIXL_PUTs from this process."""
        return self.nbytes >= self.bytes_max
