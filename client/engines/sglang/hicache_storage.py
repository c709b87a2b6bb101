"""kvtier as an SGLang 0.5.23 HiCache storage backend (``HiCacheStorage``, the L3 tier).

Load it with SGLang's ``dynamic`` backend::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtier", "module_path": "kvtier.client.engines.sglang",
        "class_name": "KVTierHiCacheStorage", "interface_v1": 1, "address": "127.0.0.1:7410"}'

(all settings: ``docs/sglang.md``). SGLang's ``StorageBackendFactory`` builds
it as ``cls(storage_config, {})``; every setting comes from
``storage_config.extra_config``. The cache controller then registers its host
pool (``register_mem_pool_host``), and from then on moves pages::

    HiCache host pool (MHATokenToKVPoolHost)      kvtierd
      batch_exists(page keys)   ---- one LOOKUP -->  leading pages present
      batch_get_v1(keys, host_indices)  <-- GET ---  verified blocks, each copied straight
                                                     into its page of the pool (a view)
      batch_set_v1(keys, host_indices)  --- PUT -->  write-behind: the pages copied straight
                                                     into send buffers and queued; the PUT
                                                     runs on a background worker

Saves never wait for the daemon (``batch_set``, ``set`` and ``batch_set_v1``
alike): the pages are copied out before the call returns, so SGLang may free
or reuse them at once. A full save queue (``save_queue_bytes``) drops the
batch, which then reports ``False`` (SGLang logs the failed backup; the pages
are a later miss); failures of queued PUTs are counted in
``statistics()``. SGLang backs up whole prefixes again: pages this backend
queued recently are skipped without a round trip (``recent_saves.py``).
``close()`` drains the queue.

One page is one kvtier block, ``[layers, 2, kv_heads, page_size, head_dim]``,
whatever the host pool's layout. SGLang's page keys (hash strings chained
over the prefix) become 16-byte keys by BLAKE2b-128 keyed by the namespace
id. Two namespaces: the deployment's (model, layout, codec, operator tenant)
is the id the daemon sees in block headers and frames, so per-tenant
statistics and ``delete_namespace`` work per deployment tenant; the keys are
keyed by that plus this rank's shard (TP and PP rank and size), so ranks
never read each other's heads. (SGLang folds a request's cache salt and LoRA
into its page hashes, which the daemon cannot tell apart.) A page that is
missing or fails validation reads as ``False`` (SGLang stops its prefetch
there and recomputes the rest); its host slots are not written.

MLA host pools (one latent vector per token, no separate V) are not
supported yet: registering one raises ValueError.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvtier.client import ClientError
from kvtier.client.engines.namespaces import key_namespace, page_key
from kvtier.client.engines.sglang.host_pages import HostPages
from kvtier.client.engines.sglang.recent_saves import RecentSaves
from kvtier.common.keys import KVLayout, Namespace
from kvtier.common.tokens import read_token_file
from kvtier.client.kvcache import KVCache
from kvtier.client.save_queue import SAVE_QUEUE_BYTES_MAX

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:7410"
DEFAULT_HOT_POOL_BYTES = 0  # SGLang's host pool is the hot tier
IO_ERRORS = (ClientError, OSError)  # the daemon unreachable or refusing: a miss, never a crash
EXTRA_CONFIG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",  # read by SGLang
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
    "address", "token", "token_file", "codec", "tenant", "model_id", "hot_pool_bytes", "transport", "device_map",
    "save_queue_bytes",
})


class KVTierHiCacheStorage(HiCacheStorage):
    """See the module doc."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        unknown = set(extra) - EXTRA_CONFIG_KEYS
        if unknown:  # SGLang shares this dict with its own settings: a typo is only warned about
            logger.warning("kvtier ignores extra-config keys %s (its own are %s)", sorted(unknown),
                           sorted(EXTRA_CONFIG_KEYS))
        address = extra.get("address", DEFAULT_ADDRESS)
        self.addresses = [address] if isinstance(address, str) else list(address)
        self.token = extra.get("token")
        if self.token is None and extra.get("token_file"):
            self.token = read_token_file(extra["token_file"])
        self.codec = str(extra.get("codec", "raw"))
        self.tenant = str(extra.get("tenant", ""))
        self.model = str(extra.get("model_id") or storage_config.model_name or "")
        if not self.model:
            raise ValueError("kvtier needs a model identity: SGLang's model name or extra_config model_id")
        self.hot_pool_bytes = int(extra.get("hot_pool_bytes", DEFAULT_HOT_POOL_BYTES))
        self.transport = str(extra.get("transport", "auto"))
        self.device_map = extra.get("device_map")
        self.save_queue_bytes = int(extra.get("save_queue_bytes", SAVE_QUEUE_BYTES_MAX))
        if self.save_queue_bytes <= 0:
            raise ValueError(f"kvtier save_queue_bytes must be positive, got {self.save_queue_bytes}")
        self.namespace: Namespace | None = None  # the tenant's: what the daemon sees
        self.key_namespace: Namespace | None = None  # + this rank's shard: what the keys are keyed by
        self.cache: KVCache | None = None
        self.pages: HostPages | None = None
        self._stats_lock = threading.Lock()
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []
        self._recent = RecentSaves()
        self.counters = {"exists_calls": 0, "hit_pages": 0, "loaded_pages": 0, "failed_pages": 0, "saved_pages": 0,
                         "dropped_pages": 0}

    # --- setup ---------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Learn the host pool's geometry; open the cache in the tenant's namespace."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        if self.storage_config.is_mla_model or not hasattr(pool, "v_head_dim"):
            raise ValueError(f"kvtier supports MHA host pools, not {type(pool).__name__} (MLA is not supported yet)")
        if pool.v_head_dim != pool.head_dim:
            raise ValueError("kvtier needs equal K and V head sizes")
        dtype = str(pool.dtype).removeprefix("torch.")
        layout = KVLayout(pool.layer_num, pool.head_num, pool.head_dim, dtype, pool.page_size)
        cfg = self.storage_config
        namespace = Namespace(self.model, layout, self.codec, self.tenant)
        keyed = key_namespace(namespace, cfg.tp_rank, cfg.tp_size, cfg.pp_rank, cfg.pp_size)
        pages = HostPages(pool.kv_buffer, pool.layout, pool.page_size, pool.layer_num, pool.head_num, pool.head_dim)
        cache = KVCache(namespace, self.addresses, token=self.token, hot_pool_bytes=self.hot_pool_bytes,
                        device="cpu", device_map=self.device_map, transport=self.transport,
                        save_queue_bytes=self.save_queue_bytes)
        if self.cache is not None:
            self.cache.close()
        self.namespace, self.key_namespace, self.pages, self.cache = namespace, keyed, pages, cache

    def close(self) -> None:
        """Drain the write-behind saves, close the connections."""
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    def _ready(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("kvtier: register_mem_pool_host must be called before any page operation")
        return self.cache

    def keys_of(self, keys: List[str]) -> list[bytes]:
        """SGLang page keys -> kvtier keys of this rank's shard."""
        self._ready()
        ns_id = self.key_namespace.id
        return [page_key(ns_id, k) for k in keys]

    # --- existence -------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading pages present, in one LOOKUP round trip (0 when the daemon is unreachable);
        pages in saves still in flight (write-behind) count as present, and past them the
        daemon is asked once more for the rest."""
        cache = self._ready()
        if not keys:
            return 0
        kv_keys = self.keys_of(keys)
        hits = self._stored_from(cache, kv_keys, 0)
        queued = self._recent.in_flight_from(kv_keys, hits)
        if queued:
            hits += queued
            if hits < len(kv_keys):
                hits += self._stored_from(cache, kv_keys, hits)
        self.counters["exists_calls"] += 1
        self.counters["hit_pages"] += hits
        return hits

    @staticmethod
    def _stored_from(cache: KVCache, kv_keys: list[bytes], start: int) -> int:
        """Leading keys of ``kv_keys[start:]`` the daemon holds (one LOOKUP; 0 when unreachable)."""
        try:
            return cache.lookup_keys(kv_keys[start:])
        except IO_ERRORS as exc:
            logger.warning("kvtier lookup failed (%s); treating %d pages as misses", exc, len(kv_keys) - start)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- v1: straight into / out of the registered host pool ------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys:
            return []
        self._ready()
        tokens = self.pages.page_tokens(host_indices, len(keys))
        started = time.perf_counter()
        ok = self._load_into(keys, list(self.pages.page_views(tokens)))  # decoded straight into the host pool
        self._record(self._prefetch_pages, self._prefetch_bw, sum(ok), started)
        return ok

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys:
            return []
        self._ready()
        tokens = self.pages.page_tokens(host_indices, len(keys))
        started = time.perf_counter()
        stored = self._store(keys, self.pages.page_views(tokens))  # copied straight out of the pool
        self._record(self._backup_pages, self._backup_bw, len(keys) if stored else 0, started)
        return [stored] * len(keys)

    # --- generic: flat data pages --------------------------------------------
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        self._ready()
        started = time.perf_counter()
        out: list = []
        for i, block in enumerate(self._load(keys)):
            if block is None:
                out.append(None)
                continue
            flat = self.pages.flat_from_block(block)
            if target_locations is not None:
                target = target_locations[i]
                target.view(-1).copy_(flat)
                flat = target
            out.append(flat)
        self._record(self._prefetch_pages, self._prefetch_bw, sum(x is not None for x in out), started)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        self._ready()
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set needs one flat page per key: {len(keys)} keys")
        started = time.perf_counter()
        stored = self._store(keys, [self.pages.block_from_flat(torch.as_tensor(v)) for v in values])
        self._record(self._backup_pages, self._backup_bw, len(keys) if stored else 0, started)
        return stored

    # --- shared helpers -------------------------------------------------------
    def _load(self, keys: List[str]) -> list:
        """Verified blocks (``[L, 2, H, P, D]``) per key, None where missing or invalid."""
        try:
            blocks = self._ready().load_blocks(self.keys_of(keys))
        except IO_ERRORS as exc:
            logger.warning("kvtier load of %d pages failed (%s)", len(keys), exc)
            blocks = [None] * len(keys)
        good = sum(b is not None for b in blocks)
        self.counters["loaded_pages"] += good
        self.counters["failed_pages"] += len(keys) - good
        return blocks

    def _load_into(self, keys: List[str], pages: list) -> List[bool]:
        """:meth:`_load` straight into the host pool's page views; a miss's page holds no KV of its key."""
        try:
            ok = self._ready().load_blocks_into(self.keys_of(keys), pages)
        except IO_ERRORS as exc:
            logger.warning("kvtier load of %d pages failed (%s)", len(keys), exc)
            ok = [False] * len(keys)
        self.counters["loaded_pages"] += sum(ok)
        self.counters["failed_pages"] += len(keys) - sum(ok)
        return ok

    def _store(self, keys: List[str], blocks: list) -> bool:
        """Write-behind: copy the blocks of the pages not queued recently out and queue
        their PUT; never waits for the daemon. False when the save queue is full (the batch
        is dropped and counted)."""
        cache = self._ready()
        kv_keys = self.keys_of(keys)
        first = self._recent.leading(kv_keys)  # SGLang backs up whole prefixes again
        if first == len(kv_keys):
            return True
        at: dict[bytes, int] = {}  # a key PUT once, with its first page
        for i in range(first, len(kv_keys)):
            at.setdefault(kv_keys[i], i)
        new = list(at)
        try:
            queued = cache.store_blocks_async(new, [blocks[i] for i in at.values()])
        except RuntimeError as exc:  # the queue is closed: SGLang is shutting down
            logger.warning("kvtier store of %d pages not queued (%s)", len(new), exc)
            return False
        if queued.done() and queued.exception() is None and queued.result() == 0:
            self.counters["dropped_pages"] += len(new)
            return False
        self._recent.add(new, queued)
        self.counters["saved_pages"] += len(new)
        return True

    def wait_saves_stored(self, timeout_s: float | None = None) -> bool:
        """Wait until the saves queued so far have finished; False on timeout. SGLang never
        calls this: it is for shutdown paths and tests."""
        return self._recent.wait(timeout_s)

    def statistics(self):
        """The write-behind queue's figures (``SaveQueueStatistics``: queued, done, failed, dropped)."""
        return self._ready().statistics().saves

    def _record(self, pages: list, bandwidth: list, n_pages: int, started: float) -> None:
        if n_pages <= 0 or self.pages is None:
            return
        elapsed = max(time.perf_counter() - started, 1e-9)
        page_bytes = self.namespace.layout.block_raw_bytes
        with self._stats_lock:
            pages.append(n_pages)
            bandwidth.append(n_pages * page_bytes / elapsed / 2**30)  # GiB/s, as SGLang's backends report

    def get_stats(self):
        """SGLang's ``StorageMetrics`` for the interval since the last call
        (``--enable-storage-metrics``: ``sglang:prefetch_pgs``, ``sglang:backup_pgs``, bandwidths)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._stats_lock:
            metrics = StorageMetrics(prefetch_pgs=self._prefetch_pages, backup_pgs=self._backup_pages,
                                     prefetch_bandwidth=self._prefetch_bw, backup_bandwidth=self._backup_bw)
            self._prefetch_pages, self._backup_pages, self._prefetch_bw, self._backup_bw = [], [], [], []
        return metrics

    def clear(self) -> None:
        """SGLang's flush: kvtier is shared by every engine of the model, so one
        engine's flush leaves it alone (delete blocks with the kvtier admin CLI)."""
        logger.info("kvtier: clear() leaves the shared store as it is")
