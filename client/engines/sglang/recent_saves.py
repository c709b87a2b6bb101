"""The keys an SGLang backend queued for saving lately (no framework imports, no I/O).

SGLang's cache controller backs up a whole prefix again when it grows; the
pages it already backed up need not be sent twice. Write-behind saves have no
LOOKUP before the PUT, so the backend remembers the keys it queued, at most
``RECENT_SAVES_MAX`` of them (the oldest are forgotten first), for
``RECENT_SAVE_TTL_S`` from when they were queued (a check does not renew them),
and skips the leading ones. A save that fails in the background forgets its
keys, so that the next backup sends them again; a page the daemon lost later
(evicted, deleted) is sent again by the first backup past its TTL. The keys of saves still in flight (queued,
not yet acknowledged) also count as present to ``batch_exists``
(:meth:`RecentSaves.in_flight_from`): a page queued a moment ago is not absent.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, wait
from typing import Callable, Sequence

RECENT_SAVES_MAX = 1 << 16  # keys remembered (about 10 MiB); older ones are sent again, which is harmless
RECENT_SAVE_TTL_S = 60.0  # a queued key is taken as stored this long; then a backup sends it again (a no-op if present)


class RecentSaves:
    """See the module doc; thread-safe."""

    def __init__(self, keys_max: int = RECENT_SAVES_MAX, ttl_s: float = RECENT_SAVE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if keys_max < 1:
            raise ValueError(f"keys_max must be >= 1, got {keys_max}")
        self.keys_max = keys_max
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: OrderedDict[bytes, float] = OrderedDict()  # key -> when it was queued, oldest first
        self._pending: set[Future] = set()
        self._in_flight: dict[bytes, int] = {}  # key -> saves in flight that carry it

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` were queued within the TTL."""
        with self._lock:
            since = self._clock() - self.ttl_s
            n = 0
            while n < len(keys) and self._keys.get(keys[n], since) > since:
                n += 1
            return n

    def in_flight_from(self, keys: Sequence[bytes], start: int) -> int:
        """How many of ``keys[start:]``, from the first on, are in saves still in flight."""
        with self._lock:
            n = start
            while n < len(keys) and keys[n] in self._in_flight:
                n += 1
            return n - start

    def add(self, keys: Sequence[bytes], future: Future) -> None:
        """Remember ``keys``, queued as ``future``; forget them if it fails."""
        with self._lock:
            now = self._clock()
            for key in keys:
                self._keys[key] = now
                self._keys.move_to_end(key)
            while len(self._keys) > self.keys_max:
                self._keys.popitem(last=False)
            self._pending.add(future)
            for key in keys:
                self._in_flight[key] = self._in_flight.get(key, 0) + 1
        future.add_done_callback(lambda f, keys=tuple(keys): self._done(f, keys))

    def _done(self, future: Future, keys: tuple[bytes, ...]) -> None:
        with self._lock:
            if future in self._pending:
                self._pending.discard(future)
                for key in keys:
                    left = self._in_flight.pop(key) - 1
                    if left:
                        self._in_flight[key] = left
            if future.exception() is not None:
                for key in keys:
                    self._keys.pop(key, None)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the saves queued so far; False on timeout."""
        with self._lock:
            pending = list(self._pending)
        _, not_done = wait(pending, timeout=timeout_s)
        return not not_done
