"""Daemon CPU seconds per GiB of a durable (or ``--buffered``) PUT and of a GET from flash, with same-run
references.

    sudo .venv/bin/python perf/bench_daemon_cpu.py                 # 32 MiB and 2 MiB blocks, 1 GiB each
    sudo .venv/bin/python perf/bench_daemon_cpu.py --gib 0.25 --block-mib 32

For each block size: a real kvtierd on 4 device files under ``/var/tmp`` (256 MiB regions,
1 MiB stripes); ``CONNECTIONS`` BlockClients PUT pre-encoded blocks with ``durable=True``;
the daemon is restarted and the page cache dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``);
the same connections GET every block (``copy=False``). The daemon's utime + stime from
``/proc/PID/stat`` over each phase, divided by the GiB moved, is the figure. The references
are measured in the same run: fio on the same device files (2 MiB, QD1, O_DIRECT, write with
end_fsync, read after dropping the cache) and iperf3 on loopback. Needs root (drop_caches).

Prints one JSON document (``--out`` also writes it).
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import start_kvtierd  # noqa: E402

sys.path.insert(0, str(ROOT / "perf"))
from bench_store_load import drop_page_cache  # noqa: E402
from bench_tcp import parallel  # noqa: E402

from kvtier.client import BlockClient  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402

GiB = 1 << 30
CONNECTIONS = 4  # client streams, as in the BlockClient figures
DEVICES = 4
WORK_DIR = Path("/var/tmp/kvtier-bench-daemon-cpu")  # real files on the machine's disk, not tmpfs
REGION_SIZE = "256m"  # holds 7 blocks of 32 MiB
BATCH_BYTES = 16 << 20  # bytes per put_many / get_many call: one PUT frame's worth
NS = b"\x43" * 16
FIO_TIMEOUT_S = 600
IPERF3_SECONDS = 3
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def daemon_cpu_s(pid: int) -> float:
    """utime + stime of a process, every thread, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def bench_kvtierd(work: Path, block_bytes: int, total_bytes: int, durable: bool = True) -> dict:
    count = max(CONNECTIONS, total_bytes // block_bytes)
    payload = os.urandom(block_bytes)
    keys = [i.to_bytes(8, "little") + b"cpu-bnch" for i in range(count)]
    blocks = [encode_block(k, NS, 0, payload) for k in keys]
    total = sum(len(b) for b in blocks)
    device_size = (total * 2 // DEVICES + (512 << 20)) >> 20
    d = start_kvtierd(work, "--device-size", f"{device_size}m", "--region-size", REGION_SIZE,
                      "--stripe-size", "1m")
    shares = [list(range(i, count, CONNECTIONS)) for i in range(CONNECTIONS)]
    per_call = max(1, BATCH_BYTES // block_bytes)
    try:
        def put(idx):
            with BlockClient(d.data_addr, pool_size=1) as c:
                for j in range(0, len(idx), per_call):
                    c.put_many([(keys[i], blocks[i]) for i in idx[j:j + per_call]], durable=durable)

        cpu0 = daemon_cpu_s(d.proc.pid)
        put_s = parallel(put, shares)
        put_cpu = daemon_cpu_s(d.proc.pid) - cpu0
        with BlockClient(d.data_addr) as c:
            put_stats = c.stats()["engine"]
        d.restart()
        drop_page_cache()
        misses = [0]

        def get(idx):
            with BlockClient(d.data_addr, pool_size=1) as c:
                for j in range(0, len(idx), per_call):
                    chunk = idx[j:j + per_call]
                    for i, got in zip(chunk, c.get_many([keys[i] for i in chunk], copy=False)):
                        if got is None or len(got) != len(blocks[i]):
                            misses[0] += 1

        cpu0 = daemon_cpu_s(d.proc.pid)
        get_s = parallel(get, shares)
        get_cpu = daemon_cpu_s(d.proc.pid) - cpu0
    finally:
        d.stop()
    return {"block_bytes": block_bytes, "blocks": count, "bytes": total, "connections": CONNECTIONS,
            "durable": durable, "put_bytes_per_s": total / put_s, "get_bytes_per_s": total / get_s,
            "put_daemon_cpu_s_per_gib": put_cpu * GiB / total, "get_daemon_cpu_s_per_gib": get_cpu * GiB / total,
            "get_misses": misses[0],
            "engine_after_put": {k: put_stats.get(k) for k in ("puts", "puts_received_in_place")}}


def bench_fio(files: list[Path], total_bytes: int) -> dict:
    out = {}
    size = max(64 << 20, total_bytes // len(files)) >> 20
    for rw in ("write", "read"):
        if rw == "read":
            drop_page_cache()
        cmd = ["fio", "--output-format=json", "--name=daemon_cpu", "--filename=" + ":".join(map(str, files)),
               "--ioengine=psync", "--direct=1", "--bs=2m", "--iodepth=1", f"--rw={rw}", f"--size={size}m",
               "--numjobs=1", "--end_fsync=1" if rw == "write" else "--end_fsync=0"]
        job = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                        timeout=FIO_TIMEOUT_S).stdout)["jobs"][0]
        side = job[rw]
        runtime_s = job["job_runtime"] / 1e3
        out[rw] = {"bytes_per_s": side["bw_bytes"],
                   "cpu_s_per_gib": (job["usr_cpu"] + job["sys_cpu"]) / 100 * runtime_s * GiB / max(1, side["io_bytes"]),
                   "command": shlex.join(cmd)}
    return out


def bench_iperf3() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)  # let it listen (a benchmark's start-up, not a wait loop)
        cmd = ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-P", str(CONNECTIONS), "-t", str(IPERF3_SECONDS), "-J"]
        doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=IPERF3_SECONDS + 30).stdout)
        return {"bytes_per_s": doc["end"]["sum_received"]["bits_per_second"] / 8, "command": shlex.join(cmd)}
    finally:
        server.wait(timeout=30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per block size, in GiB")
    ap.add_argument("--block-mib", type=int, action="append", help="block payload MiB (repeatable; default 32 and 2)")
    ap.add_argument("--no-references", action="store_true", help="skip fio and iperf3")
    ap.add_argument("--buffered", action="store_true", help="PUT without durable (acknowledged before the sync)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    total = int(args.gib * GiB)
    shutil.rmtree(WORK_DIR, ignore_errors=True)
    WORK_DIR.mkdir(parents=True)
    result: dict = {"kvtierd": []}
    try:
        for mib in args.block_mib or [32, 2]:
            work = WORK_DIR / f"b{mib}"
            result["kvtierd"].append(bench_kvtierd(work, mib << 20, total, durable=not args.buffered))
        if not args.no_references:
            files = sorted((WORK_DIR / f"b{(args.block_mib or [32, 2])[-1]}").glob("dev*"))
            result["fio"] = bench_fio(files or [WORK_DIR / "fio.dat"], total)
            result["iperf3"] = bench_iperf3()
    finally:
        shutil.rmtree(WORK_DIR, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
