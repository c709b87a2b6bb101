"""The time a save adds to an engine step: synchronous ``store`` against write-behind
``store_async`` (the copy-out only) and write-behind of held KV (``copy=False``: the
engine keeps the KV unchanged until the save is done, so the step only enqueues), the
same blocks, the same daemon, one run.

    .venv/bin/python perf/bench_save_step.py [--requests N] [--tokens T]

A real kvtierd on device files under /var/tmp; the Llama-3-8B layout (32 layers, 8 KV
heads, head dim 128, fp16) in 256-token blocks; each "step" saves one request's new KV
(T tokens, buffered puts, as the vLLM connector does). Reported per variant: the median
time the call holds the step, and for write-behind also the time until the background
save finished, with its drops; the ratio write-behind / synchronous is the goal's figure.
Prints a table and writes perf/results/<UTC date>/save_step.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import start_kvtierd  # noqa: E402


def main(argv=None) -> int:
    import torch

    from kvtier.client.kvcache import KVCache
    from kvtier.common.keys import KVLayout, Namespace

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=12, help="steps per variant")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens saved per step (whole 256-token blocks)")
    ap.add_argument("--out", help="JSON path (default perf/results/<UTC date>/save_step.json)")
    args = ap.parse_args(argv)
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)
    work = Path(tempfile.mkdtemp(prefix="kvtier-save-step-", dir="/var/tmp"))
    daemon = start_kvtierd(work, "--device-size", "2g", "--region-size", "64m", "--stripe-size", "1m")
    try:
        gen = torch.Generator().manual_seed(0)
        kv = [tuple(torch.randn(1, 8, args.tokens, 128, generator=gen).half() for _ in range(2)) for _ in range(32)]
        nbytes = args.tokens // 256 * layout.block_raw_bytes
        result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                        "tokens_per_step": args.tokens, "bytes_per_step": nbytes, "steps": args.requests}
        for variant in ("sync", "write_behind", "write_behind_held"):
            namespace = Namespace(f"save-step-{variant}", layout)
            held, finished = [], []
            with KVCache(namespace, daemon.data_addr, hot_pool_bytes=0, transport="tcp") as cache:
                for step in range(args.requests + 1):  # step 0 warms buffers and connections
                    tokens = list(range(step * 100_000, step * 100_000 + args.tokens))
                    t0 = time.perf_counter()
                    if variant == "sync":
                        cache.store(tokens, kv)
                        t1 = t2 = time.perf_counter()
                    else:
                        # held: the engine keeps this KV unchanged until the save is done (no copy-out)
                        future = cache.store_async(tokens, kv, copy=variant == "write_behind")
                        t1 = time.perf_counter()
                        future.result(120)
                        t2 = time.perf_counter()
                    if step:
                        held.append(t1 - t0)
                        finished.append(t2 - t0)
                saves = cache.statistics().saves
            result[variant] = {"step_held_ms_median": statistics.median(held) * 1e3,
                               "step_held_ms": [h * 1e3 for h in held],
                               "saved_ms_median": statistics.median(finished) * 1e3,
                               "saves_dropped": saves.saves_dropped}
            print(f"{variant:13s} step held {statistics.median(held) * 1e3:8.1f} ms   "
                  f"saved after {statistics.median(finished) * 1e3:8.1f} ms   ({nbytes / 2**20:.0f} MiB a step)",
                  flush=True)
        result["write_behind_vs_sync_step_time"] = (result["write_behind"]["step_held_ms_median"]
                                                    / result["sync"]["step_held_ms_median"])
        result["write_behind_held_vs_sync_step_time"] = (result["write_behind_held"]["step_held_ms_median"]
                                                         / result["sync"]["step_held_ms_median"])
        print(f"write-behind holds the step {result['write_behind_vs_sync_step_time']:.3f}x as long as a "
              f"synchronous store; held KV (copy=False) {result['write_behind_held_vs_sync_step_time']:.4f}x",
              flush=True)
        out = Path(args.out) if args.out else ROOT / "perf" / "results" / time.strftime("%Y-%m-%d", time.gmtime()) \
            / "save_step.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    finally:
        assert daemon.stop() == 0, daemon.log_tail()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
