"""A short memory of keys the upstream said it does not hold, so a burst of requests for an
absent prefix costs one upstream round trip, not one per request. Pure bookkeeping: the
clock is passed in (``now_s``), nothing here does I/O.

Entries are ``(namespace id, key)``; each expires ``ttl_s`` after it was added, and past
``entries_max`` the oldest goes first (insertion order is expiry order: one TTL for all).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

NEGATIVE_TTL_S = 2.0  # a block put at the region after a miss is fetched at most this much later
NEGATIVE_ENTRIES_MAX = 65536  # 64 Ki keys, a few MiB: bounds the memory whatever the miss rate


class NegativeCache:
    """Thread-safe; see the module doc."""

    def __init__(self, ttl_s: float = NEGATIVE_TTL_S, entries_max: int = NEGATIVE_ENTRIES_MAX):
        if not ttl_s > 0 or entries_max < 1:
            raise ValueError(f"negative cache needs ttl_s > 0 and entries_max >= 1, got {ttl_s}, {entries_max}")
        self.ttl_s, self.entries_max = ttl_s, entries_max
        self._expiry: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)

    def add(self, ns_id: bytes | None, keys, now_s: float) -> None:
        """Remember ``keys`` as absent upstream until ``now_s + ttl_s``."""
        ns = bytes(ns_id or b"")
        with self._lock:
            self._expire(now_s)
            for key in keys:
                entry = (ns, bytes(key))
                self._expiry.pop(entry, None)
                self._expiry[entry] = now_s + self.ttl_s
            while len(self._expiry) > self.entries_max:
                self._expiry.popitem(last=False)

    def absent(self, ns_id: bytes | None, keys, now_s: float) -> list[bool]:
        """Per key, whether it is remembered as absent upstream now."""
        ns = bytes(ns_id or b"")
        with self._lock:
            self._expire(now_s)
            return [(ns, bytes(key)) in self._expiry for key in keys]

    def forget(self, ns_id: bytes | None, keys) -> None:
        """Drop ``keys`` (they were stored here or upstream since)."""
        ns = bytes(ns_id or b"")
        with self._lock:
            for key in keys:
                self._expiry.pop((ns, bytes(key)), None)

    def _expire(self, now_s: float) -> None:
        while self._expiry:
            entry, expiry = next(iter(self._expiry.items()))
            if expiry > now_s:
                return
            del self._expiry[entry]
