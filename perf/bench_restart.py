"""A real kvtierd with millions of small blocks: its RSS per stored block, and a restart
with tombstones and pins.

    .venv/bin/python perf/bench_restart.py                  # 10 M blocks, 1 M deleted, 100 k pinned
    .venv/bin/python perf/bench_restart.py --blocks 1000000 --deleted 100000 --pinned 10000

1. kvtierd on sparse device files under /var/tmp (4 x ``--device-size``, 64 MiB regions).
   Its RSS (``VmRSS``) after the first 102 400 64-byte blocks PUT over TCP (batches of 4096,
   buffered; by then its working set -- the open region's images, the arenas -- is touched),
   then after every million: the RSS growth per stored block from there to 1 M and to the end.
2. DELETE of ``--deleted`` of them and PIN of ``--pinned`` others (their records are summary
   entries), FLUSH, SIGTERM.
3. Restart: the time from exec to the ready line, the daemon's recovery time, and the peak RSS
   of the new process (``VmHWM`` at ready) against its RSS once it serves (``VmRSS``).
   A sample of the keys is checked: the deleted ones absent, the pinned and the others present.

Writes perf/results/<UTC date>/restart.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import start_kvtierd  # noqa: E402

from kvtier.client.block_client import BlockClient  # noqa: E402
from kvtier.common.blockformat import encode_header  # noqa: E402

PAYLOAD = bytes(64)
NS = bytes(16)
BATCH = 4096
SAMPLE = 2000  # keys of each kind checked after the restart
WARM_BLOCKS = 102_400  # the RSS growth counts from here: the open region's images and the arenas are touched by then
MILLION = 1_000_000


def progress(msg: str) -> None:
    print(f"[bench_restart {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def keys_of(start: int, count: int) -> list[bytes]:
    """Block keys ``start .. start+count`` (distinct, spread: a counter through a fixed mix)."""
    ids = np.arange(start, start + count, dtype=np.uint64)
    mixed = (ids * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0xD1B54A32D192ED03)
    return np.stack([mixed, ids + np.uint64(1)], axis=1).view("V16").ravel().tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=10 * MILLION)
    ap.add_argument("--deleted", type=int, default=MILLION)
    ap.add_argument("--pinned", type=int, default=100_000)
    ap.add_argument("--device-size", default="1g", help="each of kvtierd's 4 device files (sparse)")
    ap.add_argument("--out", help="JSON path (default perf/results/<UTC date>/restart.json)")
    args = ap.parse_args(argv)
    if args.deleted + args.pinned > args.blocks:
        ap.error("--deleted + --pinned must not exceed --blocks")
    work = Path(tempfile.mkdtemp(prefix="kvtier-restart-", dir="/var/tmp"))
    d = start_kvtierd(work, "--device-size", args.device_size, "--region-size", "64m", "--stripe-size", "1m",
                      "--pinned-fraction-max", "1.0")
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                    "blocks": args.blocks, "deleted": args.deleted, "pinned": args.pinned,
                    "block_bytes": 64 + len(PAYLOAD), "rss_kib": {}}
    try:
        client = BlockClient(d.data_addr, pool_size=2)
        time.sleep(0.5)
        rss_empty = status_kib(d.pid, "VmRSS")
        result["rss_kib"]["0"] = rss_empty
        t0 = time.perf_counter()
        for start in range(0, args.blocks, BATCH):
            keys = keys_of(start, min(BATCH, args.blocks - start))
            client.put_many([(k, encode_header(k, NS, 0, PAYLOAD) + PAYLOAD) for k in keys])
            done = start + len(keys)
            if done // MILLION != start // MILLION or done == args.blocks or done == WARM_BLOCKS:
                rss = status_kib(d.pid, "VmRSS")
                result["rss_kib"][str(done)] = rss
                progress(f"{done / MILLION:.1f} M blocks stored, {(time.perf_counter() - t0):.0f} s; daemon RSS "
                         f"{rss / 1024:.0f} MiB")
        result["put_seconds"] = time.perf_counter() - t0
        engine = client.stats()["engine"]
        stored = engine["blocks"]
        result["index_bytes"] = engine["index_bytes"]
        assert stored == args.blocks, f"the daemon holds {stored} of {args.blocks} blocks (evicted? a bigger --device-size)"
        deleted = range(0, args.deleted)
        pinned = range(args.deleted, args.deleted + args.pinned)
        for rng, call in ((deleted, client.delete_many), (pinned, client.pin)):
            for start in range(rng.start, rng.stop, BATCH):
                assert all(call(keys_of(start, min(BATCH, rng.stop - start))))
        client.flush()
        progress(f"{args.deleted} deleted, {args.pinned} pinned; restart")
        client.close()
        t0 = time.perf_counter()
        d.restart()
        result["restart_seconds"] = time.perf_counter() - t0  # SIGTERM, exit, exec, recovery, ready
        result["rss_peak_recovery_kib"] = status_kib(d.pid, "VmHWM")
        time.sleep(1.0)
        result["rss_after_restart_kib"] = status_kib(d.pid, "VmRSS")
        client = BlockClient(d.data_addr, pool_size=1)
        engine = client.stats()["engine"]
        result["recovery_seconds"] = engine.get("recovery_seconds")
        result["blocks_after_restart"] = engine["blocks"]
        rng = np.random.default_rng(0)
        for name, lo, hi, want in (("deleted", 0, args.deleted, False), ("pinned", args.deleted,
                                   args.deleted + args.pinned, True), ("other", args.deleted + args.pinned,
                                   args.blocks, True)):
            if hi <= lo:
                continue
            picks = rng.integers(lo, hi, SAMPLE)
            keys = [keys_of(int(i), 1)[0] for i in picks]
            present = [client.lookup([k]) == 1 for k in keys]
            assert all(p == want for p in present), f"{name}: {sum(present)} of {len(keys)} present after the restart"
        client.close()
    finally:
        d.stop()
        shutil.rmtree(work, ignore_errors=True)
    rss = {int(n): kib for n, kib in result["rss_kib"].items()}
    at_million = min(n for n in rss if n >= min(MILLION, args.blocks))  # the first count past 1 M
    result["rss_bytes_per_block_1m"] = (rss[at_million] - rss[WARM_BLOCKS]) * 1024 / (at_million - WARM_BLOCKS)
    result["rss_bytes_per_block_end"] = (rss[args.blocks] - rss[WARM_BLOCKS]) * 1024 / (args.blocks - WARM_BLOCKS)
    result["rss_peak_over_steady"] = result["rss_peak_recovery_kib"] / result["rss_after_restart_kib"]
    out = Path(args.out) if args.out else ROOT / "perf" / "results" / time.strftime("%Y-%m-%d", time.gmtime()) \
        / "restart.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"RSS growth per block, 0.1 M -> {at_million / MILLION:.2f} M   {result['rss_bytes_per_block_1m']:8.1f} B   (goal <= 64)")
    print(f"RSS growth per block, 0.1 M -> {args.blocks / MILLION:g} M   {result['rss_bytes_per_block_end']:8.1f} B   (goal <= 64)")
    print(f"restart, {args.blocks / MILLION:g} M blocks, {args.deleted} deleted, {args.pinned} pinned: "
          f"{result['restart_seconds']:.2f} s to ready (recovery {result['recovery_seconds']} s; goal <= 10)")
    print(f"recovery RSS peak / steady RSS           {result['rss_peak_over_steady']:8.2f}     (goal <= 2)")
    print(f"wrote {out}")
    return 0


def plot(result: dict, path: Path) -> None:
    """kvtierd's RSS against blocks stored, beside the 64 B-a-block budget from the warm point."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    points = sorted((int(n), kib / 1024) for n, kib in result["rss_kib"].items())
    blocks = [n / MILLION for n, _ in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(blocks, [mib for _, mib in points], marker="o", label="kvtierd RSS")
    warm = dict(points)[WARM_BLOCKS]
    ax.plot(blocks, [warm + (n - WARM_BLOCKS) * 64 / 2**20 for n, _ in points], linestyle="--",
            label="budget: 64 B a block from 0.1 M")
    ax.set_xlabel("blocks stored (millions)")
    ax.set_ylabel("MiB")
    ax.set_title(f"restart: {result['restart_seconds']:.1f} s, recovery peak {result['rss_peak_over_steady']:.2f}x "
                 "the serving RSS")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
