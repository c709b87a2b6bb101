"""Counters of the data server, recorded under one lock, read as a frozen snapshot.

Latency histograms use fixed bucket bounds (Prometheus style: cumulative
counts per upper bound, plus the sum), so the admin API can export them as is.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

# upper bounds in seconds: 50 us .. 10 s, covering a cached LOOKUP to a durable 64 MiB PUT
LATENCY_BUCKET_BOUNDS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
NAMESPACES_TRACKED_MAX = 1024  # per-namespace counters kept; others fold into "other" (bounds memory)
OTHER_NAMESPACE = "other"
NO_NAMESPACE = "none"


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds_s: tuple[float, ...]
    cumulative_counts: tuple[int, ...]  # per bound, then +Inf last
    count: int
    sum_s: float


@dataclass(frozen=True)
class NamespaceCounts:
    hits: int
    misses: int


@dataclass(frozen=True)
class ServerStatistics:
    open_connections: int
    total_connections: int
    rejected_connections: int
    idle_closed_connections: int
    requests: Mapping[str, int]  # op name -> count
    errors: Mapping[str, int]  # error code name -> count
    bytes_in: int
    bytes_out: int
    latency: Mapping[str, HistogramSnapshot]  # op name -> histogram
    lookup_keys_asked: int
    lookup_keys_hit: int
    namespaces: Mapping[str, NamespaceCounts]  # ns id hex (or "none"/"other") -> GET+LOOKUP hits/misses
    repair_bytes_in: int = 0  # PUT bytes from kvtier cluster repair (HELLO client name REPAIR_CLIENT_NAME)
    evicted_connections: int = 0  # closed to give their slot to a newcomer (idle longest; see slots)

    def as_dict(self) -> dict:
        """Plain JSON-able form (the STATS reply)."""
        return {
            "open_connections": self.open_connections, "total_connections": self.total_connections,
            "rejected_connections": self.rejected_connections,
            "idle_closed_connections": self.idle_closed_connections, "requests": dict(self.requests),
            "errors": dict(self.errors), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "latency": {op: {"bounds_s": list(h.bounds_s), "cumulative_counts": list(h.cumulative_counts),
                             "count": h.count, "sum_s": h.sum_s} for op, h in self.latency.items()},
            "lookup_keys_asked": self.lookup_keys_asked, "lookup_keys_hit": self.lookup_keys_hit,
            "namespaces": {ns: {"hits": c.hits, "misses": c.misses} for ns, c in self.namespaces.items()},
            "repair_bytes_in": self.repair_bytes_in, "evicted_connections": self.evicted_connections,
        }


class _Histogram:
    __slots__ = ("counts", "sum_s")

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKET_BOUNDS_S) + 1)
        self.sum_s = 0.0

    def snapshot(self) -> HistogramSnapshot:
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return HistogramSnapshot(LATENCY_BUCKET_BOUNDS_S, tuple(cumulative), total, self.sum_s)


class ServerStatsRecorder:
    """Thread-safe counters; every update takes the one lock briefly."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open = self._total = self._rejected = self._idle_closed = self._evicted = 0
        self._requests: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._bytes_in = self._bytes_out = 0
        self._repair_bytes_in = 0
        self._latency: dict[str, _Histogram] = {}
        self._lookup_asked = self._lookup_hit = 0
        self._ns: dict[str, list[int]] = {}

    def connection_opened(self) -> None:
        with self._lock:
            self._open += 1
            self._total += 1

    def connection_closed(self) -> None:
        with self._lock:
            self._open -= 1

    def connection_rejected(self) -> None:
        with self._lock:
            self._rejected += 1

    def connection_evicted(self) -> None:
        with self._lock:
            self._evicted += 1

    def connection_idle_closed(self) -> None:
        with self._lock:
            self._idle_closed += 1

    def request_done(self, op: str, seconds: float, bytes_in: int, bytes_out: int) -> None:
        with self._lock:
            self._requests[op] = self._requests.get(op, 0) + 1
            hist = self._latency.get(op)
            if hist is None:
                hist = self._latency[op] = _Histogram()
            hist.counts[bisect.bisect_left(LATENCY_BUCKET_BOUNDS_S, seconds)] += 1
            hist.sum_s += seconds
            self._bytes_in += bytes_in
            self._bytes_out += bytes_out

    def repair_received(self, nbytes: int) -> None:
        """A PUT from the re-replication client: ``nbytes`` moved here by ``kvtier cluster repair``."""
        with self._lock:
            self._repair_bytes_in += nbytes

    def error(self, code_name: str) -> None:
        with self._lock:
            self._errors[code_name] = self._errors.get(code_name, 0) + 1

    def lookup(self, asked: int, hit: int) -> None:
        with self._lock:
            self._lookup_asked += asked
            self._lookup_hit += hit

    def namespace(self, ns_id: bytes | None, hits: int, misses: int) -> None:
        name = NO_NAMESPACE if ns_id is None else bytes(ns_id).hex()
        with self._lock:
            counts = self._ns.get(name)
            if counts is None:
                if len(self._ns) >= NAMESPACES_TRACKED_MAX:
                    name = OTHER_NAMESPACE
                counts = self._ns.setdefault(name, [0, 0])
            counts[0] += hits
            counts[1] += misses

    def snapshot(self) -> ServerStatistics:
        with self._lock:
            return ServerStatistics(
                open_connections=self._open, total_connections=self._total, rejected_connections=self._rejected,
                idle_closed_connections=self._idle_closed,
                requests=MappingProxyType(dict(self._requests)), errors=MappingProxyType(dict(self._errors)),
                bytes_in=self._bytes_in, bytes_out=self._bytes_out,
                latency=MappingProxyType({op: h.snapshot() for op, h in self._latency.items()}),
                lookup_keys_asked=self._lookup_asked, lookup_keys_hit=self._lookup_hit,
                namespaces=MappingProxyType({ns: NamespaceCounts(c[0], c[1]) for ns, c in self._ns.items()}),
                repair_bytes_in=self._repair_bytes_in, evicted_connections=self._evicted)
