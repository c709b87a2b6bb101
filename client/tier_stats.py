"""Per-tier counters for the engine-side cache: hits, misses, bytes, latency.

Three tiers, as the design names them::

    hot  = the engine's device-memory pool (this process)
    warm = the local kvtierd's flash (TCP or a direct device read)
    cold = the daemon's upstream (a parent kvtierd): blocks the daemon had to fetch
           from it for this client, as the daemon reports per block (FLAG_WANT_ORIGIN)

A :class:`TierRecorder` is written by the cache (under its own lock, so
counters never race) and read with :meth:`TierRecorder.snapshot`, which
returns a frozen :class:`TierSnapshot`. :class:`CacheStatistics` bundles the
three snapshots; that is what ``KVCache.statistics()`` returns.

Latency samples are kept in a bounded ring (``LATENCY_SAMPLES_MAX``): the
percentiles describe recent operations, and memory stays constant however
long the engine runs.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

TIERS = ("hot", "warm", "cold")
LATENCY_SAMPLES_MAX = 4096  # enough for stable p99 over recent operations, 32 KiB per tier
PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class TierSnapshot:
    """One tier's counters at one moment. Hits and misses count blocks;
    latencies are per operation (one batch of blocks served by this tier)."""

    tier: str
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    operations: int
    latency_us_p50: float
    latency_us_p90: float
    latency_us_p99: float
    latency_us_max: float
    transports: Mapping[str, int] = field(default_factory=dict)  # blocks served, by transport name
    fallbacks: int = 0  # blocks a faster transport failed to validate and TCP served instead
    failovers: int = 0  # blocks asked of a later owner because an earlier one could not answer
    repairs: int = 0  # blocks found on a later owner and written back to an earlier one
    repairs_declined: int = 0  # of those, blocks the earlier owner did not take back: it deleted them lately

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(frozen=True)
class CacheStatistics:
    """The three tiers' snapshots plus the cache's own request counters."""

    hot: TierSnapshot
    warm: TierSnapshot
    cold: TierSnapshot
    hot_blocks_resident: int
    hot_blocks_referenced: int
    hot_capacity_blocks: int
    hot_evictions: int
    blocks_requested: int  # blocks that load()/load_blocks() were asked for
    blocks_stored: int  # blocks store() wrote to the daemon
    saves: Any = None  # the write-behind queue's SaveQueueStatistics

    def tier(self, name: str) -> TierSnapshot:
        if name not in TIERS:
            raise ValueError(f"unknown tier {name!r}; tiers are {TIERS}")
        return getattr(self, name)

    def as_dict(self) -> dict:
        """Plain JSON-able form (kvperf and the admin API report this)."""
        out: dict = {}
        for name in TIERS:
            snap = self.tier(name)
            out[name] = {
                "hits": snap.hits, "misses": snap.misses, "hit_ratio": snap.hit_ratio,
                "bytes_read": snap.bytes_read, "bytes_written": snap.bytes_written,
                "operations": snap.operations,
                "latency_us": {"p50": snap.latency_us_p50, "p90": snap.latency_us_p90,
                               "p99": snap.latency_us_p99, "max": snap.latency_us_max},
                "transports": dict(snap.transports), "fallbacks": snap.fallbacks,
                "failovers": snap.failovers, "repairs": snap.repairs, "repairs_declined": snap.repairs_declined,
            }
        out["hot_pool"] = {"resident_blocks": self.hot_blocks_resident,
                           "referenced_blocks": self.hot_blocks_referenced,
                           "capacity_blocks": self.hot_capacity_blocks,
                           "evictions": self.hot_evictions}
        out["blocks_requested"] = self.blocks_requested
        out["blocks_stored"] = self.blocks_stored
        return out


class TierRecorder:
    """Mutable counters of one tier; thread-safe; read through :meth:`snapshot`."""

    def __init__(self, tier: str) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; tiers are {TIERS}")
        self.tier = tier
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._bytes_read = 0
        self._bytes_written = 0
        self._fallbacks = 0
        self._failovers = 0
        self._repairs = self._repairs_declined = 0
        self._transports: dict[str, int] = {}
        self._latency_us = np.zeros(LATENCY_SAMPLES_MAX, dtype=np.float64)
        self._operations = 0

    def record(self, *, hits: int = 0, misses: int = 0, bytes_read: int = 0, bytes_written: int = 0,
               latency_s: float | None = None, transport: str | None = None, fallbacks: int = 0, failovers: int = 0,
               repairs: int = 0, repairs_declined: int = 0) -> None:
        """Add one operation's outcome. ``transport`` is credited with ``hits`` blocks."""
        if min(hits, misses, bytes_read, bytes_written, fallbacks, failovers, repairs, repairs_declined) < 0:
            raise ValueError("tier counters only grow; got a negative increment")
        with self._lock:
            self._hits += hits
            self._misses += misses
            self._bytes_read += bytes_read
            self._bytes_written += bytes_written
            self._fallbacks += fallbacks
            self._failovers += failovers
            self._repairs += repairs
            self._repairs_declined += repairs_declined
            if transport is not None and hits:
                self._transports[transport] = self._transports.get(transport, 0) + hits
            if latency_s is not None:
                self._latency_us[self._operations % LATENCY_SAMPLES_MAX] = latency_s * 1e6
                self._operations += 1

    def snapshot(self) -> TierSnapshot:
        with self._lock:
            n = min(self._operations, LATENCY_SAMPLES_MAX)
            samples = self._latency_us[:n].copy()
            hits, misses = self._hits, self._misses
            bytes_read, bytes_written = self._bytes_read, self._bytes_written
            transports = dict(self._transports)
            operations, fallbacks = self._operations, self._fallbacks
            failovers, repairs, declined = self._failovers, self._repairs, self._repairs_declined
        if n:
            p50, p90, p99 = (float(v) for v in np.percentile(samples, PERCENTILES))
            lat_max = float(samples.max())
        else:
            p50 = p90 = p99 = lat_max = 0.0
        return TierSnapshot(tier=self.tier, hits=hits, misses=misses, bytes_read=bytes_read,
                            bytes_written=bytes_written, operations=operations,
                            latency_us_p50=p50, latency_us_p90=p90, latency_us_p99=p99,
                            latency_us_max=lat_max, transports=MappingProxyType(transports),
                            fallbacks=fallbacks, failovers=failovers, repairs=repairs, repairs_declined=declined)
