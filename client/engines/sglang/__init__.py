"""kvtier as an SGLang 0.5.23 HiCache storage backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvtier", "module_path": "kvtier.client.engines.sglang",
        "class_name": "KVTierHiCacheStorage", "interface_v1": 1, ...}'

    hicache_storage.py  KVTierHiCacheStorage: SGLang's HiCacheStorage (imports SGLang)
    host_pages.py       host-pool pages <-> kvtier blocks (torch only)

SGLang resolves the class with ``getattr`` on this package; the backend is
imported on that first access, so host_pages imports without SGLang.
"""
from __future__ import annotations

__all__ = ["KVTierHiCacheStorage"]


def __getattr__(name: str):
    if name == "KVTierHiCacheStorage":
        from .hicache_storage import KVTierHiCacheStorage

        return KVTierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
