"""Counters of the pull-through from the upstream, recorded under one lock, read as a frozen
snapshot (the admin API's /v1/stats ``upstream`` section and the ``kvtier_upstream_*`` metrics).

Prefix figures come from LOOKUPs: of the keys asked, how many leading ones this daemon held
(``prefix_blocks_local``), how many more the upstream held (``prefix_blocks_upstream``), and
the rest (``prefix_blocks_missed``). Block figures come from GETs of keys this daemon lacked.
Where the upstream keeps replicas, ``fallbacks`` counts the keys asked again of their next
owner and ``fallback_hits`` those found there. The fetch latency histogram has fixed bounds
(Prometheus style: cumulative counts per bound).
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Mapping

from .errors import FailureKind

# upper bounds in seconds: a LAN round trip (0.5 ms) to a WAN fetch that hits a multi-second timeout
FETCH_LATENCY_BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class FetchLatency:
    bounds_s: tuple[float, ...]
    cumulative_counts: tuple[int, ...]  # per bound, then +Inf last
    count: int
    sum_s: float


@dataclass(frozen=True)
class UpstreamStatistics:
    target: str  # --upstream as given
    requests: int  # calls made to the upstream (LOOKUP and GET)
    prefix_blocks_local: int
    prefix_blocks_upstream: int
    prefix_blocks_missed: int
    blocks_asked: int  # keys a GET asked of the upstream
    blocks_fetched: int  # verified blocks it returned (served, and offered to the store queue)
    bytes_fetched: int
    blocks_missed: int  # keys it does not hold
    blocks_pending_hits: int  # blocks served from the store queue before they reached the engine
    negative_hits: int  # keys answered as a miss from the negative cache, without asking
    skipped_down: int  # requests not sent because the upstream failed moments ago
    fallbacks: int  # keys asked of a key's next owner: the one before failed, was skipped, lacked or corrupted it
    fallback_hits: int  # of those, keys a later owner held (LOOKUP leading keys, GET verified blocks)
    failures: Mapping[str, int]  # FailureKind value -> count (corrupt counts blocks, the rest requests)
    negative_entries: int
    store: Mapping[str, int]  # StoreQueueStatistics as a dict
    fetch_latency: FetchLatency

    def as_dict(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["failures"] = dict(self.failures)
        doc["store"] = dict(self.store)
        doc["fetch_latency"] = {"bounds_s": list(self.fetch_latency.bounds_s),
                                "cumulative_counts": list(self.fetch_latency.cumulative_counts),
                                "count": self.fetch_latency.count, "sum_s": self.fetch_latency.sum_s}
        return doc


class UpstreamRecorder:
    """Thread-safe counters; every update takes the one lock briefly."""

    _FIELDS = ("requests", "prefix_blocks_local", "prefix_blocks_upstream", "prefix_blocks_missed", "blocks_asked",
               "blocks_fetched", "bytes_fetched", "blocks_missed", "blocks_pending_hits", "negative_hits",
               "skipped_down", "fallbacks", "fallback_hits")

    def __init__(self, target: str):
        self.target = target
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self._FIELDS, 0)
        self._failures = {kind.value: 0 for kind in FailureKind}
        self._latency_counts = [0] * (len(FETCH_LATENCY_BOUNDS_S) + 1)
        self._latency_sum_s = 0.0

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def failed(self, kind: FailureKind, count: int = 1) -> None:
        with self._lock:
            self._failures[kind.value] += count

    def fetched_in(self, seconds: float) -> None:
        """One upstream call's latency (answered or not)."""
        with self._lock:
            self._latency_counts[bisect.bisect_left(FETCH_LATENCY_BOUNDS_S, seconds)] += 1
            self._latency_sum_s += seconds

    def snapshot(self, negative_entries: int, store: Mapping[str, int]) -> UpstreamStatistics:
        with self._lock:
            counts, failures = dict(self._counts), dict(self._failures)
            buckets, total_s = list(self._latency_counts), self._latency_sum_s
        cumulative, running = [], 0
        for c in buckets:
            running += c
            cumulative.append(running)
        return UpstreamStatistics(target=self.target, **counts, failures=MappingProxyType(failures),
                                  negative_entries=negative_entries, store=MappingProxyType(dict(store)),
                                  fetch_latency=FetchLatency(FETCH_LATENCY_BOUNDS_S, tuple(cumulative), running,
                                                             total_s))
