"""kvtier as a vLLM 0.33 KV connector (``KVConnectorBase_V1``).

Load it with::

    vllm serve MODEL --disable-hybrid-kv-cache-manager --kv-transfer-config \\
      '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.client.engines.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": {"address": "127.0.0.1:7410"}}'

(all settings: ``docs/vllm.md``). vLLM builds one instance per role::

    scheduler process                              worker process (one per TP rank)
    -----------------                              --------------------------------
    get_num_new_matched_tokens                     register_kv_caches   learn the paged layout
      extend the request's key chains,             start_load_kv        start one fetch per request
      one LOOKUP of every TP shard's keys          wait_for_layer_load  wait for that layer, scatter it
    update_state_after_alloc  -> load plan         save_kv_layer        gather that layer (host copy)
    build_connector_meta      -> BlockOps  ----->  wait_for_save        enqueue the saves (write-behind)
    update_connector_output   <- load errors,      get_finished         async loads done: scattered
                                 finished loads    get_block_ids_with_load_errors
    request_finished                               get_kv_connector_stats  drops, failures, blocks
                                                   shutdown             drain the save queues

Loads: ``start_load_kv`` only starts the fetches (one background future per
request, ``worker_loads.py``). With ``load_async`` false (the default) vLLM
runs the request in the same step and each attention layer's
``wait_for_layer_load`` waits for what that layer needs (today the whole
fetch: a block holds every layer) and scatters it. With ``load_async`` true
the request waits in vLLM's WAITING_FOR_REMOTE_KVS while the batch goes on;
``get_finished`` scatters each completed fetch and reports its request.
A block that is missing or fails validation (CRC, key, namespace, codec) is
never written into vLLM's cache; its id is reported by
``get_block_ids_with_load_errors`` (in the step it is found, which for an
async load is the step its request is reported finished) and vLLM
recomputes from it.

Saves are write-behind (``worker_saves.py``): the blocks are copied out
during the step and queued; the PUT runs in the background. A full queue
drops the save (a later miss, counted in the connector stats); shutdown
drains the queues.

Namespaces: the daemon sees each request's tenant namespace (model, layout,
codec, operator tenant, the request's cache salt, its LoRA adapter) in the
block headers and frames; the keys chain from the tenant namespace plus the
TP shard, so shards never share keys (``namespaces.py``).

Requests with multimodal inputs or prompt embeddings are neither loaded nor
saved (their token ids do not determine their KV).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.client.engines.namespaces import adapter_identity, key_namespace, request_namespace
from kvtier.client.engines.vllm.connector_stats import KVTierConnectorStats, delta
from kvtier.client.engines.vllm.paged_views import PagedGeometry, paged_layout, paged_view
from kvtier.client.engines.vllm.scheduler_plan import (
    BlockOp,
    RequestState,
    block_op,
    interleaved_keys,
    load_range,
    save_range,
)
from kvtier.client.engines.vllm.settings import KVTierSettings
from kvtier.client.engines.vllm.tenant_caches import TenantCaches
from kvtier.client.engines.vllm.worker_loads import IO_ERRORS, WorkerLoads
from kvtier.client.engines.vllm.worker_saves import WorkerSaves
from kvtier.client.kvcache import KVCache
from kvtier.common.keys import KVLayout, Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: only this step's blocks (O(new blocks))."""

    loads: list[BlockOp] = field(default_factory=list)  # the forward of this step needs them
    async_loads: list[BlockOp] = field(default_factory=list)  # their requests wait between steps
    saves: list[BlockOp] = field(default_factory=list)


class KVTierConnector(KVConnectorBase_V1):
    """See the module doc."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = KVTierSettings.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config))
        spec, self._layer_names = _single_attention_group(kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("KVTierConnector does not support pipeline parallelism yet")
        self.tp_size = parallel.tensor_parallel_size
        self.block_tokens = spec.block_size
        self.page_family = "cpu" if vllm_config.device_config.device_type == "cpu" else "kv_last"
        dtype = str(spec.dtype).removeprefix("torch.")
        self.geometry = PagedGeometry(spec.num_kv_heads, spec.block_size, spec.head_size, dtype)
        layout = KVLayout(len(self._layer_names), spec.num_kv_heads, spec.head_size, dtype, spec.block_size)
        model_config = vllm_config.model_config
        model = self.settings.model_id or model_config.model
        extra = {"engine_page": "vllm-cpu"} if self.page_family == "cpu" else {}
        for name in ("revision", "quantization"):  # other weights under the same model name
            if getattr(model_config, name, None):
                extra[name] = str(getattr(model_config, name))
        self.base_namespace = Namespace(model, layout, self.settings.codec, self.settings.tenant, extra)
        self._requests: dict[str, RequestState] = {}
        self.caches: TenantCaches | None = None
        self._device = "cpu"
        if role == KVConnectorRole.SCHEDULER:
            self.tp_rank = 0
            self.caches = self._open_caches(hot_pool_bytes=0)
        else:
            self.tp_rank = _tp_rank(self.tp_size)  # the worker's caches open with the KV tensors' device
        # worker state
        self._views: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._loads: WorkerLoads | None = None
        self._saves: WorkerSaves | None = None
        self._saves_meta: KVTierConnectorMetadata | None = None  # the step whose saves are being gathered
        self._stats_reported: dict[str, int] = {}
        self.counters = {"lookups": 0, "hit_blocks": 0}

    def _open_caches(self, hot_pool_bytes: int) -> TenantCaches:
        s = self.settings

        def open_cache(namespace: Namespace) -> KVCache:
            return KVCache(namespace, list(s.addresses), token=s.token, hot_pool_bytes=hot_pool_bytes,
                           device=self._device, device_map=s.device_map, transport=s.transport,
                           save_queue_bytes=s.save_queue_bytes)
        return TenantCaches(self.base_namespace, open_cache)

    def key_namespace(self, cache_salt: str | None, lora_name: str | None, rank: int) -> Namespace:
        """The namespace a TP rank's keys chain from, for one tenant."""
        return key_namespace(self.caches_namespace(cache_salt, lora_name), rank, self.tp_size)

    def caches_namespace(self, cache_salt: str | None, lora_name: str | None) -> Namespace:
        """The tenant namespace (its id is what the daemon sees)."""
        return request_namespace(self.base_namespace, cache_salt, lora_name)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads scatter in wait_for_layer_load: it must run before each layer's
        attention, which a full CUDA graph replay would skip."""
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(data=dict(data or {}))

    # ==================================================================
    # scheduler side
    # ==================================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state_for(request)
        if state is None:
            return 0, False
        state.extend_keys(request.all_token_ids)  # only the blocks completed since the last call
        first = num_computed_tokens // self.block_tokens
        cache = self.caches.get(*state.tenant)
        try:
            present = cache.lookup_keys(interleaved_keys(state.chains, first)) // len(state.chains)
        except IO_ERRORS as exc:
            logger.warning("kvtier lookup failed (%s); request %s recomputes", exc, request.request_id)
            present = 0
        state.hit_blocks = first + max(present, 0)
        self.counters["lookups"] += 1
        matched = state.matched_tokens(request.num_tokens, num_computed_tokens, self.block_tokens)
        if matched:
            self.counters["hit_blocks"] += max(present, 0)
        state.pending_load = None
        state.local_tokens = num_computed_tokens
        return matched, bool(matched) and self.settings.load_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        span = load_range(state, len(block_ids), state.local_tokens, num_external_tokens, self.block_tokens)
        if span is not None:
            first, stop = span
            state.pending_load = block_op(state, first, block_ids[first:stop], state.keys_of(first, stop))
            state.pending_async = self.settings.load_async

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVTierConnectorMetadata()
        for state in self._requests.values():  # async loads' requests are not scheduled this step
            if state.pending_load is not None:
                (meta.async_loads if state.pending_async else meta.loads).append(state.pending_load)
                state.loaded, state.pending_load = state.pending_load, None
                state.loading_async = state.pending_async
        if self._kv_cache_manager is None or self.settings.store == "none":
            return meta
        computed_before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or req_id not in computed_before:
                continue
            request = state.request
            span = save_range(state, computed_before[req_id] + n_scheduled, request.num_tokens, self.block_tokens,
                              self.settings.store)
            if span is None:
                continue
            first, stop = span
            state.extend_keys(request.all_token_ids)
            meta.saves.append(block_op(state, first, self._block_ids(req_id, first, stop), state.keys_of(first, stop)))
        return meta

    def _block_ids(self, req_id: str, first: int, stop: int) -> list[int]:
        """vLLM block ids ``first .. stop`` of a request, without copying its whole block table."""
        blocks = self._kv_cache_manager.coordinator.get_blocks(req_id)[0]
        return [blk.block_id for blk in blocks[first:stop]]

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        """Async loads reported done; blocks that failed to load are recomputed by
        vLLM: save them again then."""
        for req_id in connector_output.finished_recving or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.loading_async = False
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for state in self._requests.values():
            loaded = state.loaded
            if loaded is None:
                continue
            bad = [i for i, b in enumerate(loaded.block_ids) if b in invalid]
            if bad:
                redo = loaded.first_block + bad[0]
                state.hit_blocks = min(state.hit_blocks, redo)
                state.saved_blocks = min(state.saved_blocks, redo)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves copy their blocks during the step, so vLLM frees them at once; a
        request whose async load is still in flight keeps them until the worker
        reports the load finished (vLLM then frees them)."""
        state = self._requests.pop(request.request_id, None)
        return state is not None and state.loading_async, None

    def _state_for(self, request: "Request") -> RequestState | None:
        """The request's state, or None when its tokens do not determine its KV."""
        if request.prompt_token_ids is None or getattr(request, "mm_features", None) \
                or getattr(request, "prompt_embeds", None) is not None:
            return None  # positions given as embeddings read as token 0 in the ids
        state = self._requests.get(request.request_id)
        if state is None:
            adapter = request.lora_request
            lora = None if adapter is None else adapter_identity(adapter.lora_name, getattr(adapter, "lora_path", None))
            state = RequestState(request.request_id, request.cache_salt, lora, len(request.prompt_token_ids))
            state.chains = tuple(self.key_namespace(state.cache_salt, lora, r).key_chain()
                                 for r in range(self.tp_size))
            self._requests[request.request_id] = state
        state.request = request
        return state

    # ==================================================================
    # worker side
    # ==================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if set(names) != set(self._layer_names):
            raise ValueError(f"KV caches for layers {names}, the KV cache config has {self._layer_names}")
        self._views = [paged_view(kv_caches[n], self.page_family, self.geometry) for n in names]
        self._layer_index = {n: i for i, n in enumerate(names)}
        layout = paged_layout(self.page_family)
        if self.caches is None:  # blocks decode straight onto the KV cache's device
            self._device = str(self._views[0].device)
            self.caches = self._open_caches(self.settings.hot_pool_bytes)
        self._loads = WorkerLoads(self._views, layout, self._discard)
        self._saves = WorkerSaves(self._views, layout)

    def _cache_for(self, op: BlockOp) -> KVCache:
        return self.caches.get(*op.tenant)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Start this step's fetches (one background future per request); never waits."""
        meta = self._metadata()
        if meta is None or self._loads is None:
            return
        for ops, is_async in ((meta.loads, False), (meta.async_loads, True)):
            for op in ops:
                self._loads.start(op.req_id, self._cache_for(op), list(op.keys[self.tp_rank]), list(op.block_ids),
                                  is_async)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is not None and self._loads is not None:
            self._loads.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        meta = self._metadata()
        layer = self._layer_index.get(layer_name)
        if meta is None or not meta.saves or layer is None or self._saves is None:
            return
        self._begin_saves(meta)
        self._saves.gather_layer(layer)

    def _begin_saves(self, meta: KVTierConnectorMetadata) -> None:
        """Tell the saver this step's blocks, once per step's metadata."""
        if self._saves_meta is meta:
            return
        # a step's loads and saves never share a block: saves start past the hit
        self._saves.begin([b for op in meta.saves for b in op.block_ids])
        self._saves_meta = meta

    def wait_for_save(self):
        """Complete this step's sync loads, then enqueue its saves (never waits for a PUT).

        A step whose sync load failed saves nothing: its forward ran over pages the failed
        blocks were never written into (those of the request and of any other that shares
        them through vLLM's prefix cache), and the daemon keeps the first block put under a
        key. vLLM recomputes from the failed block, and the request's blocks are saved then;
        the step's other saves are counted (``skipped_saves``) and later misses."""
        failed = self._loads is not None and self._loads.finish_sync()
        meta = self._metadata()
        if meta is None or not meta.saves or self._saves is None:
            return
        if failed:
            self._saves.skip(meta.saves)
        else:
            self._begin_saves(meta)
            self._saves.submit(meta.saves, self._cache_for, self.tp_rank)
        self._saves_meta = None

    def wait_saves_stored(self, timeout_s: float | None = None) -> bool:
        """Wait until the saves queued so far have finished (never called by a step)."""
        return self._saves is None or self._saves.wait_stored(timeout_s)

    def wait_loads_fetched(self, timeout_s: float | None = None) -> bool:
        """Wait until the fetches in flight have their blocks (never called by a step)."""
        return self._loads is None or self._loads.wait_fetched(timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose async load is done (scattered into vLLM's cache)."""
        if self._loads is None:
            return None, None
        return None, (self._loads.poll() or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._loads is None:
            return set()
        self._loads.finish_sync()
        return self._loads.take_errors()

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        """The worker's counts since the last call (vLLM sums them over the workers)."""
        if self._loads is None or self.caches is None:
            return None
        now = self.statistics()
        stats = delta(now, self._stats_reported)
        self._stats_reported = now
        return stats

    def statistics(self) -> dict[str, int]:
        """The worker's cumulative counts: loads, saves queued, and the save queues' outcomes."""
        out: dict[str, int] = {}
        for part in (self._loads, self._saves):
            if part is not None:
                out.update(part.counters)
        if self.caches is not None:
            saves = self.caches.saves()
            out.update(saves_done=saves.saves_done, saves_failed=saves.saves_failed,
                       saves_dropped=saves.saves_dropped, blocks_dropped=saves.blocks_dropped)
        return out

    def shutdown(self):
        """Wait for the fetches in flight, drain the save queues, close the connections."""
        if self._loads is not None:
            self._loads.close()
        if self.caches is not None:
            self.caches.close()

    # --- worker helpers ------------------------------------------------------
    def _metadata(self) -> KVTierConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata), type(meta)
        return meta

    def _discard(self, cache: KVCache, keys: list[bytes]) -> None:
        """Delete blocks that LOOKUP reported but that failed to load or validate, off the step:
        on the tenant cache's save queue, ahead of the recomputed blocks' saves. The daemon
        keeps the first block put under a key, so a bad block would otherwise shadow the good
        one vLLM is about to recompute and save."""
        try:
            cache.delete_blocks_async(keys)
        except IO_ERRORS as exc:  # the cache closed meanwhile
            logger.warning("kvtier could not delete %d bad blocks (%s)", len(keys), exc)


def _single_attention_group(kv_cache_config: "KVCacheConfig"):
    """The one full-attention group's spec and layer names; ValueError otherwise."""
    from vllm.v1.kv_cache_interface import AttentionSpec, KVQuantMode, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"KVTierConnector needs one KV cache group, got {len(groups)}: "
                         "start vLLM with --disable-hybrid-kv-cache-manager")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec) or isinstance(spec, MLAAttentionSpec):
        raise ValueError(f"KVTierConnector supports multi-head attention KV caches, not {type(spec).__name__}")
    if spec.kv_quant_mode != KVQuantMode.NONE or spec.head_size_v != spec.head_size:
        raise ValueError("KVTierConnector needs an unquantized KV cache with equal K and V head sizes "
                         "(use kvtier's own codecs to compress)")
    return spec, list(groups[0].layer_names)


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()
