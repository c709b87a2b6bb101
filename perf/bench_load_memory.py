"""Steady-state ``KVCache.load`` over TCP: page faults, client CPU and GB/s per GiB loaded.

    .venv/bin/python perf/bench_load_memory.py               # 1 GiB stored, 3 variants x 5 rounds
    .venv/bin/python perf/bench_load_memory.py --rounds 8

Llama-3-8B layout (32 MiB blocks), ``hot_pool_bytes=0``, 8192-token requests (1 GiB
each); the blocks are stored once (buffered) and flushed, then loaded by three caches in
turn, round after round, in one run (the daemon serves them from its page cache: this
measures the client's side, not the disk):

- ``fresh``: no output pool (``output_buffers_bytes=0``: every load's output is fresh,
  zero-filled memory) and no scatter (replies land in reply buffers, then are copied):
  what a load did before the pool and the scatter;
- ``pool``: pooled, pre-faulted outputs; replies still copied;
- ``pool+scatter``: pooled outputs, raw blocks received straight into them.

Each variant's first round warms its buffers; the median of the rest is reported:
minor page faults of this process (``getrusage``), client CPU and GB/s, per GiB. Each
load's result is dropped before the next, as an engine does once it used the KV. The
last round of each variant is checked byte for byte.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "perf"))

from daemon_proc import start_kvtierd  # noqa: E402
from lmcache_side import make_request  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 256
REQUEST_TOKENS = 8192
SEED = 20261201


def load_round(cache, reqs, layout) -> dict:
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu0, wall0 = time.process_time(), time.perf_counter()
    loaded = 0
    for tokens, _kv in reqs:
        got = cache.load(tokens)
        assert got.num_tokens == REQUEST_TOKENS, got.num_tokens
        loaded += got.num_blocks * layout.block_raw_bytes
        del got
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    return {"bytes": loaded, "gb_per_s": loaded / wall / 1e9, "client_cpu_s_per_gib": cpu * GiB / loaded,
            "minor_faults_per_gib": faults * GiB / loaded}


def check_round(cache, reqs) -> None:
    import torch

    for tokens, kv in reqs:
        got = cache.load(tokens)
        for (k, v), (k2, v2) in zip(kv, got.layers):
            assert torch.equal(k.view(torch.int16), k2.view(torch.int16))
            assert torch.equal(v.view(torch.int16), v2.view(torch.int16))
        del got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes stored (whole 1 GiB requests, at least one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="JSON path (printed otherwise)")
    args = ap.parse_args(argv)
    from kvtier.client.kvcache import KVCache
    from kvtier.common.keys import KVLayout, Namespace

    layout = KVLayout(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float16",
                      block_tokens=BLOCK_TOKENS)
    ns = Namespace("llama-3-8b-load-memory", layout)
    request_bytes = REQUEST_TOKENS * layout.block_raw_bytes // BLOCK_TOKENS
    requests = max(1, args.total_mib * MiB // request_bytes)
    variants = {"fresh": {"output_buffers_bytes": 0}, "pool": {}, "pool+scatter": {}}
    rounds: dict[str, list] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as work:
        d = start_kvtierd(Path(work), "--device-size", f"{max(512, requests * request_bytes // 2 // MiB)}m",
                          "--region-size", "128m", "--stripe-size", "1m")
        try:
            reqs = [make_request(SEED, i, REQUEST_TOKENS, LAYERS, KV_HEADS, HEAD_DIM) for i in range(requests)]
            caches = {name: KVCache(ns, d.data_addr, hot_pool_bytes=0, transport="tcp", pool_size=4, **kw)
                      for name, kw in variants.items()}
            try:
                for name in ("fresh", "pool"):  # replies copied out of the reply buffers, as before the scatter
                    caches[name]._decoder.landing = lambda out, first: None
                for tokens, kv in reqs:
                    caches["pool+scatter"].store(tokens, kv)
                caches["pool+scatter"].flush()
                for _ in range(args.rounds):
                    for name, cache in caches.items():
                        rounds[name].append(load_round(cache, reqs, layout))
                for cache in caches.values():
                    check_round(cache, reqs)
            finally:
                for cache in caches.values():
                    cache.close()
        finally:
            d.stop()
    result = {"total_bytes": requests * request_bytes, "rounds": rounds, "steady_median": {},
              "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    for name, runs in rounds.items():
        steady = runs[1:] or runs
        result["steady_median"][name] = {key: sorted(r[key] for r in steady)[len(steady) // 2]
                                         for key in ("gb_per_s", "client_cpu_s_per_gib", "minor_faults_per_gib")}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps(result["steady_median"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
