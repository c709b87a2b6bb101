"""Hugging Face transformers (5.x) integration: prefill only what is not stored.

::

    prompt tokens ----> KVCache.start_load(tokens, max_tokens=T-1)   stored prefix P (whole blocks):
                         -> a DynamicCache over its tensors          their length known at once,
    tokens[P:]    ----> model(suffix, cache=that cache)              filled layer group by group;
                         layer i's update() waits for layer i        layer 0 runs while the rest arrive
                         -> logits of the last token, the full DynamicCache
                         -> KVCache.store(tokens, cache layers)   new full blocks only

A prefix that shrinks while loading (a block evicted or corrupt after the LOOKUP) is
noticed at the next layer's wait; the prompt is then prefilled again from the prefix
that is still good. A daemon that cannot be reached, or fails while the prefix streams in,
is a miss: the whole prompt is prefilled (and its store, if that fails too, stores nothing);
both are logged. ``streaming=False`` loads the whole prefix before the model runs.

At least one token is always prefilled (the model must produce the last
token's logits), so a fully stored prompt loads ``T-1`` tokens rounded down
to whole blocks.

Supported: transformers >= 5.0, < 6 (``cache.layers[i].keys/.values`` and
``DynamicCache(ddp_cache_data=...)``); tested with 5.24. The forward
argument is ``cache`` from 5.24 on and ``past_key_values`` before; the
helper picks whichever the model's ``forward`` accepts.
"""
from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvtier.common.keys import KVLayout, Namespace
from kvtier.wire.events import ClientError

log = logging.getLogger(__name__)

STORE_ERRORS = (ClientError, OSError)  # the daemon unreachable or failing: a miss, never the prefill's failure

TRANSFORMERS_MIN = (5, 0)
TRANSFORMERS_BELOW = (6, 0)


def check_transformers_version() -> str:
    """The installed version; ImportError naming the supported range otherwise."""
    import transformers

    version = transformers.__version__
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if not TRANSFORMERS_MIN <= parts < TRANSFORMERS_BELOW:
        raise ImportError(f"kvtier's transformers integration supports transformers >=5.0,<6; found {version}")
    return version


def kv_layout_for(config: Any, block_tokens: int = 16, dtype: str | None = None) -> KVLayout:
    """The KV layout of a decoder config (Llama-style attention)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if dtype is None:
        dtype = str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "float32")
    dtype = dtype.replace("torch.", "")
    return KVLayout(num_layers=text.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=dtype, block_tokens=block_tokens)


def namespace_for(model: Any, model_id: str, block_tokens: int = 16, codec: str = "raw",
                  tenant_salt: str = "", layer_groups: int = 1) -> Namespace:
    """A namespace for ``model`` (its KV layout from the config, its dtype
    from its parameters). ``model_id`` must pin the weights (a name and
    revision, a checkpoint digest): KV from other weights is not interchangeable."""
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    layout = kv_layout_for(model.config, block_tokens, dtype)
    if layer_groups != 1:
        layout = KVLayout(**{**layout.__dict__, "layer_groups": layer_groups})
    return Namespace(model=model_id, layout=layout, codec=codec, tenant_salt=tenant_salt)


def cache_from_layers(layers) -> Any:
    """A DynamicCache holding per-layer ``(k, v)`` (empty if ``layers`` is),
    without copying them: ``DynamicCache(ddp_cache_data=...)`` concatenates
    each layer onto an empty tensor (a full copy of the prefix), so the cache
    is built from zero-length slices and then given the loaded tensors as its
    ``layers[i].keys/.values``. The model's first update concatenates the
    suffix onto them, as it would onto its own."""
    from transformers import DynamicCache

    layers = list(layers)
    if not layers:
        return DynamicCache()
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in layers])
    for layer, (k, v) in zip(cache.layers, layers):
        layer.keys, layer.values = k, v
    return cache


@functools.cache
def _streaming_cache_class() -> type:
    from transformers import DynamicCache

    class StreamingDynamicCache(DynamicCache):
        """A DynamicCache over a :class:`~kvtier.client.prefix_load.PrefixLoad`'s tensors:
        layer i's first update waits for layer i's KV (lengths are right from the start,
        so positions and masks need no wait)."""

        def __init__(self, load: Any) -> None:
            super().__init__(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in load.layers])
            for layer, (k, v) in zip(self.layers, load.layers):
                layer.keys, layer.values = k, v
            self._load = load
            self._waited: set[int] = set()

        def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
            if layer_idx not in self._waited:
                self._load.wait_layer(layer_idx)
                self._waited.add(layer_idx)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return StreamingDynamicCache


def streaming_cache(load: Any) -> Any:
    """The model-facing cache of a streaming load (see the module doc)."""
    if not load.layers:
        from transformers import DynamicCache

        return DynamicCache()
    return _streaming_cache_class()(load)


def layers_of_cache(cache: Any) -> list:
    """Per-layer ``(k, v)`` of a DynamicCache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache_argument(model: Any) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass(frozen=True)
class PrefillResult:
    logits: Any  # [1, vocab]: the last prompt token's logits
    cache: Any  # DynamicCache over the whole prompt, ready for decoding
    prompt_tokens: int
    loaded_tokens: int
    stored_blocks: int
    load_s: float
    prefill_s: float
    store_s: float


def prefill(model: Any, input_ids: Any, kvcache: Any, store: bool = True, streaming: bool = True) -> PrefillResult:
    """Load the stored prefix of ``input_ids`` ([1, T]) from ``kvcache``,
    prefill the rest, store the new full blocks (unless ``store`` is False).
    ``load_s`` is the time before the model starts (with streaming, the LOOKUP);
    ``prefill_s`` includes any wait for a layer still loading."""
    import torch

    from kvtier.client.prefix_load import PrefixShortened

    check_transformers_version()
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T] (batch 1), got {tuple(input_ids.shape)}")
    total = int(input_ids.shape[1])
    if total == 0:
        raise ValueError("input_ids is empty: nothing to prefill")
    tokens = input_ids[0].tolist()
    argument = _cache_argument(model)
    def run(start: int, cache):
        return model(input_ids[:, start:], use_cache=True, logits_to_keep=1, **{argument: cache})

    with torch.inference_mode():
        t0 = time.perf_counter()
        loaded_tokens, cache = 0, cache_from_layers(())
        try:
            if streaming:
                loaded = kvcache.start_load(tokens, max_tokens=total - 1)
                loaded_tokens, cache = loaded.num_tokens, streaming_cache(loaded)
            else:
                loaded = kvcache.load(tokens, max_tokens=total - 1)
                loaded_tokens, cache = loaded.num_tokens, cache_from_layers(loaded.layers)
        except STORE_ERRORS as exc:
            log.warning("kvtier could not load the prefix (%s); prefilling all %d tokens", exc, total)
        t1 = time.perf_counter()
        try:
            out = run(loaded_tokens, cache)
        except PrefixShortened as shrunk:
            try:
                loaded = kvcache.load(tokens, max_tokens=shrunk.valid_tokens)
                loaded_tokens, cache = loaded.num_tokens, cache_from_layers(loaded.layers)
            except STORE_ERRORS as exc:
                log.warning("kvtier could not load the prefix (%s); prefilling all %d tokens", exc, total)
                loaded_tokens, cache = 0, cache_from_layers(())
            out = run(loaded_tokens, cache)
        except STORE_ERRORS as exc:  # the daemon failed while the prefix streamed in
            log.warning("kvtier failed while loading the prefix (%s); prefilling all %d tokens", exc, total)
            loaded_tokens, cache = 0, cache_from_layers(())
            out = run(0, cache)
        t2 = time.perf_counter()
        stored = 0
        if store:
            try:
                stored = kvcache.store(tokens, layers_of_cache(cache))
            except STORE_ERRORS as exc:
                log.warning("kvtier could not store the prompt's blocks (%s)", exc)
        t3 = time.perf_counter()
    return PrefillResult(logits=out.logits[:, -1], cache=cache, prompt_tokens=total,
                         loaded_tokens=loaded_tokens, stored_blocks=stored,
                         load_s=t1 - t0, prefill_s=t2 - t1, store_s=t3 - t2)
