"""kvtier's client library: block keys and format, the data protocol, and the
block clients of kvtierd.

    from kvtier.client import BlockClient, AsyncBlockClient, ClientError, RemoteError, BlockLocationInfo

Names are imported on first use, so ``import kvtier.common.blockformat`` (as
the daemon does) pulls in nothing else.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "BlockClient": "kvtier.client.block_client",
    "BlockLocationInfo": "kvtier.client.block_client",
    "ClientStatistics": "kvtier.client.block_client",
    "AsyncBlockClient": "kvtier.client.async_block_client",
    "EdgePicker": "kvtier.client.edge_picker",
    "ClientError": "kvtier.wire.events",
    "RemoteError": "kvtier.wire.events",
    "ProtocolError": "kvtier.wire.events",
    "ConnectionLost": "kvtier.wire.events",
    "ErrorCode": "kvtier.wire.events",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
