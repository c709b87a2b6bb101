"""Real SGLang 0.5.23 objects on CPU for the storage backend tests (our own helpers).

A device KV pool and a host pool built the way SGLang's HiCache builds them
(``MHATokenToKVPool`` -> its buffer info -> ``MHATokenToKVPoolHost``), the
storage config the cache controller generates, the backend made by the real
``StorageBackendFactory`` ``dynamic`` path, and page keys from SGLang's own
hash function. Nothing here stands in for an SGLang class.
"""
from __future__ import annotations

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

PAGE_SIZE = 4
NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = 8
DTYPE = torch.float16
DEVICE_TOKENS = 256
MODEL = "tiny-llama-test"


def make_host_pool(layout: str = "layer_first") -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(DEVICE_TOKENS, PAGE_SIZE, DTYPE, NUM_HEADS, HEAD_DIM, NUM_LAYERS, "cpu", False,
                              start_layer=0, end_layer=NUM_LAYERS)
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE_SIZE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer)


def make_storage_config(address: str, tp_rank: int = 0, tp_size: int = 1, interface_v1: bool = True,
                        model: str = MODEL, **extra) -> HiCacheStorageConfig:
    extra_config = {"backend_name": "kvtier", "module_path": "kvtier.client.engines.sglang",
                    "class_name": "KVTierHiCacheStorage", "interface_v1": int(interface_v1),
                    "address": address, **extra}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=True,
                                is_page_first_layout=False, model_name=model, extra_config=extra_config)


def attach_backend(config: HiCacheStorageConfig, host_pool):
    """What HiCacheController.attach_storage_backend does: the factory, then the pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config, host_pool)
    backend.register_mem_pool_host(host_pool)
    return backend


def page_keys(tokens: list[int]) -> list[str]:
    """SGLang's chained page hashes of ``tokens`` (whole pages)."""
    return get_hash_str(tokens, None, page_size=PAGE_SIZE)


def fill_pages(pool, host_indices: torch.Tensor, seed: int) -> None:
    """Random KV into the pool's pages at ``host_indices`` (what a device->host backup leaves)."""
    gen = torch.Generator().manual_seed(seed)
    for start in host_indices[::PAGE_SIZE].tolist():
        page = pool.get_data_page(start, flat=False)
        page.copy_(torch.randn(page.shape, generator=gen).to(DTYPE))


def page_kv(pool, start: int) -> torch.Tensor:
    """One page as K and V ``[2, layers, page, heads, dim]``, whatever the pool's layout."""
    page = pool.get_data_page(start, flat=False)
    if pool.layout == "layer_first":
        return page.clone()
    if pool.layout == "page_first":
        return page.permute(0, 2, 1, 3, 4).clone()
    if pool.layout == "page_first_direct":
        return page[:, 0].clone()
    if pool.layout == "page_head":
        return page[:, 0].permute(0, 3, 2, 1, 4).clone()
    raise ValueError(pool.layout)
