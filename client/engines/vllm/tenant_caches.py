"""One :class:`~kvtier.client.kvcache.KVCache` per tenant namespace (no framework imports).

A ``KVCache`` stamps one namespace id on every block it writes and on every
LOOKUP and GET it sends. So that the daemon sees the tenant's (and LoRA
adapter's) id, the connector opens one cache per tenant namespace it meets,
on first use::

    (cache_salt, lora_name) -> tenant namespace (request_namespace(base, ...)) -> KVCache

At most ``TENANT_CACHES_MAX`` stay open; opening one more closes the least
recently used on a background thread (closing drains its write-behind saves,
which must not stall the step). Statistics add up the open and closed caches.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import fields
from typing import Callable

from kvtier.client.engines.namespaces import request_namespace
from kvtier.client.kvcache import KVCache
from kvtier.client.save_queue import SaveQueueStatistics
from kvtier.common.keys import Namespace

TENANT_CACHES_MAX = 64  # open caches (connections, threads, send buffers each); the least recently used closes

_CUMULATIVE = ("saves_done", "saves_failed", "saves_dropped", "blocks_dropped")


class TenantCaches:
    """``get(cache_salt, lora_name)``: the tenant's cache, opened on first use; see the module doc."""

    def __init__(self, base: Namespace, open_cache: Callable[[Namespace], KVCache],
                 limit: int = TENANT_CACHES_MAX) -> None:
        if limit < 1:
            raise ValueError(f"tenant cache limit must be >= 1, got {limit}")
        self.base = base
        self._open_cache = open_cache
        self.limit = limit
        self._lock = threading.Lock()
        self._caches: OrderedDict[tuple, KVCache] = OrderedDict()
        self._closed_totals = dict.fromkeys(_CUMULATIVE, 0)
        self._closers: list[threading.Thread] = []

    def namespace(self, cache_salt: str | None, lora_name: str | None) -> Namespace:
        """The tenant namespace: its id is what the daemon sees."""
        return request_namespace(self.base, cache_salt, lora_name)

    def get(self, cache_salt: str | None, lora_name: str | None) -> KVCache:
        tenant = (cache_salt or None, lora_name or None)
        with self._lock:
            cache = self._caches.get(tenant)
            if cache is not None:
                self._caches.move_to_end(tenant)
                return cache
        cache = self._open_cache(self.namespace(*tenant))
        with self._lock:
            if tenant in self._caches:  # opened meanwhile by another thread
                spare, cache = cache, self._caches[tenant]
                self._retire(spare)
                return cache
            self._caches[tenant] = cache
            while len(self._caches) > self.limit:
                _, old = self._caches.popitem(last=False)
                self._retire(old)
        return cache

    def _retire(self, cache: KVCache) -> None:
        """Close ``cache`` in the background (lock held)."""
        thread = threading.Thread(target=self._close_and_count, args=(cache,), name="kvtier-tenant-close",
                                  daemon=True)
        self._closers.append(thread)
        thread.start()

    def saves(self) -> SaveQueueStatistics:
        """Write-behind statistics over every tenant's cache, open or closed."""
        with self._lock:
            caches = list(self._caches.values())
            totals = dict(self._closed_totals)
        totals.update(saves_queued=0, bytes_queued=0)
        for cache in caches:
            stats = cache.statistics().saves
            for f in fields(SaveQueueStatistics):
                totals[f.name] += getattr(stats, f.name)
        return SaveQueueStatistics(**totals)

    def __len__(self) -> int:
        return len(self._caches)

    def close(self) -> None:
        """Drain and close every cache (the connector's shutdown)."""
        with self._lock:
            caches = list(self._caches.values())
            self._caches.clear()
            closers, self._closers = self._closers, []
        for cache in caches:
            self._close_and_count(cache)
        for thread in closers:
            thread.join()

    def _close_and_count(self, cache: KVCache) -> None:
        """Drain and close ``cache``; keep its save counts in the totals."""
        cache.close()
        stats = cache.statistics().saves
        with self._lock:
            for name in _CUMULATIVE:
                self._closed_totals[name] += getattr(stats, name)
