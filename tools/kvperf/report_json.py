"""The JSON report, in fio's shape (``--output-format=json``)::

    {"kvperf version": ..., "timestamp": ..., "timestamp_ms": ..., "time": ...,
     "global options": {...},
     "jobs": [{"jobname", "groupid", "error", "elapsed", "job options", "job_runtime",
               "read": {...}, "write": {...}, "lookup": {...},
               "verify_errors", "prefix": {...} | "ttft": {...}}],
     "gates": [{"gate", "job", "measured", "pass", "note"}]}

Per direction: fio's ``io_bytes``, ``bw_bytes``, ``bw`` (KiB/s), ``iops``,
``runtime`` (ms), ``total_ios``, ``clat_ns`` (``min``, ``max``, ``mean``,
``stddev``, ``N``, ``percentile`` keyed ``"99.000000"``) and the bandwidth
sample stats; kvperf adds ``misses``. Bytes are payload bytes (``bs`` per
block); the 64-byte block header is not counted.
"""
from __future__ import annotations

import errno
import time

import numpy as np

from .gates import GateResult
from .jobfile import RawJob
from .options import JobOptions
from .result import JobResult
from .stats import NS_PER_S, clat_stats, direction_stats

KVPERF_VERSION = "kvperf-0.1.0"


def job_error(result: JobResult) -> int:
    """fio's per-job ``error``: an errno; EILSEQ when verify found bad data."""
    return errno.EILSEQ if result.counters["verify_errors"] else 0


def job_report(index: int, job: JobOptions, raw: RawJob, result: JobResult) -> dict:
    c = result.counters
    doc: dict = {
        "jobname": job.name,
        "groupid": index,
        "error": job_error(result),
        "eta": 0,
        "elapsed": int(round(result.runtime_ns / NS_PER_S)),
        "job options": {k: v for k, v in raw.values().items()},
        "description": job.description,
        "clones": result.clones,
        "job_runtime": int(round(result.runtime_ns / 1_000_000)),
        "read": direction_stats(result.read, result.runtime_ns, {"misses": c["misses"] if job.rw != "lookup" else 0}),
        "write": direction_stats(result.write, result.runtime_ns),
        "verify_errors": c["verify_errors"],
        "verify_messages": list(result.verify_messages),
        "verified_blocks": c["verified_blocks"],
        "laid_out_blocks": c["laid_out_blocks"],
    }
    if job.rw in ("lookup", "prefix"):
        lookup = direction_stats(result.lookup, result.runtime_ns)
        if job.rw == "lookup":
            seconds = result.runtime_ns / NS_PER_S
            lookup.update({"keys": c["lookup_keys"], "found": c["lookup_found"], "misses": c["misses"],
                           "keys_per_s": c["lookup_keys"] / seconds if seconds else 0.0})
        doc["lookup"] = lookup
    if job.target.startswith("direct:"):
        doc["direct"] = {"blocks": c["direct_blocks"], "fallbacks": c["direct_fallbacks"]}
    if job.rw == "prefix":
        doc["prefix"] = prefix_report(job, result)
    if result.ttft is not None:
        doc["ttft"] = result.ttft
    return doc


def prefix_report(job: JobOptions, result: JobResult) -> dict:
    c = result.counters
    seconds = result.runtime_ns / NS_PER_S
    return {
        "requests": c["requests"],
        "blocks": c["blocks"],
        "hit_blocks": c["hit_blocks"],
        "hit_ratio": c["hit_blocks"] / c["blocks"] if c["blocks"] else 0.0,
        "bytes_saved": c["hit_blocks"] * job.bs,
        "tokens_saved": c["hit_blocks"] * job.block_tokens,
        "tokens_recomputed": (c["blocks"] - c["hit_blocks"]) * job.block_tokens,
        "requests_per_s": c["requests"] / seconds if seconds else 0.0,
        "request_clat_ns": clat_stats(np.asarray(result.request_lat_ns, dtype=np.int64)),
    }


def gate_report(results: list[GateResult]) -> list[dict]:
    return [{"gate": r.gate.text, "job": r.job, "measured": r.measured, "pass": r.passed, "note": r.note}
            for r in results]


def full_report(global_options: dict[str, str], jobs: list[dict], gates: list[GateResult]) -> dict:
    now = time.time()
    return {
        "kvperf version": KVPERF_VERSION,
        "timestamp": int(now),
        "timestamp_ms": int(now * 1000),
        "time": time.ctime(now),
        "global options": global_options,
        "jobs": jobs,
        "gates": gate_report(gates),
    }
