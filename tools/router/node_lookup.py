"""LOOKUPs on the nodes (for accuracy probes): one BlockClient per node with a data address."""
from __future__ import annotations

import threading
from typing import Sequence

from kvtier.client import BlockClient, ClientError

from .node_sources import NodeSpec

LOOKUP_TIMEOUT_S = 2.0  # a probe of a node that does not answer gives up this soon


class NodeLookups:
    errors = (OSError, ClientError)  # what a lookup raises when the node cannot answer

    def __init__(self, nodes: Sequence[NodeSpec], token: str | None):
        self._addresses = {n.node_id: n.data for n in nodes}
        self._token = token
        self._clients: dict[str, BlockClient] = {}
        self._lock = threading.Lock()

    def lookup(self, node: str, keys: list[bytes]) -> int:
        address = self._addresses.get(node)
        if address is None:
            raise OSError(f"node {node} has no data address (give data=HOST:PORT)")
        with self._lock:
            client = self._clients.get(node)
            if client is None:
                client = self._clients[node] = BlockClient(address, token=self._token, pool_size=1,
                                                           timeout_s=LOOKUP_TIMEOUT_S, client_name="kvtier-router")
        return client.lookup(keys)

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
