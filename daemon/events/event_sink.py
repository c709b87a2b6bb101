"""The engine's block listener for KV events: numbers each change and queues it for the
publisher thread, never blocking the engine.

Each listener call is one batch and takes the next sequence number, under the engine lock,
so the numbers follow the index's order. A full queue drops the batch and counts it: its
number is spent all the same, so subscribers see the gap and resynchronize (replay or
snapshot). The first number of a run is the start time in microseconds: a restarted daemon
always continues past the numbers of its previous run, and its subscribers see a gap.

Keys stay as the engine's (k0, k1) halves here; the publisher thread turns them into bytes.
"""
from __future__ import annotations

import collections
import enum
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

QUEUE_BATCHES_MAX = 100_000  # batches waiting for the publisher thread before new ones are dropped


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True)
class QueuedBatch:
    seq: int
    kind: EventKind
    k0: np.ndarray
    k1: np.ndarray
    ts: float


@dataclass(frozen=True)
class SinkStatistics:
    batches_queued: int
    batches_dropped: int
    queue_batches: int
    seq_last: int  # the number of the newest batch (first_seq - 1 before any)


_NO_KEYS = np.zeros(0, np.uint64)


def halves_to_keys(k0: np.ndarray, k1: np.ndarray) -> list[bytes]:
    """The 16-byte keys of (k0, k1) little-endian halves, in one pass."""
    packed = np.stack([np.asarray(k0, np.uint64), np.asarray(k1, np.uint64)], axis=1).astype("<u8").tobytes()
    return [packed[i:i + 16] for i in range(0, len(packed), 16)]


class KVEventSink:
    """Implements ``kvtier.daemon.engine.block_events.BlockListener``."""

    def __init__(self, queue_batches_max: int = QUEUE_BATCHES_MAX, first_seq: int | None = None,
                 clock: Callable[[], float] = time.time):
        if queue_batches_max <= 0:
            raise ValueError(f"queue_batches_max must be positive, got {queue_batches_max}")
        self._queue: collections.deque[QueuedBatch] = collections.deque()
        self._queue_max = queue_batches_max
        self._clock = clock
        self._lock = threading.Lock()
        self._next_seq = time.time_ns() // 1000 if first_seq is None else first_seq
        self.first_seq = self._next_seq
        self._queued = self._dropped = 0
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    # -- the engine's calls (under its lock) --------------------------------------
    def blocks_stored(self, k0: np.ndarray, k1: np.ndarray) -> None:
        if len(k0):
            self._push(EventKind.STORED, k0, k1)

    def blocks_removed(self, k0: np.ndarray, k1: np.ndarray) -> None:
        if len(k0):
            self._push(EventKind.REMOVED, k0, k1)

    def all_cleared(self) -> None:
        self._push(EventKind.CLEARED, _NO_KEYS, _NO_KEYS)

    def _push(self, kind: EventKind, k0: np.ndarray, k1: np.ndarray) -> None:
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if len(self._queue) >= self._queue_max:
                self._dropped += 1
                return
            self._queue.append(QueuedBatch(seq, kind, k0, k1, self._clock()))
            self._queued += 1
        self.wake()

    # -- the publisher's side ------------------------------------------------------
    def position(self) -> int:
        """The number of the newest batch (called under the engine lock, it is the state's)."""
        with self._lock:
            return self._next_seq - 1

    def take_all(self) -> list[QueuedBatch]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def wake(self) -> None:
        try:
            os.eventfd_write(self.wake_fd, 1)
        except BlockingIOError:  # the counter is saturated: the publisher is woken already
            pass

    def clear_wake(self) -> None:
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:
            pass

    def statistics(self) -> SinkStatistics:
        with self._lock:
            return SinkStatistics(self._queued, self._dropped, len(self._queue), self._next_seq - 1)

    def close(self) -> None:
        os.close(self.wake_fd)
