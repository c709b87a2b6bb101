"""kvtierd's CPU while NIXL clients are connected and idle, against the same daemon with none.

    .venv/bin/python perf/bench_nixl_idle.py [--clients 8] [--seconds 10]

Steps, in one run: a kvtierd with its NIXL agent; its CPU over ``--seconds`` with no client
(the reference); then ``--clients`` processes, each a ``KVCache(transport="nixl")`` that stores
and loads one 2 MiB block through NIXL and then holds its connections open, idle; the daemon's
CPU over ``--seconds`` again; then each client's own CPU over the same window. Prints a table
and writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from nixl_daemon import LOOPBACK_ENV, start_nixl_daemon  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")

CLIENT = r"""
import sys, time
import torch
from kvtier.client.kvcache import KVCache
from kvtier.common.keys import KVLayout, Namespace

ns = Namespace("idle-bench", KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=256, dtype="float16"))
with KVCache(ns, sys.argv[1], hot_pool_bytes=0, transport="nixl") as cache:
    tokens = list(range(int(sys.argv[2]) * 1000, int(sys.argv[2]) * 1000 + 256))
    kv = [(torch.randn(1, 8, 256, 128).half(), torch.randn(1, 8, 256, 128).half()) for _ in range(4)]
    cache.store(tokens, kv)
    loaded = cache.load(tokens)
    assert loaded.num_tokens == 256 and loaded.transports.get("nixl") == 1, loaded.transports
    print("ready", flush=True)
    sys.stdin.read()  # idle, connected, until the benchmark closes our stdin
"""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def percent_over(pids: list[int], seconds: float) -> list[float]:
    before = [cpu_s(pid) for pid in pids]
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    return [100 * (cpu_s(pid) - b) / wall for pid, b in zip(pids, before)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=ROOT / "perf" / "out" / "nixl_idle.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        daemon = start_nixl_daemon(work)
        clients: list[subprocess.Popen] = []
        try:
            print(f"daemon alone, {args.seconds:g} s", file=sys.stderr, flush=True)
            alone = percent_over([daemon.proc.pid], args.seconds)[0]
            env = {**os.environ, **LOOPBACK_ENV}
            for i in range(args.clients):
                print(f"client {i + 1}/{args.clients}: store and load one block through NIXL", file=sys.stderr,
                      flush=True)
                child = subprocess.Popen([sys.executable, "-c", CLIENT, daemon.data_addr, str(i)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
                clients.append(child)
                line = child.stdout.readline()
                if line.strip() != b"ready":
                    raise RuntimeError(f"client {i} failed: {line!r}")
            print(f"{args.clients} clients connected and idle, {args.seconds:g} s", file=sys.stderr, flush=True)
            shares = percent_over([daemon.proc.pid] + [c.pid for c in clients], args.seconds)
        finally:
            for child in clients:
                child.stdin.close()
            for child in clients:
                child.wait(30)
            daemon.stop()
    doc = {"clients": args.clients, "seconds": args.seconds, "daemon_alone_cpu_pct": round(alone, 3),
           "daemon_with_clients_cpu_pct": round(shares[0], 3),
           "client_cpu_pct_max": round(max(shares[1:]), 3) if clients else None,
           "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print("| daemon CPU, no client | daemon CPU, clients idle | clients | client CPU, idle, max |")
    print("| --- | --- | --- | --- |")
    print(f"| {doc['daemon_alone_cpu_pct']} % | {doc['daemon_with_clients_cpu_pct']} % | {args.clients} | "
          f"{doc['client_cpu_pct_max']} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
