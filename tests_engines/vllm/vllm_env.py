"""Real vLLM 0.33 objects on CPU for the connector tests (our own helpers).

Built the way vLLM's EngineCore builds them (``vllm/v1/engine/core.py``),
with vLLM's own functions throughout: a ``VllmConfig`` from a local model
folder, the KV cache config from the attention layers' specs, a v1
``Scheduler``, and the per-layer KV tensors from ``allocate_kv_cache``.
Nothing here stands in for a vLLM class.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform, no GPU needed
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hub is unreachable; the model folder is local

import torch  # noqa: E402

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402

# A tiny Llama: 2 layers, 2 KV heads of 64 (a head size CPU_ATTN supports), fp16.
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 64
BLOCK_TOKENS = 32  # CPU_ATTN needs a multiple of 32
NUM_GPU_BLOCKS = 64
MAX_MODEL_LEN = 1024
DTYPE = torch.float16


def write_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": NUM_KV_HEADS,
        "num_hidden_layers": NUM_LAYERS, "head_dim": HEAD_DIM, "vocab_size": 1000,
        "max_position_embeddings": 2048, "torch_dtype": "float16",
    }))
    return path


def make_vllm_config(model_dir: Path, extra_config: dict, store_role: str = "kv_both") -> VllmConfig:
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16",
                        max_model_len=MAX_MODEL_LEN)
    return VllmConfig(
        model_config=model,
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, num_gpu_blocks_override=NUM_GPU_BLOCKS),
        scheduler_config=SchedulerConfig(max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False,
                                         disable_hybrid_kv_cache_manager=True,
                                         max_num_batched_tokens=MAX_MODEL_LEN, max_num_seqs=16),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.client.engines.vllm",
            kv_role=store_role, kv_connector_extra_config=dict(extra_config),
            kv_load_failure_policy="recompute"),  # a block that fails to load is recomputed
    )


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def make_kv_cache_config(vllm_config: VllmConfig):
    """The KV cache config EngineCore would derive for the tiny model's layers."""
    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM,
                             dtype=DTYPE)
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    specs = [{name: spec for name in layer_names()}]
    supported = [[layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()]]
    resolve_kv_cache_layout(vllm_config, supported, [spec])  # records it on cache_config
    groups = get_global_kv_cache_groups(vllm_config, specs)
    page_bytes = spec.page_size_bytes * NUM_LAYERS
    configs = get_kv_cache_configs(vllm_config, specs, [page_bytes * NUM_GPU_BLOCKS], groups)
    configs[0].kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    sched_config = generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = sched_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_config, vllm_config)
    alignment = resolve_cache_hit_alignment_tokens(sched_config, vllm_config, block_size, hash_block_size)
    for c in (configs[0], sched_config):
        c.hash_block_size = hash_block_size
        c.cache_hit_alignment_tokens = alignment
    return configs[0]


def make_scheduler(vllm_config: VllmConfig, kv_cache_config) -> Scheduler:
    """A v1 Scheduler; it creates the connector's scheduler role itself."""
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=block_size, hash_block_size=hash_block_size)


def allocate_caches(kv_cache_config) -> dict[str, torch.Tensor]:
    """vLLM's own per-layer KV views for CPU_ATTN's layout (LBHNC)."""
    assert kv_cache_config.kv_cache_layout in (KVCacheLayout.LBHNC, "LBHNC"), kv_cache_config.kv_cache_layout
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)


_HASHER = None


def make_request(req_id: str, tokens: list[int], cache_salt: str | None = None, lora_request=None,
                 max_tokens: int = 4) -> Request:
    global _HASHER
    if _HASHER is None:
        init_none_hash(sha256)
        _HASHER = get_request_block_hasher(BLOCK_TOKENS, sha256)
    return Request(req_id, list(tokens), SamplingParams(max_tokens=max_tokens), None,
                   cache_salt=cache_salt, lora_request=lora_request, block_hasher=_HASHER)


def token_kv(tokens: list[int], position: int, layer: int) -> torch.Tensor:
    """What our stand-in model computes for one token: K and V ``[2, heads, head_dim]``,
    a deterministic function of the prefix up to and including it (as a real model's KV is)."""
    import hashlib

    digest = hashlib.blake2b(repr((layer, tokens[:position + 1])).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return torch.randn((2, NUM_KV_HEADS, HEAD_DIM), generator=gen).to(DTYPE)


class Engine:
    """One vLLM instance's scheduler and worker (TP=1) around real vLLM objects.

    ``step()`` does what EngineCore and the model runner do around a forward:
    schedule, bind the connector metadata, start loads, then per layer wait
    for its load, write the new tokens' KV (the stand-in model), and save;
    then ``wait_for_save``, collect the connector output and hand one sampled
    token per request back to the scheduler."""

    def __init__(self, vllm_config: VllmConfig):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        from kvtier.client.engines.vllm.paged_views import paged_view

        self.config = vllm_config
        self.kv_cache_config = make_kv_cache_config(vllm_config)
        self.scheduler = make_scheduler(vllm_config, self.kv_cache_config)
        self.worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.caches = allocate_caches(self.kv_cache_config)
        self.worker.register_kv_caches(self.caches)
        self.views = {n: paged_view(t, "cpu", self.worker.geometry) for n, t in self.caches.items()}
        self.requests: dict[str, Request] = {}
        self.last_output = None
        self.load_errors: set[int] = set()
        self.finished_recving: set[str] = set()
        self.stats: list = []  # get_kv_connector_stats of every step

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def step(self, sample_token: int = 7, before_save=None):
        """One engine step; returns the scheduler output and the load errors reported."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        # as the model runner does: sync loads start before the forward, async ones after it
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        starts.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        for layer, name in enumerate(layer_names()):
            w.wait_for_layer_load(name)
            for req_id, n in out.num_scheduled_tokens.items():
                self._forward_layer(req_id, starts[req_id], n, layer, name)
            w.save_kv_layer(name, self.caches[name], None)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        if before_save is not None:
            before_save()
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        self.load_errors |= errors
        self.finished_recving |= results.finished_recving
        self.stats.append(w.get_kv_connector_stats())
        w.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self.requests[req_id]
            done = starts[req_id] + out.num_scheduled_tokens[req_id] >= req.num_tokens
            sampled.append([sample_token] if done else [])
        kv_out = KVConnectorOutput(finished_recving=results.finished_recving, invalid_block_ids=errors)
        runner_out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                       sampled_token_ids=sampled, kv_connector_output=kv_out)
        self.scheduler.update_from_output(out, runner_out)
        self.last_output = out
        return out, errors

    def settle(self) -> None:
        """Wait until the write-behind saves queued so far are stored (steps never wait)."""
        assert self.worker.wait_saves_stored(timeout_s=60)

    def _forward_layer(self, req_id: str, start: int, n: int, layer: int, name: str) -> None:
        req = self.requests[req_id]
        tokens = list(req.all_token_ids)
        ids = self.block_ids(req_id)
        view = self.views[name]  # [block, head, kv, token, dim]
        for p in range(start, min(start + n, len(tokens))):
            kv = token_kv(tokens, p, layer)
            view[ids[p // BLOCK_TOKENS], :, :, p % BLOCK_TOKENS, :] = kv.transpose(0, 1)

    def page(self, block_id: int) -> torch.Tensor:
        """Every layer's page of one block, as raw bytes ``[layers, page bytes]``."""
        return torch.stack([self.caches[n][block_id].contiguous().view(torch.uint8).flatten()
                            for n in layer_names()])

    def expected_page(self, tokens: list[int], block_index: int) -> torch.Tensor:
        """The page the stand-in model computes for block ``block_index`` of ``tokens``."""
        scratch = {n: torch.zeros_like(self.caches[n][:1]) for n in layer_names()}
        for layer, name in enumerate(layer_names()):
            from kvtier.client.engines.vllm.paged_views import paged_view

            view = paged_view(scratch[name], "cpu", self.worker.geometry)
            for off in range(BLOCK_TOKENS):
                p = block_index * BLOCK_TOKENS + off
                view[0, :, :, off, :] = token_kv(tokens, p, layer).transpose(0, 1)
        return torch.stack([scratch[n][0].contiguous().view(torch.uint8).flatten() for n in layer_names()])

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()
