"""Prometheus families of the KV-events publisher (``--kv-events-endpoint``), read from one
``KVEvents.statistics()`` snapshot per scrape; nothing is counted here."""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# (statistics field, metric name, family, help)
_FAMILIES = (
    ("batches_published", "kvtier_kv_events_batches_published", CounterMetricFamily,
     "KV-event batches sent on the PUB socket."),
    ("batches_dropped", "kvtier_kv_events_batches_dropped", CounterMetricFamily,
     "KV-event batches dropped because the publisher's queue was full (subscribers resynchronize)."),
    ("bytes_published", "kvtier_kv_events_published_bytes", CounterMetricFamily, "Payload bytes of the batches sent."),
    ("replay_requests", "kvtier_kv_events_replay_requests", CounterMetricFamily, "Replay requests answered."),
    ("queue_batches", "kvtier_kv_events_queue_batches", GaugeMetricFamily,
     "KV-event batches waiting for the publisher thread."),
    ("seq_last", "kvtier_kv_events_last_seq", GaugeMetricFamily, "Sequence number of the newest batch."),
)


def kv_events_families(stats: dict) -> Iterable[Metric]:
    if not stats:
        return
    for field, name, family, help_text in _FAMILIES:
        yield family(name, help_text, value=stats[field])
    events = CounterMetricFamily("kvtier_kv_events", "KV events published, by type.", labels=["type"])
    for label, field in (("BlockStored", "events_stored"), ("BlockRemoved", "events_removed"),
                         ("AllBlocksCleared", "events_cleared")):
        events.add_metric([label], stats[field])
    yield events
