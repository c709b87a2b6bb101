"""Soft pins: pins that expire by themselves (pure, no I/O).

A soft pin keeps a block through reclaim (it is moved, like a hot block, never dropped)
until its deadline on a monotonic clock passes. It is a placement hint for pre-placed
prefixes, not a promise: it is kept in memory only, writes no record and does not survive
a restart. An expired pin counts as absent wherever it is read and is dropped lazily, by
the next caller that looks (:meth:`SoftPins.expire`, a heap ordered by deadline): there is
no timer. A hard pin (``PINNED_BIT`` in the index, a durable record) is separate; the
engine replaces a soft pin by a hard one when a block gets both.

Renewing a soft pin keeps the later of the two deadlines.
"""
from __future__ import annotations

import heapq
import math
import time
from typing import Callable, Iterable

import numpy as np

from .errors import BadArgumentError
from .index import BlockIndex

SOFT_PIN_TTL_S_MAX = (2**32 - 1) / 1000  # the wire's u32 of milliseconds: about 49.7 days


def check_ttl_s(ttl_s: float) -> float:
    """``ttl_s`` as a float if it is a usable TTL (positive, finite, at most SOFT_PIN_TTL_S_MAX); else ValueError."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) \
            or not 0 < ttl_s <= SOFT_PIN_TTL_S_MAX:
        raise BadArgumentError(f"a soft pin's ttl_s must be a number in (0, {SOFT_PIN_TTL_S_MAX}] seconds, got {ttl_s!r}")
    return float(ttl_s)


class SoftPins:
    """Key halves (k0, k1) -> deadline (seconds on ``clock``). Callers hold the engine lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._deadline: dict[tuple[int, int], float] = {}
        self._heap: list[tuple[float, int, int]] = []  # (deadline, k0, k1); stale entries are skipped
        self._keys: tuple[np.ndarray, np.ndarray] | None = None  # the keys as arrays, rebuilt after a change
        self.expired = 0  # soft pins that ran out (counted when dropped)

    def __len__(self) -> int:
        return len(self._deadline)

    def pin(self, keys: Iterable[tuple[int, int]], ttl_s: float) -> None:
        """Soft-pin these keys until now + ``ttl_s`` (or their current, later deadline)."""
        deadline = self.clock() + check_ttl_s(ttl_s)
        for key in keys:
            if self._deadline.get(key, -math.inf) < deadline:
                if key not in self._deadline:
                    self._keys = None
                self._deadline[key] = deadline
                heapq.heappush(self._heap, (deadline, key[0], key[1]))

    def discard(self, keys: Iterable[tuple[int, int]]) -> int:
        """Drop the soft pins of these keys (unpinned, deleted, hard-pinned); returns how many there were."""
        dropped = 0
        for key in keys:
            if self._deadline.pop(key, None) is not None:
                dropped += 1
        if dropped:
            self._keys = None
            if not self._deadline:
                self._heap.clear()
        return dropped

    def clear(self) -> None:
        self._deadline.clear()
        self._heap.clear()
        self._keys = None

    def expire(self) -> int:
        """Drop every soft pin whose deadline has passed; returns how many."""
        now = self.clock()
        heap, dropped = self._heap, 0
        while heap and heap[0][0] <= now:
            deadline, k0, k1 = heapq.heappop(heap)
            if self._deadline.get((k0, k1)) == deadline:  # not renewed meanwhile
                del self._deadline[(k0, k1)]
                dropped += 1
        if dropped:
            self._keys = None
            self.expired += dropped
        return dropped

    def contains(self, key: tuple[int, int]) -> bool:
        """Whether ``key`` holds a soft pin that has not expired."""
        deadline = self._deadline.get(key)
        return deadline is not None and deadline > self.clock()

    def live_slots(self, index: BlockIndex) -> np.ndarray:
        """The index slots of the blocks soft-pinned now (expired pins dropped first; a pinned
        key no longer in the index is skipped), sorted: one vectorized probe."""
        self.expire()
        if not self._deadline:
            return np.zeros(0, np.int64)
        if self._keys is None:
            pairs = np.array(list(self._deadline), np.uint64).reshape(-1, 2)
            self._keys = (np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1]))
        slots = index.find_many(*self._keys)
        return np.sort(slots[slots >= 0])

    def bytes_by_region(self, index: BlockIndex, region_size_bytes: int, region_count: int) -> np.ndarray:
        """Soft-pinned bytes in each region now (int64, one per region)."""
        slots = self.live_slots(index)
        regions = (index.addr[slots] // np.uint64(region_size_bytes)).astype(np.int64)
        return np.bincount(regions, weights=index.length[slots].astype(np.float64),
                           minlength=region_count).astype(np.int64)
