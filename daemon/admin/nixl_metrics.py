"""Prometheus families of the NIXL data plane (``--nixl``), read from one
``NixlService.statistics()`` snapshot per scrape; nothing is counted here. Empty until a client
made the daemon create its agent.

* transfers     ``kvtier_nixl_transfers_total{op="write"|"read"}`` (NIXL_GET WRITEs, NIXL_PUT READs)
  and ``kvtier_nixl_transferred_bytes_total{op}``
* failures      ``kvtier_nixl_failures_total``, ``kvtier_nixl_timeouts_total`` (TRANSFER_TIMEOUT_S)
* NIXL_PUT      ``kvtier_nixl_put_blocks_total``
* trust         ``kvtier_nixl_refused_untrusted_total`` (clients ``nixl_trusted`` does not name)
* the agent     ``kvtier_nixl_peers``, ``kvtier_nixl_registered_bytes`` (the transfers in flight),
  ``kvtier_nixl_info{transport,ucx_tls}``
* late transfers ``kvtier_nixl_gets_peer_gone_total``, ``kvtier_nixl_writes_parked_total``,
  ``kvtier_nixl_reads_parked_total``, ``kvtier_nixl_parked_transfers``, ``kvtier_nixl_parked_bytes``,
  ``kvtier_nixl_refused_parked_total`` (PARKED_BYTES_PER_PEER_MAX)
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# (statistics field, metric name, family, help)
_SINGLE = (
    ("failures", "kvtier_nixl_failures", CounterMetricFamily, "NIXL transfers that failed to post or to complete."),
    ("timeouts", "kvtier_nixl_timeouts", CounterMetricFamily,
     "NIXL transfers abandoned after TRANSFER_TIMEOUT_S (a stopped or dead client)."),
    ("peers", "kvtier_nixl_peers", GaugeMetricFamily, "Client agents loaded now."),
    ("registered_bytes", "kvtier_nixl_registered_bytes", GaugeMetricFamily,
     "Daemon memory registered with NIXL now: the buffers of the transfers in flight (or parked)."),
    ("refused_untrusted", "kvtier_nixl_refused_untrusted", CounterMetricFamily,
     "NIXL requests refused: their client is not one nixl_trusted names (served over TCP)."),
    ("gets_peer_gone", "kvtier_nixl_gets_peer_gone", CounterMetricFamily,
     "NIXL_GETs ended unanswered, nothing more posted: their client had shut down its side."),
    ("writes_parked", "kvtier_nixl_writes_parked", CounterMetricFamily,
     "WRITEs given up on while in flight, held (not released) until NIXL ended them."),
    ("reads_parked", "kvtier_nixl_reads_parked", CounterMetricFamily,
     "NIXL_PUT READs given up on while in flight, held (with the memory they write) until NIXL ended them."),
    ("parked_now", "kvtier_nixl_parked_transfers", GaugeMetricFamily,
     "Parked WRITEs and READs NIXL has not ended yet."),
    ("parked_bytes", "kvtier_nixl_parked_bytes", GaugeMetricFamily,
     "Daemon memory parked transfers hold out of use now (request buffers)."),
    ("refused_parked", "kvtier_nixl_refused_parked", CounterMetricFamily,
     "NIXL requests refused BUSY: their client's parked transfers held PARKED_BYTES_PER_PEER_MAX."),
)


def nixl_families(stats: dict) -> Iterable[Metric]:
    if not stats:
        return
    info = GaugeMetricFamily("kvtier_nixl_info", "The NIXL agent's UCX transport (1).",
                             labels=["transport", "ucx_tls"])
    info.add_metric([stats["transport"], stats["ucx_tls"]], 1.0)
    yield info
    transfers = CounterMetricFamily("kvtier_nixl_transfers", "NIXL transfers done, by operation.", labels=["op"])
    moved = CounterMetricFamily("kvtier_nixl_transferred_bytes", "Bytes NIXL transfers moved, by operation.",
                                labels=["op"])
    for op, count, nbytes in (("write", "writes", "bytes_written"), ("read", "reads", "bytes_read")):
        transfers.add_metric([op], stats[count])
        moved.add_metric([op], stats[nbytes])
    yield from (transfers, moved)
    for field, name, family, help_text in _SINGLE:
        yield family(name, help_text, value=stats[field])
    if "put_blocks" in stats:
        yield CounterMetricFamily("kvtier_nixl_put_blocks", "NIXL_PUT blocks stored.", value=stats["put_blocks"])
