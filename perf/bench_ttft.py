#!/usr/bin/env python3
"""TTFT benchmark: recompute vs load-from-kvtier on a real (random-weight) Llama.

    .venv/bin/python perf/bench_ttft.py [--quick] [--out perf/out/ttft.json]

Prompts of 2048 tokens of which the first 1792 are stored. For each prompt,
in one run and interleaved (so machine noise hits every variant alike):

  (a) full      prefill of all 2048 tokens
  (b) ideal     prefill of the 256-token suffix, the prefix KV already in an
                in-memory DynamicCache (no I/O at all)
  (c) kvtier    lookup + load from a real kvtierd + DynamicCache + suffix prefill,
                by TCP and by direct device read (O_DIRECT on the daemon's
                device files, every block validated); hot pool off, so every
                load comes from the daemon
  (d) hot       the same with the blocks already in the client's hot pool: it
                does (b)'s work plus a few ms, so its spread around (b) shows
                the machine's noise floor

(b), (c) and (d) run ``--rounds`` times per prompt in rotating order and
each keeps its fastest round. TTFT is the time to the first token's logits.

Goals (issue 5): (c) <= 1.15 x (b) and (c) <= 0.3 x (a). Reported four
ways: the ratio of medians over prompts; the median of per-prompt ratios (a
prompt's variants run back to back, so slow drift of a shared machine
cancels); best-of (the fastest sample of each, the least disturbed); and the
I/O share alone, ((b) + median lookup + load) / (b), since (c) runs exactly
(b)'s suffix prefill. The JSON has every sample.

The model: a LlamaForCausalLM from a LlamaConfig (no download), fp32 on
CPU; the default size (8 layers, hidden 512, 8 query heads and 2 KV heads
of 64, MLP 1536) gives 8 KiB of KV per token, about 15x more KV per FLOP
than Llama-3-8B - so loading is, if anything, harder here than on a real model.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # daemon_proc: the same daemon launcher the tests use

from daemon_proc import start_kvtierd  # noqa: E402
from kvtier.client.engines.transformers import cache_from_layers, layers_of_cache, namespace_for  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.daemon.engine.superblock import decode_superblock  # noqa: E402

GOAL_VS_IDEAL = 1.15
GOAL_VS_FULL = 0.30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 prompts, one warm-up: checks the script works")
    p.add_argument("--prompts", type=int, default=6, help="measured prompts (each a fresh prefix)")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each suffix variant per prompt, in rotating order; the fastest counts")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--stored-tokens", type=int, default=1792)
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--codec", default="raw")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (0: torch's default). 1 by default: on a shared, oversubscribed host "
                        "an OpenMP team waits on its slowest thread and timings scatter 2-3x")
    p.add_argument("--out", default=str(ROOT / "perf" / "out" / "ttft.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.prompts = min(args.prompts, 2)
    if args.stored_tokens % args.block_tokens or not 0 < args.stored_tokens < args.prompt_tokens:
        p.error("--stored-tokens must be a positive multiple of --block-tokens below --prompt-tokens")
    return args


def build_model(args) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt_tokens * 2)
    return LlamaForCausalLM(config).eval()


def device_map_of(data_dir: Path) -> dict[str, str]:
    out = {}
    for path in sorted(data_dir.glob("device*.img")):
        with open(path, "rb") as f:
            out[decode_superblock(f.read(4096)).device_uuid.hex()] = str(path)
    return out


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def run_full(model, ids):
    with torch.inference_mode():
        return model(ids, cache=DynamicCache(), use_cache=True, logits_to_keep=1)


def run_ideal(model, ids, prefix_layers, stored):
    cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in prefix_layers])
    with torch.inference_mode():
        started = time.perf_counter()
        out = model(ids[:, stored:], cache=cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - started, out.logits[:, -1]


def run_kvtier(model, ids, kvcache: KVCache, prompt_tokens: int) -> dict:
    """lookup + load + DynamicCache + suffix prefill, with its parts timed."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        tokens = ids[0].tolist()
        found = kvcache.lookup(tokens)
        t1 = time.perf_counter()
        loaded = kvcache.load(tokens, max_tokens=min(found, prompt_tokens - 1))
        cache = cache_from_layers(loaded.layers)  # no copy (see its doc)
        t2 = time.perf_counter()
        out = model(ids[:, loaded.num_tokens:], cache=cache, use_cache=True, logits_to_keep=1)
        t3 = time.perf_counter()
    return {"ttft_s": t3 - t0, "lookup_s": t1 - t0, "load_s": t2 - t1, "prefill_s": t3 - t2,
            "loaded_tokens": loaded.num_tokens, "transports": dict(loaded.transports),
            "blocks_hot": loaded.blocks_hot, "logits": out.logits[:, -1]}


def median(xs):
    return statistics.median(xs) if xs else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    ns = namespace_for(model, f"bench/llama-random-{args.layers}x{args.hidden}", args.block_tokens, args.codec)
    kv_bytes_per_token = ns.layout.block_raw_bytes // args.block_tokens
    gen = torch.Generator().manual_seed(1234)
    variants = ["full", "ideal", "kvtier_tcp", "kvtier_direct", "kvtier_hot"]
    samples: dict[str, list] = {v: [] for v in variants}
    parts: dict[str, list] = {v: [] for v in variants[2:]}
    exact = {v: [] for v in variants[2:]}
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        stored_mib = args.stored_tokens * kv_bytes_per_token * (args.prompts + 1) / 2**20
        device_mib = max(64, int(stored_mib / 4 * 2) + 32)  # 4 device files, half full at the end
        daemon = start_kvtierd(Path(tmp) / "kvtierd", "--device-size", f"{device_mib}m",
                               "--region-size", "8m", "--stripe-size", "1m")
        try:
            dmap = device_map_of(daemon.data_dir)
            tcp = KVCache(ns, daemon.data_addr, hot_pool_bytes=0, transport="tcp")
            direct = KVCache(ns, daemon.data_addr, hot_pool_bytes=0, transport="direct", device_map=dmap)
            hot = KVCache(ns, daemon.data_addr, transport="tcp",
                          hot_pool_bytes=2 * args.stored_tokens * kv_bytes_per_token)
            direct_backend = direct._daemons[0].reader.statistics()
            try:
                for i in range(args.prompts + 1):  # prompt 0 warms up every path, not measured
                    ids = torch.randint(0, args.vocab, (1, args.prompt_tokens), generator=gen)
                    t_full, out = timed(lambda: run_full(model, ids))
                    full_layers = layers_of_cache(out.cache)
                    prefix = [(k[:, :, :args.stored_tokens].contiguous(), v[:, :, :args.stored_tokens].contiguous())
                              for k, v in full_layers]
                    # store the prefix (as an earlier request would have) and seal it
                    tcp.store(ids[0, :args.stored_tokens].tolist(), prefix)
                    tcp.flush()
                    hot.load(ids[0].tolist(), max_tokens=args.stored_tokens)  # into the hot pool
                    best: dict = {}
                    for rnd in range(args.rounds):  # rotate the order; keep each variant's fastest round
                        order = ["ideal", "kvtier_tcp", "kvtier_direct", "kvtier_hot"]
                        order = order[rnd % 4:] + order[:rnd % 4]
                        for name in order:
                            if name == "ideal":
                                t, logits = run_ideal(model, ids, prefix, args.stored_tokens)
                                r = {"ttft_s": t, "logits": logits}
                            else:
                                r = run_kvtier(model, ids, {"kvtier_tcp": tcp, "kvtier_direct": direct,
                                                            "kvtier_hot": hot}[name], args.prompt_tokens)
                            if name not in best or r["ttft_s"] < best[name]["ttft_s"]:
                                best[name] = r
                    t_ideal, ideal_logits = best["ideal"]["ttft_s"], best["ideal"]["logits"]
                    r_tcp, r_direct, r_hot = best["kvtier_tcp"], best["kvtier_direct"], best["kvtier_hot"]
                    for name, r in (("kvtier_tcp", r_tcp), ("kvtier_direct", r_direct), ("kvtier_hot", r_hot)):
                        assert r["loaded_tokens"] == args.stored_tokens, (name, r["loaded_tokens"])
                    assert r_direct["transports"] == {"direct": args.stored_tokens // args.block_tokens}, r_direct
                    assert r_hot["blocks_hot"] == args.stored_tokens // args.block_tokens, r_hot
                    if i == 0:
                        continue
                    samples["full"].append(t_full)
                    samples["ideal"].append(t_ideal)
                    for name, r in (("kvtier_tcp", r_tcp), ("kvtier_direct", r_direct), ("kvtier_hot", r_hot)):
                        logits = r.pop("logits")
                        exact[name].append(bool(torch.equal(logits, ideal_logits)))
                        samples[name].append(r["ttft_s"])
                        parts[name].append(r)
                    print(f"prompt {i}: full {t_full * 1e3:.0f} ms  ideal {t_ideal * 1e3:.0f} ms  "
                          f"tcp {r_tcp['ttft_s'] * 1e3:.0f} ms (load {r_tcp['load_s'] * 1e3:.1f})  "
                          f"direct {r_direct['ttft_s'] * 1e3:.0f} ms (load {r_direct['load_s'] * 1e3:.1f})  "
                          f"hot {r_hot['ttft_s'] * 1e3:.0f} ms (load {r_hot['load_s'] * 1e3:.1f})", flush=True)
                stats = {name: c.statistics().as_dict() for name, c in
                         (("kvtier_tcp", tcp), ("kvtier_direct", direct), ("kvtier_hot", hot))}
                direct_reader = direct._daemons[0].reader.statistics()
            finally:
                for c in (tcp, direct, hot):
                    c.close()
        finally:
            daemon.stop()

    med = {v: median(samples[v]) for v in variants}
    load_bytes = args.stored_tokens * kv_bytes_per_token
    result = {
        "benchmark": "ttft",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "model": {"kind": "LlamaForCausalLM (random weights)", "layers": args.layers, "hidden": args.hidden,
                  "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.hidden // args.heads,
                  "intermediate": args.intermediate, "vocab": args.vocab, "dtype": "float32",
                  "params": sum(p.numel() for p in model.parameters())},
        "prompt_tokens": args.prompt_tokens, "stored_tokens": args.stored_tokens,
        "block_tokens": args.block_tokens, "codec": args.codec, "prompts": args.prompts, "rounds": args.rounds,
        "kv_bytes_per_token": kv_bytes_per_token, "prefix_kv_bytes": load_bytes,
        "direct_backend": direct_backend.backend, "direct_o_direct": direct_backend.o_direct,
        "ttft_s_median": med,
        "ttft_s_samples": samples,
        "ratios": {},
        "load_s_median": {n: median([p["load_s"] for p in parts[n]]) for n in parts},
        "lookup_s_median": {n: median([p["lookup_s"] for p in parts[n]]) for n in parts},
        "suffix_prefill_s_median": {n: median([p["prefill_s"] for p in parts[n]]) for n in parts},
        "load_bytes_per_s_median": {n: (load_bytes / m if m else None) for n, m in
                                    ((n, median([p["load_s"] for p in parts[n]])) for n in parts)},
        "logits_bitwise_equal_to_ideal": {n: all(exact[n]) for n in exact},
        "client_statistics": stats,
        "direct_reader": {"blocks_read": direct_reader.blocks_read, "bytes_read": direct_reader.bytes_read,
                          "validation_failures": direct_reader.validation_failures},
        "goals": {"vs_ideal_max": GOAL_VS_IDEAL, "vs_full_max": GOAL_VS_FULL},
    }
    for name in ("kvtier_tcp", "kvtier_direct", "kvtier_hot"):
        vs_ideal = med[name] / med["ideal"]
        vs_full = med[name] / med["full"]
        # the same prompt's variants ran back to back: per-prompt ratios cancel slow drift
        paired_ideal = median([c / b for c, b in zip(samples[name], samples["ideal"])])
        paired_full = median([c / a for c, a in zip(samples[name], samples["full"])])
        # (c) does the suffix prefill of (b) plus lookup + load: the I/O's share, free of prefill noise
        io_s = median([p["lookup_s"] + p["load_s"] for p in parts[name]])
        best = min(samples[name])
        result["ratios"][name] = {
            "vs_ideal": vs_ideal, "vs_full": vs_full, "ttft_reduction_vs_full": 1 - vs_full,
            "vs_ideal_best_of": best / min(samples["ideal"]), "vs_full_best_of": best / min(samples["full"]),
            "vs_ideal_paired_median": paired_ideal, "vs_full_paired_median": paired_full,
            "vs_ideal_io_only": (med["ideal"] + io_s) / med["ideal"],
            "meets_vs_ideal": vs_ideal <= GOAL_VS_IDEAL, "meets_vs_full": vs_full <= GOAL_VS_FULL,
            "meets_vs_ideal_paired": paired_ideal <= GOAL_VS_IDEAL, "meets_vs_full_paired": paired_full <= GOAL_VS_FULL}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmodel {args.layers} layers x hidden {args.hidden} (GQA {args.heads}:{args.kv_heads}), fp32 CPU; "
          f"prefix {args.stored_tokens} of {args.prompt_tokens} tokens = {load_bytes / 2**20:.1f} MiB of KV; "
          f"medians over {args.prompts} prompts")
    print(f"  (a) full prefill   {med['full'] * 1e3:8.1f} ms")
    print(f"  (b) ideal suffix   {med['ideal'] * 1e3:8.1f} ms")
    for name in ("kvtier_tcp", "kvtier_direct", "kvtier_hot"):
        r = result["ratios"][name]
        print(f"  (c) {name:<14} {med[name] * 1e3:8.1f} ms   load {result['load_s_median'][name] * 1e3:6.1f} ms  "
              f"{r['vs_ideal']:.3f}x ideal ({'ok' if r['meets_vs_ideal'] else 'MISS'}; paired "
              f"{r['vs_ideal_paired_median']:.3f}x, best-of {r['vs_ideal_best_of']:.3f}x, "
              f"I/O only {r['vs_ideal_io_only']:.3f}x)  "
              f"{r['vs_full']:.3f}x full ({'ok' if r['meets_vs_full'] else 'MISS'}; paired "
              f"{r['vs_full_paired_median']:.3f}x)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
