"""Codec quality on a real (tiny, random-weight) Llama: logit error and top-1 agreement bounds."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvtier.kernels import MixedPrecisionPolicy  # noqa: E402
from kvtier.kernels.quality import measure, tiny_llama  # noqa: E402

# bounds ~3x above the figures measured with perf/codec_quality.py (int8 0.17 %, fp8 0.75 %, int4 2.6 %)
LOGIT_ERROR_MAX = {"raw": 0.0, "int8": 0.006, "fp8": 0.025, "int4": 0.08, "mixed": 0.08}
TOP1_MIN = {"raw": 1.0, "int8": 0.9, "fp8": 0.9, "int4": 0.75, "mixed": 0.75}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def test_cached_prefix_reproduces_the_full_forward(model):
    from transformers import DynamicCache

    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, -1]
        pre = model(input_ids=ids[:, :-1], use_cache=True)
        cache = getattr(pre, "cache", None) or pre.past_key_values
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        step = model(input_ids=ids[:, -1:], cache=DynamicCache(ddp_cache_data=kv)).logits[:, -1]
    assert torch.allclose(full, step, atol=1e-4, rtol=1e-4)


def test_codec_logit_error_and_top1(model):
    policy = MixedPrecisionPolicy(raw_layers=(0, -1), min_tokens=0, base="int4")
    results = measure(model, list(LOGIT_ERROR_MAX), prompts=8, prefix_tokens=48, policy=policy)
    for r in results:
        print(r)
        assert r.rel_logit_error_mean <= LOGIT_ERROR_MAX[r.codec], r
        assert r.top1_agreement >= TOP1_MIN[r.codec], r
    by_name = {r.codec: r for r in results}
    assert by_name["raw"].kv_rel_l2_error == 0.0
    # keeping the first and last layers raw must help int4
    assert by_name["mixed"].rel_logit_error_mean < by_name["int4"].rel_logit_error_mean
    assert 0 < by_name["int8"].rel_logit_error_mean < by_name["fp8"].rel_logit_error_mean < by_name["int4"].rel_logit_error_mean
