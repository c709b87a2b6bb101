"""Prometheus families of the pull-through from the upstream (``--upstream``), read from one
``PullThrough.statistics()`` snapshot per scrape; nothing is counted here.

* prefix hit ratio per tier  ``kvtier_upstream_prefix_hit_ratio{tier="local"|"upstream"}`` (and the
  ``kvtier_upstream_prefix_blocks_total{tier}`` counters under it: LOOKUP leading blocks)
* upstream fetch latency     ``kvtier_upstream_fetch_duration_seconds`` (histogram, every call)
* upstream failures          ``kvtier_upstream_failures_total{kind}`` (timeout, unavailable, auth,
  protocol: requests; corrupt: blocks)
* background store           ``kvtier_upstream_store_dropped_blocks_total`` and the queue gauges
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

PREFIX_TIERS = (("local", "prefix_blocks_local"), ("upstream", "prefix_blocks_upstream"),
                ("missed", "prefix_blocks_missed"))

# (statistics field, metric name, help) — counters since start
_COUNTERS = (
    ("requests", "kvtier_upstream_requests", "Calls made to the upstream (LOOKUP and GET)."),
    ("blocks_asked", "kvtier_upstream_blocks_asked", "Blocks a GET asked of the upstream."),
    ("blocks_fetched", "kvtier_upstream_blocks_fetched", "Verified blocks fetched from the upstream and served."),
    ("bytes_fetched", "kvtier_upstream_fetched_bytes", "Bytes of verified blocks fetched from the upstream."),
    ("blocks_missed", "kvtier_upstream_blocks_missed", "Blocks the upstream did not hold."),
    ("blocks_pending_hits", "kvtier_upstream_pending_hits",
     "Blocks served from the background store queue before they reached the engine."),
    ("negative_hits", "kvtier_upstream_negative_hits",
     "Keys answered as a miss from the negative cache without asking the upstream."),
    ("skipped_down", "kvtier_upstream_skipped",
     "Upstream calls not made because that upstream failed moments ago (backoff)."),
    ("fallbacks", "kvtier_upstream_fallbacks",
     "Keys asked again of their next owner in the region: the one before failed, lacked or corrupted them."),
    ("fallback_hits", "kvtier_upstream_fallback_hits", "Keys found at an owner after the first."),
)
# (store statistics field, metric name, family, help)
_STORE = (
    ("stored_blocks", "kvtier_upstream_store_blocks", CounterMetricFamily,
     "Fetched blocks stored into this daemon's engine in the background."),
    ("dropped_blocks", "kvtier_upstream_store_dropped_blocks", CounterMetricFamily,
     "Fetched blocks dropped: the background store queue was full."),
    ("failed_blocks", "kvtier_upstream_store_failed_blocks", CounterMetricFamily,
     "Fetched blocks the engine refused to store (no space, a device error)."),
    ("queue_bytes", "kvtier_upstream_store_queue_bytes", GaugeMetricFamily, "Bytes waiting in the store queue."),
    ("queue_bytes_max", "kvtier_upstream_store_queue_bytes_max", GaugeMetricFamily, "The store queue's bound."),
)


def upstream_families(upstream: dict) -> Iterable[Metric]:
    """Nothing for a daemon without an upstream."""
    if not upstream:
        return
    prefix = CounterMetricFamily("kvtier_upstream_prefix_blocks",
                                 "LOOKUP keys by where their leading run was found: here, upstream, or nowhere.",
                                 labels=["tier"])
    asked = sum(upstream[field] for _, field in PREFIX_TIERS)
    ratio = GaugeMetricFamily("kvtier_upstream_prefix_hit_ratio",
                              "Leading keys found per tier over keys asked by LOOKUP since start (NaN before any).",
                              labels=["tier"])
    for tier, field in PREFIX_TIERS:
        prefix.add_metric([tier], upstream[field])
        if tier != "missed":
            ratio.add_metric([tier], upstream[field] / asked if asked else float("nan"))
    yield from (prefix, ratio)
    for field, name, help_text in _COUNTERS:
        yield CounterMetricFamily(name, help_text, value=upstream[field])
    failures = CounterMetricFamily("kvtier_upstream_failures",
                                   "Upstream failures served as misses, by kind (corrupt counts blocks).",
                                   labels=["kind"])
    for kind, count in sorted(upstream["failures"].items()):
        failures.add_metric([kind], count)
    yield failures
    for field, name, family, help_text in _STORE:
        yield family(name, help_text, value=upstream["store"][field])
    yield GaugeMetricFamily("kvtier_upstream_negative_entries", "Keys in the negative cache now.",
                            value=upstream["negative_entries"])
    hist = upstream["fetch_latency"]
    latency = HistogramMetricFamily("kvtier_upstream_fetch_duration_seconds",
                                    "Latency of each call to the upstream, answered or failed.")
    cumulative = list(hist["cumulative_counts"])
    buckets = [(_le(b), c) for b, c in zip(hist["bounds_s"], cumulative)] + [("+Inf", cumulative[-1])]
    latency.add_metric([], buckets, sum_value=hist["sum_s"])
    yield latency


def _le(bound_s: float) -> str:
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound_s)
