"""The data server's side of popularity counting: chains handed over, counted later.

The request handler calls :meth:`ChainObserver.observe` once per LOOKUP or GET with the
keys as the one packed buffer they arrived in; that only appends a reference (and the
time) to a bounded queue under a short lock. The pre-placement worker
:meth:`drains <ChainObserver.drain>` it into :class:`.popularity.PrefixPopularity`, so no
request waits on the counting. Past OBSERVATIONS_QUEUED_MAX queued requests or
OBSERVATION_BYTES_QUEUED_MAX bytes of their keys, new ones are dropped and counted:
popularity is then estimated from a sample.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from kvtier.daemon.preplace.popularity import KEY_BYTES, PREFIX_KEYS_MAX

OBSERVATIONS_QUEUED_MAX = 65536  # requests between two drains
OBSERVATION_BYTES_QUEUED_MAX = 64 << 20  # their keys (a request holds up to 256 KiB): 4 Mi keys at most


class ChainObserver:
    """Thread-safe queue of ``(ns_id, packed keys, time)``, one per request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, queued_max: int = OBSERVATIONS_QUEUED_MAX,
                 queued_bytes_max: int = OBSERVATION_BYTES_QUEUED_MAX):
        self._clock = clock
        self._queued_max, self._queued_bytes_max = queued_max, queued_bytes_max
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._queue: deque = deque()
        self._observed = 0
        self._dropped = 0

    def observe(self, ns_id: bytes | None, packed_keys: bytes) -> None:
        """Hot path: one LOOKUP/GET chain (count x 16 bytes, as received)."""
        if not packed_keys:
            return
        keys = packed_keys[:PREFIX_KEYS_MAX * KEY_BYTES]  # the same object unless longer than a prefix is kept
        now_s = self._clock()
        with self._lock:
            if len(self._queue) >= self._queued_max or self._queued_bytes + len(keys) > self._queued_bytes_max:
                self._dropped += 1
                return
            self._queue.append((ns_id, keys, now_s))
            self._queued_bytes += len(keys)
            self._observed += 1

    def drain(self) -> list:
        """Every queued observation, oldest first; the queue is empty afterwards."""
        with self._lock:
            out, self._queue, self._queued_bytes = list(self._queue), deque(), 0
        return out

    def counts(self) -> tuple[int, int]:
        """(observed, dropped) since start."""
        with self._lock:
            return self._observed, self._dropped
