"""GETs of small blocks, where a request's fixed cost shows: latency and daemon CPU per GET.

    .venv/bin/python perf/bench_get_small.py [--requests 3000] [--keys 32] [--block-kib 4]

A kvtierd on 4 device files; one BlockClient stores ``--keys`` x 64 blocks of ``--block-kib`` KiB,
flushes, restarts the daemon (blocks on flash) and reads every block once (warm); then GETs
``--keys`` blocks a request, ``--requests`` times, one connection, ``reader_verifies`` as the client
asks by default. Reports the p50 / p99 latency a GET takes and the daemon's CPU microseconds per GET
(utime + stime from /proc over the timed phase). The reference in the same run: PING round trips on
the same connection (the protocol's floor). Writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import start_kvtierd  # noqa: E402

from kvtier.client import BlockClient  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402

NS = b"\x47" * 16
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def percentile_us(samples: list[float], q: float) -> float:
    return sorted(samples)[min(len(samples) - 1, int(q * len(samples)))] * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--keys", type=int, default=32, help="keys per GET")
    ap.add_argument("--block-kib", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "perf" / "out" / "get_small.json")
    args = ap.parse_args()
    payload = os.urandom(args.block_kib * 1024 - 64)
    keys = [i.to_bytes(8, "little") + b"get-smal" for i in range(args.keys * 64)]
    with tempfile.TemporaryDirectory(dir="/var/tmp") as work:
        daemon = start_kvtierd(work, "--device-size", "256m", "--region-size", "16m")
        try:
            with BlockClient(daemon.data_addr, pool_size=1) as c:
                c.put_many([(k, encode_block(k, NS, 0, payload)) for k in keys], ns_id=NS)
                c.flush()
            daemon.restart()
            with BlockClient(daemon.data_addr, pool_size=1) as c:
                assert all(b is not None for b in c.get_many(keys, ns_id=NS))  # warm: every block read once
                pings = []
                for _ in range(args.requests):
                    started = time.perf_counter()
                    c.ping()
                    pings.append(time.perf_counter() - started)
                gets = []
                before = cpu_s(daemon.proc.pid)
                for r in range(args.requests):
                    chunk = keys[(r * args.keys) % len(keys):][:args.keys]
                    started = time.perf_counter()
                    got = c.get_many(chunk, ns_id=NS, copy=False)
                    gets.append(time.perf_counter() - started)
                    assert all(b is not None for b in got)
                daemon_cpu = cpu_s(daemon.proc.pid) - before
        finally:
            daemon.stop()
    doc = {"requests": args.requests, "keys_per_get": args.keys, "block_bytes": args.block_kib * 1024,
           "get_p50_us": round(percentile_us(gets, 0.5), 1), "get_p99_us": round(percentile_us(gets, 0.99), 1),
           "get_mean_us": round(statistics.mean(gets) * 1e6, 1),
           "daemon_cpu_us_per_get": round(daemon_cpu / args.requests * 1e6, 1),
           "ping_p50_us": round(percentile_us(pings, 0.5), 1), "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
