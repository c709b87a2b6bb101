"""Prometheus metrics of kvtierd: a custom collector that reads statistics() at scrape time.

Nothing is counted here. Each scrape takes one ``engine.statistics()`` snapshot
and one data-server ``statistics()`` snapshot and turns them into metric
families, so the figures in /metrics, /v1/stats and ``kvtier stats`` agree.

Names follow the Prometheus conventions: a ``kvtier_`` prefix, base units
(seconds, bytes), ``_total`` on counters (prometheus-client appends it), and
labels for dimensions (``tier``, ``namespace``, ``op``, ``state``).

The three figures article 000 says to watch:

* prefix hit ratio   ``kvtier_lookup_prefix_hit_ratio`` (and the two counters under it)
* allocation failure rate  ``rate(kvtier_allocation_failures_total[5m])``
* fetch latency      ``kvtier_op_duration_seconds{op="get"}``, and with ``--upstream``
  ``kvtier_upstream_fetch_duration_seconds`` (:mod:`.upstream_metrics`, with the prefix
  hit ratio per tier, local vs upstream)
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.daemon.admin.kv_events_metrics import kv_events_families
from kvtier.daemon.admin.nixl_metrics import nixl_families
from kvtier.daemon.admin.preplace_metrics import preplace_families
from kvtier.daemon.admin.view import AdminStateView
from kvtier.daemon.admin.stats import derived_figures, ratio
from kvtier.daemon.admin.upstream_metrics import upstream_families

WARM_TIER = "warm"  # the daemon's own flash; the hot tier lives in the client, cold upstream

# (engine statistics field, metric name, help) — counters since start
_ENGINE_COUNTERS = (
    ("puts", "kvtier_puts", "Blocks stored (PUTs accepted by the engine)."),
    ("evicted_blocks", "kvtier_evicted_blocks", "Blocks dropped by region eviction."),
    ("evicted_regions", "kvtier_evicted_regions", "Regions reclaimed by eviction."),
    ("reinsertions", "kvtier_reinsertions", "Hot or pinned blocks reinserted when their region was reclaimed."),
    ("alloc_failures", "kvtier_allocation_failures", "PUTs refused for lack of a reclaimable region."),
    ("device_errors", "kvtier_device_errors", "Device read/write/sync failures."),
    ("corrupt_reads", "kvtier_corrupt_reads", "Reads whose header or CRC did not verify (served as misses)."),
    ("pins_refused", "kvtier_pins_refused", "PINs refused at the pinned-bytes limit (pinned_fraction_max)."),
    ("puts_skipped_deleted", "kvtier_puts_skipped_deleted",
     "Blocks of copies (read-repair, re-replication) not stored: deleted here lately."),
    ("soft_pins_expired", "kvtier_soft_pins_expired", "Soft pins (PIN with a TTL) that ran out."),
    ("clean_region_waits", "kvtier_clean_region_waits", "Writers that found the clean-region pool empty and waited."),
    ("clean_region_wait_seconds", "kvtier_clean_region_wait_seconds", "Seconds writers waited for a clean region."),
    ("reclaims", "kvtier_reclaims", "Regions the background reclaim worker returned to the clean pool."),
    ("reclaim_errors", "kvtier_reclaim_errors", "Reclaims given up on a device error (region back in the policy, or retired)."),
    ("regions_retired", "kvtier_regions_retired", "Regions never reused until a restart after device errors in their reclaim."),
    ("rescues", "kvtier_rescues", "In-place compactions at open of a store left with no clean region (rescue journal)."),
    ("group_commits", "kvtier_group_commits", "Durability commits (one write pass and fdatasync for every caller waiting)."),
    ("durable_commit_waiters", "kvtier_durable_commit_waiters", "Durable puts, flushes and reclaims acknowledged by a commit."),
)
# (engine statistics field, metric name, help) — current values
_ENGINE_GAUGES = (
    ("blocks", "kvtier_index_entries", "Blocks in the in-memory index."),
    ("bytes_stored", "kvtier_stored_bytes", "Bytes of blocks (header + payload) in the index."),
    ("regions_total", "kvtier_regions", "Regions in the store."),
    ("regions_free", "kvtier_regions_free", "Clean regions ready for writing."),
    ("clean_regions_target", "kvtier_clean_regions_target", "Clean regions the reclaim worker keeps ready."),
    ("regions_sealed", "kvtier_regions_sealed", "Sealed (immutable, readable) regions."),
    ("index_bytes", "kvtier_index_bytes", "Memory the in-memory index uses."),
    ("pinned_bytes", "kvtier_pinned_bytes", "Bytes of pinned blocks, hard and soft pins."),
    ("soft_pinned_bytes", "kvtier_soft_pinned_bytes", "Bytes of blocks held by soft pins (PIN with a TTL)."),
    ("pinned_bytes_max", "kvtier_pinned_bytes_max", "The pinned-bytes limit: pinned_fraction_max of the capacity."),
    ("pinned_cost_bytes", "kvtier_pinned_cost_bytes",
     "What pins cost the cache, checked against the limit: their bytes, or the whole room of a region pinned past half."),
    ("recovered_blocks", "kvtier_recovered_blocks", "Blocks the last start recovered from region summaries."),
    ("recovery_seconds", "kvtier_recovery_duration_seconds", "Time the last start spent rebuilding the index."),
)


class KvtierCollector(Collector):
    """Reads the daemon's statistics snapshots on every scrape."""

    def __init__(self, view: AdminStateView) -> None:
        self._view = view

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on the live server statistics; collected at scrape time only

    def collect(self) -> Iterable[Metric]:
        engine = self._view.engine_statistics()
        server = self._view.server_statistics()
        yield from self._process(engine)
        yield from self._engine(engine)
        yield from self._tiers(engine, server)
        yield from self._server(server)
        yield from _cluster_families(self._view.cluster_statistics())
        yield from preplace_families(self._view.preplace_statistics())
        yield from upstream_families(self._view.upstream_statistics())
        yield from kv_events_families(self._view.kv_events_statistics())
        yield from nixl_families(self._view.nixl_statistics())

    def _process(self, engine: dict) -> Iterable[Metric]:
        yield GaugeMetricFamily("kvtier_ready", "1 once devices are open and the index is recovered.",
                                value=1.0 if self._view.ready() else 0.0)
        yield GaugeMetricFamily("kvtier_start_time_seconds", "Start time of kvtierd since the Unix epoch.",
                                value=self._view.start_time_unix_s())
        yield CounterMetricFamily("kvtier_admin_internal_errors",
                                  "Admin requests that failed on an unexpected exception (500; the daemon serves on).",
                                  value=self._view.internal_errors)

    def _engine(self, engine: dict) -> Iterable[Metric]:
        for field_name, name, help_text in _ENGINE_COUNTERS:
            if field_name in engine:
                yield CounterMetricFamily(name, help_text, value=engine[field_name])
        for field_name, name, help_text in _ENGINE_GAUGES:
            if field_name in engine:
                yield GaugeMetricFamily(name, help_text, value=engine[field_name])

    def _tiers(self, engine: dict, server: dict) -> Iterable[Metric]:
        d = derived_figures(engine, server)
        hits = CounterMetricFamily("kvtier_hits", "Block reads that found the block, per tier.", labels=["tier"])
        hits.add_metric([WARM_TIER], d.warm_hits)
        misses = CounterMetricFamily("kvtier_misses", "Block reads that did not, per tier.", labels=["tier"])
        misses.add_metric([WARM_TIER], d.warm_misses)
        read = CounterMetricFamily("kvtier_read_bytes", "Block bytes read, per tier.", labels=["tier"])
        read.add_metric([WARM_TIER], d.warm_read_bytes)
        written = CounterMetricFamily("kvtier_written_bytes", "Block bytes written, per tier.", labels=["tier"])
        written.add_metric([WARM_TIER], d.warm_written_bytes)
        yield from (hits, misses, read, written)

        ns_hits = CounterMetricFamily("kvtier_namespace_hits", "Block reads that hit, per tier and namespace id.",
                                      labels=["tier", "namespace"])
        ns_misses = CounterMetricFamily("kvtier_namespace_misses", "Block reads that missed, per tier and namespace id.",
                                        labels=["tier", "namespace"])
        for ns, figures in sorted(d.namespaces.items()):
            ns_hits.add_metric([WARM_TIER, ns], figures.hits)
            ns_misses.add_metric([WARM_TIER, ns], figures.misses)
        yield from (ns_hits, ns_misses)

        yield CounterMetricFamily("kvtier_lookup_keys", "Keys asked in LOOKUP chains.", value=d.lookup_keys_asked)
        yield CounterMetricFamily("kvtier_lookup_hit_keys", "Leading keys LOOKUP found present.",
                                  value=d.lookup_keys_hit)
        prefix_ratio = ratio(d.lookup_keys_hit, d.lookup_keys_asked)
        yield GaugeMetricFamily("kvtier_lookup_prefix_hit_ratio",
                                "Leading keys found over keys asked by LOOKUP since start (NaN before any).",
                                value=float("nan") if prefix_ratio is None else prefix_ratio)

    def _server(self, server: dict) -> Iterable[Metric]:
        if not server:
            return
        yield from _server_families(server)


def _server_families(server: dict) -> Iterable[Metric]:
    """Data-server figures: connections, per-op counts and latency histograms, wire bytes."""
    yield GaugeMetricFamily("kvtier_open_connections", "Open data-port connections.",
                            value=server.get("open_connections", 0))
    yield CounterMetricFamily("kvtier_connections", "Data-port connections accepted since start.",
                              value=server.get("total_connections", 0))
    yield CounterMetricFamily("kvtier_rejected_connections",
                              "Data-port connections refused (over max_connections or max_connections_per_peer).",
                              value=server.get("rejected_connections", 0))
    yield CounterMetricFamily("kvtier_evicted_connections",
                              "Data-port connections closed to admit a newcomer while every slot was taken "
                              "(the one longest without a request other than PING).",
                              value=server.get("evicted_connections", 0))
    yield CounterMetricFamily("kvtier_idle_closed_connections",
                              "Authenticated data-port connections closed after idle_timeout between requests.",
                              value=server.get("idle_closed_connections", 0))
    yield CounterMetricFamily("kvtier_network_received_bytes", "Bytes received on the data port.",
                              value=server.get("bytes_in", 0))
    yield CounterMetricFamily("kvtier_network_sent_bytes", "Bytes sent on the data port.",
                              value=server.get("bytes_out", 0))
    yield CounterMetricFamily("kvtier_cluster_repair_received_bytes",
                              "Bytes PUT here by kvtier cluster repair (re-replication after a join or a lost copy).",
                              value=server.get("repair_bytes_in", 0))
    yield from _buffer_families(server.get("buffers") or {})
    requests = CounterMetricFamily("kvtier_requests", "Data-port requests served, per op.", labels=["op"])
    for op, count in sorted((server.get("requests") or {}).items()):
        requests.add_metric([op], count)
    yield requests
    errors = CounterMetricFamily("kvtier_request_errors", "Data-port error replies, per error code.",
                                 labels=["code"])
    for code, count in sorted((server.get("errors") or {}).items()):
        errors.add_metric([code], count)
    yield errors
    latency = HistogramMetricFamily("kvtier_op_duration_seconds", "Data-port request latency, per op.",
                                    labels=["op"])
    for op, hist in sorted((server.get("latency") or {}).items()):
        bounds = list(hist["bounds_s"])
        cumulative = list(hist["cumulative_counts"])
        assert len(cumulative) == len(bounds) + 1, f"histogram of {op}: {len(cumulative)} counts, {len(bounds)} bounds"
        buckets = [(_le(b), c) for b, c in zip(bounds, cumulative)] + [("+Inf", cumulative[-1])]
        latency.add_metric([op], buckets, sum_value=hist["sum_s"])
    yield latency


# (membership statistics field, metric name, family, help) — with --cluster only
_CLUSTER_FIGURES = (
    ("members_seen", "kvtier_cluster_members_seen", GaugeMetricFamily,
     "Members under the cluster prefix in etcd at the last keepalive (-1 before one)."),
    ("lease_ttl_s", "kvtier_cluster_lease_ttl_seconds", GaugeMetricFamily, "TTL of this node's etcd lease."),
    ("registrations", "kvtier_cluster_registrations", CounterMetricFamily,
     "Leases granted and member records put, the first included."),
    ("re_registrations", "kvtier_cluster_re_registrations", CounterMetricFamily,
     "Registrations after the first: the lease had expired (etcd away longer than its TTL)."),
    ("keepalives", "kvtier_cluster_keepalives", CounterMetricFamily, "Lease keepalives etcd answered."),
    ("etcd_errors", "kvtier_cluster_etcd_errors", CounterMetricFamily,
     "etcd requests no endpoint answered (the node serves on meanwhile)."),
)


def _cluster_families(cluster: dict) -> Iterable[Metric]:
    """This node's cluster membership: registered or not, members seen, etcd errors."""
    if not cluster:
        return
    member = GaugeMetricFamily("kvtier_cluster_registered", "1 while this node's member key is live in etcd.",
                               labels=["node_id", "state"])
    member.add_metric([cluster["node_id"], cluster["state"]], 1.0 if cluster["state"] == "registered" else 0.0)
    yield member
    for field, name, family, help_text in _CLUSTER_FIGURES:
        yield family(name, help_text, value=cluster[field])


# (request-buffer statistics field, metric name, family, help)
_BUFFER_FIGURES = (
    ("created", "kvtier_request_arenas", GaugeMetricFamily, "Request arenas allocated (kept for reuse)."),
    ("lent", "kvtier_request_arenas_lent", GaugeMetricFamily, "Request arenas lent to a request right now."),
    ("refused", "kvtier_request_arenas_refused", CounterMetricFamily, "Requests that found every arena lent out."),
    ("transient_bytes", "kvtier_transient_buffer_bytes", GaugeMetricFamily,
     "Request buffers outside the arenas right now."),
    ("transient_budget_bytes", "kvtier_transient_buffer_budget_bytes", GaugeMetricFamily,
     "Budget for request buffers outside the arenas."),
    ("transient_waits", "kvtier_transient_buffer_waits", CounterMetricFamily,
     "Requests that found the transient budget spent and waited for room."),
    ("transient_refused", "kvtier_transient_buffer_refused", CounterMetricFamily,
     "Requests refused BUSY: the transient budget stayed spent while they waited."),
)


def _buffer_families(buffers: dict) -> Iterable[Metric]:
    """The data server's request buffers: arenas lent per request, and transient buffers."""
    for field, name, family, help_text in _BUFFER_FIGURES if buffers else ():
        yield family(name, help_text, value=buffers[field])


def _le(bound_s: float) -> str:
    """A bucket's upper bound as Prometheus writes it."""
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound_s)
