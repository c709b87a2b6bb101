"""Pre-placement's Prometheus families (``--preplace-edges``), read from ``PrePlacer.statistics()``.

Per edge (label ``edge``: its node id, or HOST:PORT for a fixed list): pushes, failures,
pre-placed blocks and bytes (PUT to it), soft pins it confirmed, and the region's view of
what is soft-pinned there now. At the edge itself, ``kvtier_soft_pinned_bytes`` is the
edge's own figure.
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# (statistics field, metric name, family, help) — one sample each
_FIGURES = (
    ("rounds", "kvtier_preplace_rounds", CounterMetricFamily, "Periodic pre-placement push rounds done."),
    ("admin_requests", "kvtier_preplace_admin_requests", CounterMetricFamily, "/v1/preplace calls served."),
    ("observations", "kvtier_preplace_observations", CounterMetricFamily, "LOOKUP/GET chains counted for popularity."),
    ("observations_dropped", "kvtier_preplace_observations_dropped", CounterMetricFamily,
     "Chains not counted: the queue to the pusher was full."),
    ("heads_tracked", "kvtier_preplace_heads_tracked", GaugeMetricFamily, "Chain heads whose popularity is counted."),
    ("heads_evicted", "kvtier_preplace_heads_evicted", CounterMetricFamily,
     "Chain heads dropped as the least popular (bounded memory)."),
)
# (edge figures field, metric name, family, help) — one sample per edge
_EDGE_FIGURES = (
    ("pushes", "kvtier_preplace_pushes", CounterMetricFamily, "Pushes the edge took (rounds and /v1/preplace)."),
    ("failures", "kvtier_preplace_failures", CounterMetricFamily,
     "Pushes to the edge that failed (down, wrong token, no soft pins, an error reply)."),
    ("preplaced_blocks", "kvtier_preplaced_blocks", CounterMetricFamily, "Blocks pre-placed (PUT) at the edge."),
    ("preplaced_bytes", "kvtier_preplaced_bytes", CounterMetricFamily, "Bytes pre-placed (PUT) at the edge."),
    ("pinned_blocks", "kvtier_preplace_pinned_blocks", CounterMetricFamily,
     "Soft pins the edge confirmed (renewals included)."),
    ("soft_pinned_blocks", "kvtier_preplace_soft_pinned_blocks", GaugeMetricFamily,
     "Blocks soft-pinned at the edge now, as this region counts them."),
    ("soft_pinned_bytes", "kvtier_preplace_soft_pinned_bytes", GaugeMetricFamily,
     "Bytes soft-pinned at the edge now, as this region counts them."),
)


def preplace_families(stats: dict) -> Iterable[Metric]:
    if not stats:
        return
    for field, name, family, help_text in _FIGURES:
        yield family(name, help_text, value=stats[field])
    edges = stats.get("edges") or {}
    for field, name, family, help_text in _EDGE_FIGURES:
        metric = family(name, help_text, labels=["edge"])
        for edge, figures in sorted(edges.items()):
            metric.add_metric([edge], figures[field])
        yield metric
