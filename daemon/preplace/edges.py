"""Which edges a region pushes to: a fixed address list, or the members of the edges' etcd cluster.

An edge is named by its address for a fixed list, by its node id for a cluster (its
address is accepted too). :class:`ClusterEdges` reads the member records under the
cluster's prefix (``daemon/cluster``'s etcd session) at most every EDGES_REFRESH_S; when
etcd does not answer, the last list read stays in use and the failure is counted.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvtier.common.cluster_url import ClusterUrl, ClusterUrlError, MemberRecord
from kvtier.daemon.preplace.settings import PreplaceConfigError, PreplaceSettings

log = logging.getLogger("kvtier.daemon.preplace")

EDGES_REFRESH_S = 5.0  # members change on lease expiry (seconds); one range read per this at most
ETCD_TIMEOUT_S = 2.0  # one etcd range request; a push round does not wait longer for the list


@dataclass(frozen=True)
class Edge:
    name: str  # node id (cluster) or HOST:PORT (fixed list)
    address: str  # the data port, HOST:PORT


class UnknownEdge(ValueError):
    """An edge name that is not among the configured edges; the message lists them."""


def choose(edges: tuple[Edge, ...], wanted) -> tuple[Edge, ...]:
    """``"all"`` or a list of names/addresses -> the edges, in the configured order."""
    if wanted == "all":
        return edges
    by_name = {e.name: e for e in edges} | {e.address: e for e in edges}
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        known = ", ".join(e.name for e in edges) or "none"
        raise UnknownEdge(f"unknown edge {', '.join(map(repr, unknown))}; the edges are: {known}")
    picked = {by_name[w].name for w in wanted}
    return tuple(e for e in edges if e.name in picked)


class FixedEdges:
    def __init__(self, addresses: tuple[str, ...]):
        self._edges = tuple(Edge(a, a) for a in addresses)
        self.lookup_failures = 0

    def current(self) -> tuple[Edge, ...]:
        return self._edges


class ClusterEdges:
    """The live members of the edges' cluster (sorted by node id), refreshed at most every EDGES_REFRESH_S."""

    def __init__(self, url: ClusterUrl, clock: Callable[[], float] = time.monotonic):
        from kvtier.daemon.cluster.etcd_session import EtcdSession, EtcdUnavailable

        self._url = url
        try:
            self._session = EtcdSession(url, ETCD_TIMEOUT_S)
        except EtcdUnavailable as exc:  # etcd3gw is missing
            raise PreplaceConfigError(f"preplace_edges: {exc}") from None
        self._clock = clock
        self._lock = threading.Lock()
        self._edges: tuple[Edge, ...] = ()
        self._read_at: float | None = None
        self.lookup_failures = 0

    def current(self) -> tuple[Edge, ...]:
        from kvtier.daemon.cluster.etcd_session import EtcdUnavailable

        with self._lock:
            now = self._clock()
            if self._read_at is not None and now - self._read_at < EDGES_REFRESH_S:
                return self._edges
            try:
                rows = self._session.list_prefix(self._url.members_prefix)
            except EtcdUnavailable as exc:
                self.lookup_failures += 1
                log.warning("event=preplace_edges_unavailable error=%s (keeping %d edges)", exc, len(self._edges))
                return self._edges
            edges = []
            for key, raw in rows:
                try:
                    record = MemberRecord.decode(raw)
                except ClusterUrlError as exc:
                    log.warning("event=preplace_edge_record_bad key=%s error=%s", key, exc)
                    continue
                edges.append(Edge(record.node_id, record.data))
            self._edges, self._read_at = tuple(sorted(edges, key=lambda e: e.name)), now
            return self._edges


def edge_directory(settings: PreplaceSettings):
    url = settings.cluster_url
    return FixedEdges(settings.static_edges) if url is None else ClusterEdges(url)
