"""The router: answers which node holds the longest stored prefix of a chain, from the
routing table, and keeps the figures (routes, hits, accuracy).

Among the nodes that hold the longest prefix it chooses one by rendezvous hashing of the
chain's first key over their ids (the same prefix keeps going to the same node while that
set holds), so a prefix's load is not all on the lowest id.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from kvtier.client.routing import Rendezvous

from .accuracy import AccuracyProbe
from .node_sources import NodeSpec
from .routing_table import RoutingTable


@dataclass(frozen=True)
class RouteAnswer:
    node: str | None  # the chosen node; None when no up node holds the first block
    data: str | None  # its data address (HOST:PORT), when known
    nodes: tuple[str, ...]  # every node holding the longest prefix
    prefix_blocks: int
    blocks: int  # keys in the request

    def as_dict(self, specs: dict[str, NodeSpec]) -> dict:
        return {"node": self.node, "data": self.data, "prefix_blocks": self.prefix_blocks, "blocks": self.blocks,
                "nodes": [{"node": n, "data": specs[n].data if n in specs else None} for n in self.nodes]}


class Router:
    def __init__(self, table: RoutingTable, nodes: Sequence[NodeSpec], probe: AccuracyProbe | None = None):
        self.table = table
        self.nodes = {n.node_id: n for n in nodes}
        self.probe = probe
        self._lock = threading.Lock()
        self._routes = self._routed_to_holder = self._blocks_asked = self._blocks_held = 0

    def route(self, keys: list[bytes]) -> RouteAnswer:
        answer = self.table.longest_prefix(keys)
        chosen = None
        if answer.nodes:
            chosen = answer.nodes[int(Rendezvous(answer.nodes).owners([keys[0]])[0])]
        spec = self.nodes.get(chosen) if chosen is not None else None
        with self._lock:
            self._routes += 1
            self._routed_to_holder += chosen is not None
            self._blocks_asked += len(keys)
            self._blocks_held += answer.prefix_blocks
        if self.probe is not None and keys:
            self.probe.offer(keys, chosen)
        return RouteAnswer(chosen, None if spec is None else spec.data, answer.nodes, answer.prefix_blocks, len(keys))

    def statistics(self) -> dict:
        with self._lock:
            doc = {"routes": self._routes, "routes_to_a_holder": self._routed_to_holder,
                   "blocks_asked": self._blocks_asked, "prefix_blocks_answered": self._blocks_held}
        doc["accuracy"] = None if self.probe is None else self.probe.statistics().as_dict()
        doc["table"] = self.table.statistics().as_dict()
        return doc
