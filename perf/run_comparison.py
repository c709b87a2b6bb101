#!/usr/bin/env python3
"""Run kvtier's figures and their references in one go, on this machine.

    .venv/bin/python perf/run_comparison.py [--quick] [--ttft] [--out perf/out]

Steps (each prints a progress line to stderr):

  1. kvtierd on fresh device files (tests/daemon_proc.py starts it)
  2. kvperf PUT   perf/jobs/put-get-2m.fio [put]   (2 MiB blocks, 4 clones)
  3. kvtierd restart, so that reads come from flash, not the open region
  4. kvperf GET   perf/jobs/put-get-2m.fio [get]
  5. kvperf LOOKUP of 1024-key chains, perf/jobs/lookup-1024.fio
  6. kvperf prefix trace, perf/jobs/prefix-chat.fio
  7. (--ttft) kvperf TTFT, perf/jobs/ttft-g3.fio
  8. redis-server + redis-py: SET then GET of the same blocks, 4 connections
  9. iperf3 on loopback, 4 streams
 10. fio write then read on the daemon's own device files (daemon stopped;
     this overwrites the store, which is thrown away afterwards)

Writes perf/out/comparison.json, perf/out/comparison.md (figure, reference,
ratio, goal, command, date) and plots perf/out/comparison.png plus each kvperf
run's --plot. Ratios only compare figures measured in this same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from daemon_proc import start_kvtierd  # noqa: E402

JOBS = ROOT / "perf" / "jobs"
STEP_TIMEOUT_S = 1800  # one benchmark step; a full-size ttft run on a CPU is the slowest
REDIS_READY_TIMEOUT_S = 20  # redis-server / iperf3 -s are ready within this long or are broken
BLOCK_BYTES = 2 << 20  # the block size of the bandwidth comparison (issue 3: 2 MiB)
CONNECTIONS = 4  # clients per bandwidth test (issue 3: 4 connections)


@dataclass(frozen=True)
class Scale:
    device_size: str  # per device file; 4 files
    region_size: str
    clone_size_bytes: int  # bytes each of the 4 kvperf clones (and redis threads, fio jobs) moves
    lookup_runtime_s: int
    prefix_requests: int
    iperf_seconds: int


FULL = Scale("2g", "64m", 1 << 30, 5, 200, 5)
QUICK = Scale("256m", "16m", 64 << 20, 1, 40, 1)


@dataclass(frozen=True)
class Row:
    figure_name: str
    figure: float
    unit: str
    reference_name: str
    reference: float | None
    ratio: float | None
    goal: str
    command: str
    date: str


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cmd(cmd: list[str], env: dict | None = None, ok_codes=(0,), cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, env=env, cwd=cwd)
    if proc.returncode not in ok_codes:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def kvperf(jobfile: str, target: str, out: Path, name: str, extra: list[str]) -> tuple[dict, str]:
    """Run kvperf as a user would; returns (its JSON report, the command)."""
    cmd = [sys.executable, "-m", "kvtier.tools.kvperf", str((JOBS / jobfile).relative_to(ROOT)), *extra,
           "--output-format=json", f"--plot={out / f'kvperf-{name}.png'}"]
    env = {**os.environ, "KVTIER_TARGET": target}
    # exit 1 (a gate failed) still carries the report; the gate verdicts are in it
    doc = json.loads(run_cmd(cmd, env, ok_codes=(0, 1), cwd=ROOT))
    return doc, f"KVTIER_TARGET={target} " + shlex.join(["kvperf", *cmd[3:]])


def redis_bandwidth(scale: Scale) -> tuple[float, float, str]:
    """(SET bytes/s, GET bytes/s, command) of redis-py against a fresh redis-server."""
    import redis

    from kvtier.common.blockformat import encode_block
    from kvtier.tools.kvperf.content import block_key, keyspace_ns_id, payload_for

    port = free_port()
    server_cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                  "--maxmemory", "0", "--protected-mode", "yes"]
    server = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe = redis.Redis(port=port)
        deadline = time.monotonic() + REDIS_READY_TIMEOUT_S
        while True:  # poll the server's own readiness answer
            try:
                probe.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer PING")
                time.sleep(0.05)
        blocks_per_thread = scale.clone_size_bytes // BLOCK_BYTES
        ns = keyspace_ns_id("redis-compare")
        payload = payload_for(ns, BLOCK_BYTES)

        # built before the clock starts, as kvperf builds its blocks outside the timed loop
        prepared = {t: [(key, encode_block(key, ns, 0, payload))
                        for key in (block_key(1, "redis-compare", t, i) for i in range(blocks_per_thread))]
                    for t in range(CONNECTIONS)}

        def blocks(t: int):
            return prepared[t]

        def phase(kind: str) -> float:
            errors: list[BaseException] = []

            def worker(t: int) -> None:
                try:
                    client = redis.Redis(port=port)
                    for key, block in blocks(t):
                        if kind == "set":
                            client.set(key, block)
                        elif client.get(key) != block:
                            raise RuntimeError(f"redis returned wrong bytes for {key.hex()}")
                except BaseException as e:  # re-raised below
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(t,)) for t in range(CONNECTIONS)]
            t0 = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            elapsed = time.perf_counter() - t0
            if errors:
                raise errors[0]
            return CONNECTIONS * blocks_per_thread * BLOCK_BYTES / elapsed

        set_bw = phase("set")
        get_bw = phase("get")
    finally:
        server.terminate()
        server.wait(30)
    cmd = (shlex.join(server_cmd) + f"; redis-py SET then GET of {CONNECTIONS}x{blocks_per_thread} blocks of "
           f"{BLOCK_BYTES} B (+64 B header), {CONNECTIONS} threads with one connection each")
    return set_bw, get_bw, cmd


def iperf3_bandwidth(scale: Scale) -> tuple[float, str]:
    port = free_port()
    server = subprocess.Popen(["iperf3", "-s", "-p", str(port), "-B", "127.0.0.1", "--forceflush"],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    cmd = ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-P", str(CONNECTIONS), "-t", str(scale.iperf_seconds),
           "-J"]
    watchdog = threading.Timer(REDIS_READY_TIMEOUT_S, server.kill)  # a server that never listens is killed
    watchdog.start()
    try:
        for line in server.stdout:  # the server says when it listens (--forceflush: no pipe buffering)
            if "Server listening" in line:
                break
        else:
            raise RuntimeError(f"iperf3 -s exited {server.wait()} before listening")
        watchdog.cancel()
        doc = json.loads(run_cmd(cmd))
    finally:
        watchdog.cancel()
        server.terminate()
        server.wait(30)
    if "error" in doc:
        raise RuntimeError(f"iperf3: {doc['error']}")
    return doc["end"]["sum_received"]["bits_per_second"] / 8, shlex.join(cmd)


def fio_bandwidth(devices: list[Path], rw: str, size_bytes: int) -> tuple[float, str]:
    cmd = ["fio", "--output-format=json", "--ioengine=libaio", "--direct=1", f"--rw={rw}", f"--bs={BLOCK_BYTES}",
           "--iodepth=1", f"--size={size_bytes}", "--group_reporting"]
    for i, dev in enumerate(devices):
        cmd += [f"--name=dev{i}", f"--filename={dev}"]
    doc = json.loads(run_cmd(cmd))
    return float(doc["jobs"][0][rw]["bw_bytes"]), shlex.join(cmd)


def ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def write_outputs(out: Path, rows: list[Row], extra: dict) -> None:
    (out / "comparison.json").write_text(json.dumps({"date": now(), "rows": [asdict(r) for r in rows], **extra},
                                                    indent=2) + "\n")
    lines = [f"# kvtier comparison run, {now()}", "",
             f"Host: {os.uname().nodename}, {os.cpu_count()} CPUs. Every ratio compares figures from this one run.",
             f"Scale: {extra['scale_name']} ({extra['scale']}).",
             *([f"Quick mode: small sizes and, for TTFT, the tiny model at 512 tokens -- a check that every "
                f"step works, not the figures to record."] if extra["scale_name"] == "quick" else []),
             "", "| figure | value | reference | value | ratio | goal | command |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = "-" if r.reference is None else f"{_fmt(r.reference, r.unit)}"
        rat = "-" if r.ratio is None else f"{r.ratio:.2f}"
        lines.append(f"| {r.figure_name} | {_fmt(r.figure, r.unit)} | {r.reference_name} | {ref} | {rat} | {r.goal} "
                     f"| `{r.command}` |")
    (out / "comparison.md").write_text("\n".join(lines) + "\n")


def _fmt(v: float, unit: str) -> str:
    if unit == "B/s":
        return f"{v / 1e9:.3f} GB/s"
    if unit == "keys/s":
        return f"{v / 1e6:.3f} M keys/s"
    if unit == "ms":
        return f"{v:.1f} ms"
    return f"{v:.3f}"


def plot(out: Path, bars: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = list(bars)
    colors = ["tab:green" if n.startswith("kvtier") else "tab:gray" for n in names]
    ax.barh(names, [bars[n] / 1e9 for n in names], color=colors)
    for i, n in enumerate(names):
        ax.text(bars[n] / 1e9, i, f" {bars[n] / 1e9:.2f}", va="center")
    ax.set(xlabel="GB/s", title="kvtier block bandwidth vs references (same run, loopback, 2 MiB blocks)")
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "comparison.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: checks that every step works")
    ap.add_argument("--ttft", action="store_true", help="also run the ttft job (slow on a CPU)")
    ap.add_argument("--out", default=str(ROOT / "perf" / "out"))
    args = ap.parse_args(argv)
    scale = QUICK if args.quick else FULL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for tool in ("fio", "iperf3", "redis-server"):
        if shutil.which(tool) is None:
            print(f"run_comparison: {tool} is not installed (apt-get install {tool.split('-')[0]})", file=sys.stderr)
            return 2
    work = Path(tempfile.mkdtemp(prefix="kvtier-compare-"))
    rows: list[Row] = []
    reports: dict = {}
    size = f"--size={scale.clone_size_bytes}"
    try:
        log(f"[1/10] kvtierd on 4 x {scale.device_size} device files in {work}")
        daemon = start_kvtierd(work / "kvtierd", "--device-size", scale.device_size, "--region-size",
                               scale.region_size, "--stripe-size", "1m")
        target = f"tcp://{daemon.data_addr}"
        log("[2/10] kvperf PUT")
        put, put_cmd = kvperf("put-get-2m.fio", target, out, "put", ["--section=put", size])
        log("[3/10] kvtierd restart (reads from flash)")
        daemon.restart()
        target = f"tcp://{daemon.data_addr}"
        log("[4/10] kvperf GET")
        get, get_cmd = kvperf("put-get-2m.fio", target, out, "get", ["--section=get", size])
        log("[5/10] kvperf LOOKUP (1024-key chains)")
        lookup, lookup_cmd = kvperf("lookup-1024.fio", target, out, "lookup", [f"--runtime={scale.lookup_runtime_s}"])
        log("[6/10] kvperf prefix trace")
        prefix, prefix_cmd = kvperf("prefix-chat.fio", target, out, "prefix",
                                    [f"--prefix_requests={scale.prefix_requests}"])
        ttft = None
        if args.ttft:
            log("[7/10] kvperf TTFT (recompute / in-memory / kvtier)")
            extra = ["--model=random-llama-tiny", "--prompt_tokens=512", "--cached_tokens=448",
                     "--concurrency=1,4", "--ttft_prompts=4"] if args.quick else []
            ttft, ttft_cmd = kvperf("ttft-g3.fio", target, out, "ttft", extra)
        else:
            log("[7/10] TTFT skipped (give --ttft)")
        log("[8/10] redis-server + redis-py")
        redis_set, redis_get, redis_cmd = redis_bandwidth(scale)
        log("[9/10] iperf3 loopback")
        iperf, iperf_cmd = iperf3_bandwidth(scale)
        log("[10/10] fio on the daemon's device files (daemon stopped)")
        daemon.stop()
        devices = sorted((work / "kvtierd").glob("device*.img"))
        fio_size = min(scale.clone_size_bytes, devices[0].stat().st_size - (16 << 20))
        fio_write, fio_write_cmd = fio_bandwidth(devices, "write", fio_size)
        fio_read, fio_read_cmd = fio_bandwidth(devices, "read", fio_size)
    finally:
        if "daemon" in locals() and daemon.alive():
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)

    date = now()
    put_bw, get_bw = put["jobs"][0]["write"]["bw_bytes"], get["jobs"][0]["read"]["bw_bytes"]
    rows += [
        Row("kvtier GET (kvperf, from flash)", get_bw, "B/s", "min(fio read, iperf3)", min(fio_read, iperf),
            ratio(get_bw, min(fio_read, iperf)), ">= 0.8", get_cmd, date),
        Row("kvtier PUT (kvperf)", put_bw, "B/s", "min(fio write, iperf3)", min(fio_write, iperf),
            ratio(put_bw, min(fio_write, iperf)), ">= 0.8", put_cmd, date),
        Row("kvtier GET (kvperf)", get_bw, "B/s", "redis-py GET", redis_get, ratio(get_bw, redis_get), ">= 1.5",
            get_cmd, date),
        Row("kvtier PUT (kvperf)", put_bw, "B/s", "redis-py SET", redis_set, ratio(put_bw, redis_set), ">= 1.5",
            put_cmd, date),
        Row("fio read, device files", fio_read, "B/s", "-", None, None, "reference", fio_read_cmd, date),
        Row("fio write, device files", fio_write, "B/s", "-", None, None, "reference", fio_write_cmd, date),
        Row("iperf3 loopback", iperf, "B/s", "-", None, None, "reference", iperf_cmd, date),
        Row("redis-py GET", redis_get, "B/s", "-", None, None, "reference", redis_cmd, date),
        Row("redis-py SET", redis_set, "B/s", "-", None, None, "reference", redis_cmd, date),
    ]
    keys_per_s = lookup["jobs"][0]["lookup"]["keys_per_s"]
    rows.append(Row("kvtier LOOKUP, 1024-key chains", keys_per_s, "keys/s", "goal 1 M keys/s", 1e6,
                    ratio(keys_per_s, 1e6), ">= 1.0", lookup_cmd, date))
    p = prefix["jobs"][0]["prefix"]
    share = 0.75  # prefix-chat.fio's prefix_share: the most a prompt can hit
    rows.append(Row("prefix trace block hit ratio", p["hit_ratio"], "", "shared fraction of each prompt", share,
                    ratio(p["hit_ratio"], share), "report", prefix_cmd, date))
    if ttft is not None:
        t = ttft["jobs"][0]["ttft"]
        rows += [
            Row("TTFT kvtier (mean)", t["kvtier_ms"]["mean"], "ms", "TTFT full recompute", t["recompute_ms"]["mean"],
                ratio(t["kvtier_ms"]["mean"], t["recompute_ms"]["mean"]), "<= 0.75 (G3), issue 5: <= 0.3", ttft_cmd,
                date),
            Row("TTFT kvtier (mean)", t["kvtier_ms"]["mean"], "ms", "TTFT prefix in memory", t["inmemory_ms"]["mean"],
                ratio(t["kvtier_ms"]["mean"], t["inmemory_ms"]["mean"]), "<= 1.15", ttft_cmd, date),
        ]
    reports.update(put=put, get=get, lookup=lookup, prefix=prefix, ttft=ttft)
    write_outputs(out, rows, {"scale_name": "quick" if args.quick else "full", "scale": asdict(scale),
                              "kvperf_reports": reports})
    plot(out, {"kvtier GET": get_bw, "kvtier PUT": put_bw, "fio read (device files)": fio_read,
               "fio write (device files)": fio_write, "iperf3 loopback": iperf, "redis-py GET": redis_get,
               "redis-py SET": redis_set})
    log(f"wrote {out / 'comparison.json'}, {out / 'comparison.md'}, {out / 'comparison.png'}")
    print((out / "comparison.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
