"""Codec quality: synthetic KV with outlier channels, and a real (tiny, random-weight) Llama.

    .venv/bin/python perf/codec_quality.py [--quick]

Writes perf/out/codec_quality.json:
* synthetic: relative L2 reconstruction error of normal KV with 4 channels x20
  (issue 4 bounds: int8 <= 1 %, fp8 <= 5 %, int4 <= 15 %), fp16 and bf16;
* model: last-token relative logit error and top-1 agreement against the
  unquantized cache, over many random prompts, for an fp32 and a bf16 model.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import ml_dtypes
import numpy as np

from kvtier.kernels import MixedPrecisionPolicy, get_codec
from kvtier.kernels.quality import TINY_LLAMA, measure, tiny_llama

CODECS = ["raw", "int8", "fp8", "int4", "mixed"]
BOUNDS = {"int8": 0.01, "fp8": 0.05, "int4": 0.15}


def synthetic(shape) -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    x[..., rng.choice(shape[-1], 4, replace=False)] *= 20
    out = {}
    for dt in (np.float16, ml_dtypes.bfloat16):
        xd = x.astype(dt)
        ref = xd.astype(np.float32)
        for name in BOUNDS:
            y = np.empty_like(xd)
            get_codec(name).decode(get_codec(name).encode(xd), y)
            err = float(np.linalg.norm(y.astype(np.float32) - ref) / np.linalg.norm(ref))
            out[f"{name}/{np.dtype(dt).name}"] = {"rel_l2_error": err, "bound": BOUNDS[name], "ok": err <= BOUNDS[name]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer prompts, shorter prefix")
    ap.add_argument("--out", default="perf/out/codec_quality.json")
    args = ap.parse_args()
    prompts, prefix = (16, 64) if args.quick else (128, 256)
    policy = MixedPrecisionPolicy(raw_layers=(0, -1), min_tokens=0, base="int4")
    result = {"synthetic": synthetic((4, 2, 8, 256, 128)), "model": TINY_LLAMA,
              "mixed_policy": asdict(policy), "prompts": prompts, "prefix_tokens": prefix, "runs": {}}
    import torch

    for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        model = tiny_llama(seed=0, dtype=dtype)
        result["runs"][label] = [asdict(r) for r in measure(model, CODECS, prompts=prompts, prefix_tokens=prefix,
                                                            policy=policy)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for key, row in result["synthetic"].items():
        print(f"synthetic {key:12s} rel L2 {row['rel_l2_error']:.4%} (bound {row['bound']:.0%})")
    for label, rows in result["runs"].items():
        for r in rows:
            print(f"model {label} {r['codec']:6s} logit err mean {r['rel_logit_error_mean']:.4%} "
                  f"max {r['rel_logit_error_max']:.4%} top-1 {r['top1_agreement']:.3f} KV err {r['kv_rel_l2_error']:.4%}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
