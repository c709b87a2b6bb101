"""CPU codec throughput vs numpy.copyto, and where lz4 pays. Writes perf/out/codecs.json.

    .venv/bin/python perf/bench_codecs.py --quick

Throughput is GB/s of fp16 *input* bytes (encode: x -> payload, into a reused
buffer with ``encode_into``, as copyto writes a preallocated array; the
allocating ``encode()`` is reported too; decode: payload -> preallocated out). The reference, numpy.copyto of the same bytes into a
preallocated array, is measured in the same run, interleaved with the codecs;
ratios are what to quote (absolute numbers move with machine load).
Each figure is the best of ``--repeats`` runs.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import lz4.block
import numpy as np

from kvtier.kernels import get_codec
from kvtier.kernels.lz4stage import frame_mode, shuffle2

CODECS = ["raw", "int8", "fp8", "int4"]
MODE_NAMES = {0: "stored", 1: "lz4", 2: "shuffle2+lz4"}


def best_time_s(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def kv_block(shape, seed=0, outliers=4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    x[..., rng.choice(shape[-1], outliers, replace=False)] *= 20
    return x.astype(np.float16)


def throughput(x: np.ndarray, repeats: int) -> dict:
    dst = np.empty_like(x)
    rows = {}
    copy_s = []
    for name in CODECS:
        codec = get_codec(name)
        copy_s.append(best_time_s(lambda: np.copyto(dst, x), repeats))
        data = codec.encode(x)
        buf = bytearray(codec.encoded_size(x))
        enc = best_time_s(lambda: codec.encode_into(x, buf), repeats)
        enc_alloc = best_time_s(lambda: codec.encode(x), repeats)
        dec = best_time_s(lambda: codec.decode(data, dst), repeats)
        rows[name] = {"encode_GBps": x.nbytes / enc / 1e9, "decode_GBps": x.nbytes / dec / 1e9,
                      "encode_allocating_GBps": x.nbytes / enc_alloc / 1e9, "payload_ratio": len(data) / x.nbytes}
    copy = x.nbytes / min(copy_s) / 1e9
    for row in rows.values():
        row["encode_vs_copy"] = row["encode_GBps"] / copy
        row["decode_vs_copy"] = row["decode_GBps"] / copy
    return {"copyto_GBps": copy, "codecs": rows}


def lz4_ratios(shape) -> dict:
    """Compressed/original size for each data kind and codec; plus raw lz4 with and without shuffle."""
    normal = kv_block(shape, seed=1)
    padded = normal.copy()
    padded[..., shape[-2] * 5 // 8:, :] = 0  # a partly filled block: last 3/8 of the tokens unused
    smooth = (np.random.default_rng(2).standard_normal(shape) * 0.05 + 1.0).astype(np.float16)
    out = {}
    for kind, x in [("normal_outliers", normal), ("padded_3of8", padded), ("smooth_offset", smooth)]:
        row = {"lz4_plain_raw": len(lz4.block.compress(x.tobytes(), store_size=False)) / x.nbytes,
               "lz4_shuffled_raw": len(lz4.block.compress(shuffle2(x.tobytes()), store_size=False)) / x.nbytes}
        for name in CODECS:
            plain = get_codec(name).encode(x)
            packed = get_codec(name + "+lz4").encode(x)
            row[name + "+lz4"] = {"vs_codec": len(packed) / len(plain), "vs_fp16": len(packed) / x.nbytes,
                                  "mode": MODE_NAMES[frame_mode(packed)]}
        out[kind] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small block, few repeats (seconds)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default="perf/out/codecs.json")
    args = ap.parse_args()
    # [layers, kv, kv_heads, tokens, head_dim]: one 256-token storage block of an 8-KV-head, 128-dim model
    shape = (4, 2, 8, 256, 128) if args.quick else (32, 2, 8, 256, 128)
    repeats = args.repeats or (3 if args.quick else 7)
    x = kv_block(shape)
    result = {"shape": shape, "dtype": "float16", "input_bytes": x.nbytes, "repeats": repeats,
              "machine": platform.processor() or platform.machine(), **throughput(x, repeats),
              "lz4": lz4_ratios((8, 2, 4, 256, 128) if args.quick else (32, 2, 8, 256, 128))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"block {shape} fp16, {x.nbytes / 1e6:.1f} MB; numpy.copyto {result['copyto_GBps']:.2f} GB/s (reference)")
    print(f"{'codec':6s} {'enc GB/s':>9s} {'x copy':>7s} {'dec GB/s':>9s} {'x copy':>7s} {'size':>6s} "
          f"{'encode() GB/s':>14s}")
    for name, row in result["codecs"].items():
        print(f"{name:6s} {row['encode_GBps']:9.3f} {row['encode_vs_copy']:7.3f} {row['decode_GBps']:9.3f} "
              f"{row['decode_vs_copy']:7.3f} {row['payload_ratio']:6.3f} {row['encode_allocating_GBps']:14.3f}")
    for kind, row in result["lz4"].items():
        cells = ", ".join(f"{k} {v['vs_codec']:.3f} ({v['mode']})" for k, v in row.items() if isinstance(v, dict))
        print(f"lz4 {kind}: raw plain {row['lz4_plain_raw']:.3f}, raw shuffled {row['lz4_shuffled_raw']:.3f}; {cells}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
