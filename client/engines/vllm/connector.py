"""kvtier as a vLLM 0.33 KV connector (``KVConnectorBase_V1``).

Load it with::

    vllm serve MODEL --disable-hybrid-kv-cache-manager --kv-transfer-config \\
      '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.client.engines.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": {"address": "127.0.0.1:7410"}}'

(all settings: ``docs/vllm.md``). vLLM builds one instance per role::

    scheduler process                              worker process (one per TP rank)
    -----------------                              --------------------------------
    get_num_new_matched_tokens                     register_kv_caches   learn the paged layout
      one LOOKUP per TP shard, minimum wins        start_load_kv        fetch the blocks (a thread)
    update_state_after_alloc  -> load plan         wait_for_layer_load  scatter that layer
    build_connector_meta      -> BlockOps  ----->  save_kv_layer        gather that layer
    update_connector_output   <- load errors       wait_for_save        PUT the completed blocks
    request_finished          (frees at once)      get_block_ids_with_load_errors

Loads are synchronous in vLLM's sense (``load_kv_async=False``): the fetch
starts before the forward and each attention layer waits only for its own
scatter. A block that is missing or fails validation (CRC, key, namespace,
codec) is never written into vLLM's cache; its id is reported by
``get_block_ids_with_load_errors`` and vLLM recomputes from it. Saves copy
the blocks out during the step, so vLLM may free them as soon as a request
finishes; a failed save is logged and is only a future miss.

Requests with multimodal inputs or prompt embeddings are neither loaded nor
saved (their token ids do not determine their KV).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.client import ClientError
from kvtier.client.engines.namespaces import request_namespace, shard_namespace
from kvtier.client.engines.vllm.paged_views import PagedGeometry, paged_layout, paged_view
from kvtier.client.engines.vllm.scheduler_plan import BlockOp, RequestState, load_op, save_op
from kvtier.client.engines.vllm.settings import KVTierSettings
from kvtier.common.keys import KVLayout, Namespace
from kvtier.client.kvcache import KVCache
from kvtier.kernels.paged import gather_blocks, scatter_blocks

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

IO_ERRORS = (ClientError, OSError)  # the daemon unreachable or refusing: a miss, never a crash


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[BlockOp] = field(default_factory=list)
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
        model = self.settings.model_id or vllm_config.model_config.model
        extra = {"engine_page": "vllm-cpu"} if self.page_family == "cpu" else {}
        self.base_namespace = Namespace(model, layout, self.settings.codec, self.settings.tenant, extra)
        self.shards = tuple(shard_namespace(self.base_namespace, r, self.tp_size) for r in range(self.tp_size))
        self._requests: dict[str, RequestState] = {}
        self.cache: KVCache | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.tp_rank = 0
            self.cache = self._open_cache(self.shards[0], hot_pool_bytes=0, device="cpu")
        else:
            self.tp_rank = _tp_rank(self.tp_size)  # the worker's cache opens with the KV tensors' device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-vllm")
        # worker state
        self._views: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._load: _PendingLoad | None = None
        self._load_errors: set[int] = set()
        self._save_parts: dict[int, torch.Tensor] = {}
        self.counters = {"lookups": 0, "hit_blocks": 0, "loaded_blocks": 0, "failed_blocks": 0,
                         "saved_blocks": 0, "failed_saves": 0}

    def _open_cache(self, namespace: Namespace, hot_pool_bytes: int, device: str) -> KVCache:
        s = self.settings
        return KVCache(namespace, list(s.addresses), token=s.token, hot_pool_bytes=hot_pool_bytes,
                       device=device, device_map=s.device_map, transport=s.transport)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads scatter in wait_for_layer_load: it must run before each layer's
        attention, which a full CUDA graph replay would skip."""
        return True

    # ==================================================================
    # scheduler side
    # ==================================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state_for(request)
        if state is None:
            return 0, False
        tokens = list(request.all_token_ids)
        keys = self._keys_for(state, tokens)
        first = num_computed_tokens // self.block_tokens
        present = len(keys[0]) - first
        try:
            for rank_keys in keys:  # each TP rank's shard; all must hold a block for it to count
                if present <= 0:
                    break
                present = min(present, self.cache.lookup_keys(rank_keys[first:first + present]))
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
        return matched, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        state.pending_load = load_op(state, list(request.all_token_ids), block_ids, state.local_tokens,
                                     num_external_tokens, self.block_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVTierConnectorMetadata()
        computed_before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            if state.pending_load is not None:
                meta.loads.append(state.pending_load)
                state.loaded = state.pending_load
                state.pending_load = None
            if self._kv_cache_manager is None or req_id not in computed_before:
                continue
            request = state.request
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            op = save_op(state, list(request.all_token_ids), block_ids, computed_before[req_id] + n_scheduled,
                         request.num_tokens, self.block_tokens, self.settings.store)
            if op is not None:
                meta.saves.append(op)
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        """Blocks that failed to load are recomputed by vLLM: save them again then."""
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
        self._requests.pop(request.request_id, None)
        return False, None  # saves copy their blocks during the step: free them now

    def _state_for(self, request: "Request") -> RequestState | None:
        """The request's state, or None when its tokens do not determine its KV."""
        if request.prompt_token_ids is None or getattr(request, "mm_features", None):
            return None
        state = self._requests.get(request.request_id)
        if state is None:
            lora = request.lora_request.lora_name if request.lora_request is not None else None
            state = RequestState(request.request_id, request.cache_salt, lora, len(request.prompt_token_ids))
            self._requests[request.request_id] = state
        state.request = request
        return state

    def _keys_for(self, state: RequestState, tokens: list[int]) -> tuple:
        if state.keys_tokens != len(tokens):
            state.keys = tuple(request_namespace(ns, state.cache_salt, state.lora_name).keys(tokens)
                               for ns in self.shards)
            state.keys_tokens = len(tokens)
        return state.keys

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
        self._paged_layout = paged_layout(self.page_family)
        if self.cache is None:  # blocks decode straight onto the KV cache's device
            self.cache = self._open_cache(self.shards[self.tp_rank], self.settings.hot_pool_bytes,
                                          str(self._views[0].device))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is None or not meta.loads:
            return
        assert self._load is None, "start_load_kv twice without the previous load finishing"
        keys, block_ids = self._op_keys(meta.loads)
        self._load = _PendingLoad(keys, block_ids, self._executor.submit(self.cache.load_blocks, keys),
                                  set(range(len(self._views))))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self._scatter_layer(self._load, layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        meta = self._metadata()
        layer = self._layer_index.get(layer_name)
        if meta is None or not meta.saves or layer is None or layer in self._save_parts:
            return
        # a step's loads and saves never share a block: saves start past the hit
        _, block_ids = self._op_keys(meta.saves, keys=False)
        self._save_parts[layer] = gather_blocks([self._views[layer]], block_ids, self._paged_layout)

    def wait_for_save(self):
        self._finish_load()
        meta = self._metadata()
        parts, self._save_parts = self._save_parts, {}
        if meta is None or not meta.saves:
            return
        keys, block_ids = self._op_keys(meta.saves)
        for layer in range(len(self._views)):  # layers whose save_kv_layer hook did not run
            if layer not in parts:
                parts[layer] = gather_blocks([self._views[layer]], block_ids, self._paged_layout)
        blocks = torch.cat([parts[i] for i in range(len(self._views))], dim=1)
        try:
            self.cache.store_blocks(keys, list(blocks.unbind(0)))
            self.counters["saved_blocks"] += len(keys)
        except IO_ERRORS as exc:
            self.counters["failed_saves"] += len(keys)
            logger.warning("kvtier save of %d blocks failed (%s); they will be misses", len(keys), exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        self._executor.shutdown(wait=True)
        if self.cache is not None:
            self.cache.close()

    # --- worker helpers ------------------------------------------------------
    def _metadata(self) -> KVTierConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata), type(meta)
        return meta

    def _op_keys(self, ops: list[BlockOp], keys: bool = True) -> tuple[list[bytes], list[int]]:
        """The keys (this rank's namespace) and vLLM block ids of ``ops``, in order."""
        all_keys: list[bytes] = []
        all_ids: list[int] = []
        shard = self.shards[self.tp_rank]
        for op in ops:
            if keys:
                chain = request_namespace(shard, op.cache_salt, op.lora_name).keys(op.tokens)
                all_keys.extend(chain[op.first_block:op.first_block + op.num_blocks])
            all_ids.extend(op.block_ids)
        return all_keys, all_ids

    def _fetched(self, load: "_PendingLoad") -> None:
        """Resolve the fetch once: the good blocks as one buffer, the rest as errors."""
        if load.ready:
            return
        reachable = True
        try:
            blocks = load.future.result()
        except IO_ERRORS as exc:
            logger.warning("kvtier load of %d blocks failed (%s); vLLM recomputes them", len(load.block_ids), exc)
            blocks, reachable = [None] * len(load.block_ids), False
        good, seen, bad_keys = [], set(), []
        for key, block_id, block in zip(load.keys, load.block_ids, blocks):
            if block is None:
                self._load_errors.add(block_id)
                bad_keys.append(key)
            elif block_id not in seen:
                seen.add(block_id)
                good.append((block_id, block))
        self.counters["loaded_blocks"] += len(good)
        self.counters["failed_blocks"] += len(load.block_ids) - len(good)
        if bad_keys and reachable:
            self._discard(bad_keys)
        load.good_ids = [b for b, _ in good]
        load.buffer = torch.stack([blk for _, blk in good]) if good else None
        load.ready = True

    def _discard(self, keys: list[bytes]) -> None:
        """Delete blocks that LOOKUP reported but that failed to load or validate.

        The daemon keeps the first block put under a key, so a bad block would
        otherwise shadow the good one vLLM is about to recompute and save."""
        from kvtier.client import BlockClient

        for address in self.settings.addresses:  # the owner deletes; the others hold nothing
            try:
                with BlockClient(address, token=self.settings.token) as client:
                    client.delete_many(keys)
            except IO_ERRORS as exc:
                logger.warning("kvtier could not delete %d bad blocks on %s (%s)", len(keys), address, exc)

    def _scatter_layer(self, load: "_PendingLoad", layer: int) -> None:
        if layer not in load.layers_left:
            return
        self._fetched(load)
        load.layers_left.discard(layer)
        if load.buffer is not None:
            part = load.buffer[:, layer:layer + 1].contiguous()
            scatter_blocks(part, [self._views[layer]], load.good_ids, self._paged_layout)

    def _finish_load(self) -> None:
        load = self._load
        if load is None:
            return
        for layer in sorted(load.layers_left):
            self._scatter_layer(load, layer)
        self._fetched(load)
        self._load = None


@dataclass
class _PendingLoad:
    """One step's load on the worker: the fetch future and the layers still to scatter."""

    keys: list[bytes]
    block_ids: list[int]
    future: Future
    layers_left: set[int]
    ready: bool = False
    good_ids: list[int] = field(default_factory=list)
    buffer: torch.Tensor | None = None


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
