"""Device arrays a queued kernel reads, kept alive until its stream has run the kernel.

A CuPy launch returns as soon as the kernel is queued on its stream. An array made for
the launch alone (the paged kernel's table of layer pointers) must not go back to an
allocator before the kernel has read it: a stream-ordered pool (``cudaMallocAsync``,
CuPy's ``MemoryAsyncPool``) frees on the stream current at the time of the free, and
another stream may then be handed the memory and overwrite it while the kernel still
waits in its queue. The launcher records an event on the kernel's stream right after
the launch and hands the event and the arrays here::

    kernel(grid, block, (table, ...))      queued on stream S
    event.record(S)                        passes once S has run the kernel
    holds.hold(event, (table, ...))        the arrays live until then

Holds are let go in launch order once their event has passed (``Event.done``, a query
that does not block), checked on every new hold. At most ``limit`` are kept: past it the
new hold first waits for the oldest event (``Event.synchronize``), so a stalled stream
bounds the memory held instead of growing it. CuPy keeps its pinned staging buffers the
same way (an event per copy, the buffer reused once the event has passed).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

MAX_HELD_LAUNCHES = 1024  # a pointer table is <= 8 KiB (MAX_LAYERS pointers): a few MiB held at worst


class StreamEvent(Protocol):
    """What a hold needs of an event (``cupy.cuda.Event`` has both)."""

    @property
    def done(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class HoldStatistics:
    held: int  # holds whose event had not been seen passed
    released_total: int
    waited_total: int  # holds let go by waiting on their event (the limit was reached)


@dataclass
class _Hold:
    event: StreamEvent
    objects: tuple[Any, ...]


class LaunchHolds:
    """FIFO of (event, objects): objects are dropped once the event has passed. Thread-safe."""

    def __init__(self, limit: int = MAX_HELD_LAUNCHES) -> None:
        if limit < 1:
            raise ValueError(f"limit {limit} must be at least 1")
        self._limit = limit
        self._pending: deque[_Hold] = deque()
        self._lock = threading.Lock()
        self._released_total = 0
        self._waited_total = 0

    def hold(self, event: StreamEvent, objects: tuple[Any, ...]) -> None:
        """Keep ``objects`` referenced until ``event`` has passed (record the event before calling)."""
        with self._lock:
            self._release_passed_locked()
            while len(self._pending) >= self._limit:
                oldest = self._pending.popleft()
                oldest.event.synchronize()
                self._released_total += 1
                self._waited_total += 1
            self._pending.append(_Hold(event, tuple(objects)))

    def release_passed(self) -> int:
        """Drop the holds, oldest first, whose event has passed; the number dropped."""
        with self._lock:
            return self._release_passed_locked()

    def _release_passed_locked(self) -> int:
        n = 0
        while self._pending and self._pending[0].event.done:
            self._pending.popleft()
            n += 1
        self._released_total += n
        return n

    def statistics(self) -> HoldStatistics:
        with self._lock:
            return HoldStatistics(len(self._pending), self._released_total, self._waited_total)
