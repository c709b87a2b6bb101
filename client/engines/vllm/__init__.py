"""kvtier as a vLLM 0.33 KV connector::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.client.engines.vllm", ...}'

    connector.py        KVTierConnector: the scheduler and worker hooks (imports vLLM)
    settings.py         kv_connector_extra_config, validated
    scheduler_plan.py   per-request block bookkeeping and the BlockOps sent to workers
    paged_views.py      vLLM's per-layer KV tensors as views for kvtier.kernels.paged

vLLM resolves the class with ``getattr`` on this package; the connector is
imported on that first access, so the other modules import without vLLM.
"""
from __future__ import annotations

__all__ = ["KVTierConnector", "KVTierConnectorMetadata", "KVTierSettings"]


def __getattr__(name: str):
    if name in ("KVTierConnector", "KVTierConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    if name == "KVTierSettings":
        from .settings import KVTierSettings

        return KVTierSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
