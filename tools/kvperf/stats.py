"""Latency and bandwidth statistics in fio's shapes.

A clone records every completed request as (completion time, latency, bytes)
into an :class:`OpLog`; the report turns the merged logs of a job's clones
into fio's direction object (``io_bytes``, ``bw_bytes``, ``bw`` in KiB/s,
``iops``, ``runtime`` in ms, ``total_ios``, ``clat_ns`` with percentiles keyed
``"99.000000"``, ``bw_min``/``bw_max``/``bw_mean``/``bw_dev``/``bw_samples``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# fio's default percentile list (``percentile_list``)
PERCENTILES = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0,
               99.0, 99.5, 99.9, 99.95, 99.99)
BW_SAMPLE_MS = 500  # fio's bw_avg_time default: one bandwidth sample per 500 ms
NS_PER_S = 1_000_000_000


def percentile_key(p: float) -> str:
    """fio's key for a percentile: ``99`` -> ``"99.000000"``."""
    return f"{p:.6f}"


@dataclass
class OpLog:
    """Completed requests of one direction in one clone (single writer)."""

    done_ns: list[int] = field(default_factory=list)  # completion time since the clone's start
    lat_ns: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)

    def add(self, done_ns: int, lat_ns: int, nbytes: int) -> None:
        self.done_ns.append(done_ns)
        self.lat_ns.append(lat_ns)
        self.nbytes.append(nbytes)

    def arrays(self) -> "OpArrays":
        return OpArrays(np.asarray(self.done_ns, dtype=np.int64), np.asarray(self.lat_ns, dtype=np.int64),
                        np.asarray(self.nbytes, dtype=np.int64))


@dataclass(frozen=True)
class OpArrays:
    done_ns: np.ndarray
    lat_ns: np.ndarray
    nbytes: np.ndarray

    @staticmethod
    def merge(parts: list["OpArrays"]) -> "OpArrays":
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return OpArrays(empty, empty, empty)
        return OpArrays(*(np.concatenate([getattr(p, n) for p in parts]) for n in ("done_ns", "lat_ns", "nbytes")))

    def __len__(self) -> int:
        return int(self.lat_ns.size)


def clat_stats(lat_ns: np.ndarray) -> dict:
    """fio's ``clat_ns`` object. Percentiles are exact (the smallest sample at
    or above the rank), where fio interpolates a histogram."""
    n = int(lat_ns.size)
    if n == 0:
        return {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0,
                "percentile": {percentile_key(p): 0 for p in PERCENTILES}}
    values = np.percentile(lat_ns, PERCENTILES, method="inverted_cdf")
    return {
        "min": int(lat_ns.min()),
        "max": int(lat_ns.max()),
        "mean": float(lat_ns.mean()),
        "stddev": float(lat_ns.std(ddof=1)) if n > 1 else 0.0,
        "N": n,
        "percentile": {percentile_key(p): int(v) for p, v in zip(PERCENTILES, values)},
    }


def bw_series(ops: OpArrays, runtime_ns: int, sample_ms: int = BW_SAMPLE_MS) -> tuple[np.ndarray, np.ndarray]:
    """(sample end times in s, bandwidth in bytes/s) in ``sample_ms`` windows.
    The last window may be shorter and is scaled by its real width; one under
    half a window joins the window before it (a few ms scaled up would spike)."""
    if runtime_ns <= 0:
        return np.zeros(0), np.zeros(0)
    width_ns = sample_ms * 1_000_000
    edges = np.arange(0, runtime_ns, width_ns, dtype=np.int64)
    edges = np.append(edges, runtime_ns)
    if edges.size > 2 and edges[-1] - edges[-2] < width_ns // 2:
        edges = np.delete(edges, -2)
    sums, _ = np.histogram(ops.done_ns, bins=edges, weights=ops.nbytes)
    widths_s = np.diff(edges) / NS_PER_S
    return edges[1:] / NS_PER_S, sums / widths_s


def direction_stats(ops: OpArrays, runtime_ns: int, extra: dict | None = None) -> dict:
    """fio's per-direction object (``read``/``write``) for ``ops`` over ``runtime_ns``."""
    io_bytes = int(ops.nbytes.sum())
    total = len(ops)
    runtime_s = runtime_ns / NS_PER_S if runtime_ns > 0 else 0.0
    bw_bytes = io_bytes / runtime_s if runtime_s else 0.0
    iops = total / runtime_s if runtime_s else 0.0
    _, series = bw_series(ops, runtime_ns) if total else (None, np.zeros(0))
    kib = series / 1024.0
    out = {
        "io_bytes": io_bytes,
        "io_kbytes": io_bytes // 1024,
        "bw_bytes": int(bw_bytes),
        "bw": int(bw_bytes / 1024),
        "iops": float(iops),
        "runtime": int(round(runtime_ns / 1_000_000)),
        "total_ios": total,
        "short_ios": 0,
        "drop_ios": 0,
        "clat_ns": clat_stats(ops.lat_ns),
        "bw_min": int(kib.min()) if kib.size else 0,
        "bw_max": int(kib.max()) if kib.size else 0,
        "bw_agg": 100.0 if total else 0.0,
        "bw_mean": float(kib.mean()) if kib.size else 0.0,
        "bw_dev": float(kib.std(ddof=1)) if kib.size > 1 else 0.0,
        "bw_samples": int(kib.size),
    }
    out["lat_ns"] = out["clat_ns"]  # no separate submission latency: a request is issued as it is made
    if extra:
        out.update(extra)
    return out


def ms_stats(values_ms) -> dict:
    """The ``clat_ns`` shape for times in milliseconds (floats): the ttft
    section's ``recompute_ms``, ``inmemory_ms`` and ``kvtier_ms``."""
    arr = np.asarray(values_ms, dtype=np.float64)
    n = int(arr.size)
    if n == 0:
        return {"min": 0.0, "max": 0.0, "mean": 0.0, "stddev": 0.0, "N": 0,
                "percentile": {percentile_key(p): 0.0 for p in PERCENTILES}}
    values = np.percentile(arr, PERCENTILES, method="inverted_cdf")
    return {"min": float(arr.min()), "max": float(arr.max()), "mean": float(arr.mean()),
            "stddev": float(arr.std(ddof=1)) if n > 1 else 0.0, "N": n,
            "percentile": {percentile_key(p): float(v) for p, v in zip(PERCENTILES, values)}}
