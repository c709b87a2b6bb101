"""Codec quality on a real model: last-token logits after a prefix decoded from a codec.

A small ``transformers`` Llama with random weights (built from a LlamaConfig; no
download) prefills a batch of random prompts, then each codec round-trips every
layer's keys and values; the last prompt token runs against that cache and its
logits are compared with the run on the unquantized cache:

    relative logit error = ||logits_codec - logits_ref||_2 / ||logits_ref||_2   (per prompt)
    top-1 agreement      = argmax(logits_codec) == argmax(logits_ref)            (fraction of prompts)

torch and transformers are imported lazily (measurement only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .mixed import MixedPrecisionPolicy
from .registry import get_codec

TINY_LLAMA = dict(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


@dataclass(frozen=True)
class CodecQuality:
    codec: str
    prompts: int
    prefix_tokens: int
    rel_logit_error_mean: float
    rel_logit_error_max: float
    top1_agreement: float
    kv_rel_l2_error: float  # over all layers' keys and values of the batch


def tiny_llama(seed: int = 0, dtype: Any = None) -> Any:
    """A random-weight LlamaForCausalLM (4 layers, hidden 256, 4 heads, 2 KV heads, vocab 1000)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    return model.to(dtype) if dtype is not None else model


def _roundtrip(codec_name: str, kv: list[tuple[Any, Any]], policy: MixedPrecisionPolicy | None) -> list[tuple[Any, Any]]:
    """Every layer's (k, v) [batch, kv_heads, tokens, head_dim] through the codec and back."""
    import torch

    if codec_name.startswith("mixed"):
        stacked = torch.stack([torch.stack([k, v]) for k, v in kv])  # [layers, 2, batch, heads, tokens, dim]
        codec = get_codec(codec_name, policy=policy)
        out = torch.empty_like(stacked)
        codec.decode(codec.encode(stacked), out)
        return [(out[i, 0], out[i, 1]) for i in range(len(kv))]
    codec = get_codec(codec_name)
    result = []
    for k, v in kv:
        k2, v2 = torch.empty_like(k), torch.empty_like(v)
        codec.decode(codec.encode(k), k2)
        codec.decode(codec.encode(v), v2)
        result.append((k2, v2))
    return result


def measure(model: Any, codec_names: list[str], *, prompts: int = 32, prefix_tokens: int = 128, seed: int = 1,
            policy: MixedPrecisionPolicy | None = None) -> list[CodecQuality]:
    """Quality of each codec over ``prompts`` random prompts of ``prefix_tokens`` + 1 tokens."""
    import torch
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (prompts, prefix_tokens + 1), generator=gen)
    with torch.no_grad():
        pre = model(input_ids=ids[:, :-1], use_cache=True)
        cache = getattr(pre, "cache", None) or pre.past_key_values
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        ref = model(input_ids=ids[:, -1:], cache=DynamicCache(ddp_cache_data=kv)).logits[:, -1].float()
        results = []
        for name in codec_names:
            kv2 = _roundtrip(name, kv, policy)
            logits = model(input_ids=ids[:, -1:], cache=DynamicCache(ddp_cache_data=kv2)).logits[:, -1].float()
            err = (logits - ref).norm(dim=-1) / ref.norm(dim=-1)
            num = sum(float(((a.float() - b.float()) ** 2).sum()) for p, q in zip(kv, kv2) for a, b in zip(p, q))
            den = sum(float((a.float() ** 2).sum()) for p in kv for a in p)
            results.append(CodecQuality(name, prompts, prefix_tokens, float(err.mean()), float(err.max()),
                                        float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
                                        (num / den) ** 0.5))
    return results
