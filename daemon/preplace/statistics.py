"""Counters of pre-placement, recorded under one lock, read as a frozen snapshot
(``PrePlacer.statistics()``, the /v1/stats ``preplace`` section, the ``kvtier_preplace_*`` metrics)."""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class EdgeFigures:
    address: str
    pushes: int  # pushes the edge took (periodic rounds and /v1/preplace)
    failures: int  # pushes that failed (down, wrong token, no soft pins, an error reply)
    preplaced_blocks: int  # blocks PUT to it since start
    preplaced_bytes: int
    pinned_blocks: int  # soft pins it confirmed since start (renewals included)
    soft_pinned_blocks: int  # the region's view of what is soft-pinned there now
    soft_pinned_bytes: int
    last_error: str | None


@dataclass(frozen=True)
class PreplaceStatistics:
    rounds: int  # periodic push rounds done
    admin_requests: int  # /v1/preplace calls served
    heads_tracked: int
    keys_tracked: int
    observations: int  # LOOKUP/GET chains counted
    observations_dropped: int  # chains not counted: the queue between the data server and the pusher was full
    heads_evicted: int
    edges: Mapping[str, EdgeFigures]  # edge name -> figures

    def as_dict(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "edges"}
        doc["edges"] = {name: asdict(figures) for name, figures in self.edges.items()}
        return doc


class PreplaceRecorder:
    def __init__(self):
        self._lock = threading.Lock()
        self._rounds = self._admin = 0
        self._edges: dict[str, dict] = {}

    def _edge(self, name: str, address: str) -> dict:
        figures = self._edges.get(name)
        if figures is None:
            figures = self._edges[name] = {"address": address, "pushes": 0, "failures": 0, "preplaced_blocks": 0,
                                           "preplaced_bytes": 0, "pinned_blocks": 0, "last_error": None}
        return figures

    def round_done(self) -> None:
        with self._lock:
            self._rounds += 1

    def admin_request(self) -> None:
        with self._lock:
            self._admin += 1

    def pushed(self, name: str, address: str, blocks: int, nbytes: int, pinned: int) -> None:
        with self._lock:
            f = self._edge(name, address)
            f["pushes"] += 1
            f["preplaced_blocks"] += blocks
            f["preplaced_bytes"] += nbytes
            f["pinned_blocks"] += pinned

    def failed(self, name: str, address: str, error: str, blocks: int = 0, nbytes: int = 0) -> None:
        """A push that failed part way: ``blocks``/``nbytes`` reached the edge before it did."""
        with self._lock:
            f = self._edge(name, address)
            f["failures"] += 1
            f["preplaced_blocks"] += blocks
            f["preplaced_bytes"] += nbytes
            f["last_error"] = error

    def snapshot(self, popularity, observed: int, dropped: int, soft_pinned: Mapping[str, tuple[int, int]]
                 ) -> PreplaceStatistics:
        with self._lock:
            edges = {name: EdgeFigures(**f, soft_pinned_blocks=soft_pinned.get(name, (0, 0))[0],
                                       soft_pinned_bytes=soft_pinned.get(name, (0, 0))[1])
                     for name, f in sorted(self._edges.items())}
            return PreplaceStatistics(rounds=self._rounds, admin_requests=self._admin,
                                      heads_tracked=popularity.heads_tracked, keys_tracked=popularity.keys_tracked,
                                      observations=observed, observations_dropped=dropped,
                                      heads_evicted=popularity.heads_evicted, edges=MappingProxyType(edges))
