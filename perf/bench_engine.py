#!/usr/bin/env python3
"""Block engine benchmark: bandwidth against fio, index memory, restart time.

    .venv/bin/python perf/bench_engine.py [--quick] [--dir DIR] [--out perf/out/engine.json]

1. Bandwidth. Four files, 2 MiB blocks, O_DIRECT. fio first (same files, same
   run; bs=2M, direct=1, psync, end_fsync=1, as many jobs per file as the
   engine has I/O threads per device, 2), then the
   engine: put of N blocks (+ the final flush, so every byte is on flash and
   synced), then get of all of them in batches (``get_many``, each block
   verified, returned as bytes), then again with ``get_many_placed`` into
   reused page-aligned huge-page buffers (the zero-copy path: one device read
   straight into the buffer + one CRC pass). CPU seconds per GiB are the
   process's user + system time over the phase (all threads). ``--repeat`` rounds, interleaved; medians of bytes/s and of the
   engine/fio ratio are reported (per-round figures are in the JSON).
2. Index memory: resident-memory growth from 0.1 M to 1.1 M stored blocks,
   divided by 1 M (--quick: 0.02 M -> 0.22 M, divided by 0.2 M).
3. Restart: close and reopen the store with those blocks (index rebuilt from
   the region summaries).

Results go to ``--out`` as JSON, and a small table is printed. Absolute
figures are noisy on a shared machine: compare the ratios.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtier.common.blockformat import HEADER_SIZE, encode_header
from kvtier.daemon.engine import Engine, EngineConfig
from kvtier.common.aligned import aligned_buffer

MiB = 1 << 20
GiB = 1 << 30
BLOCK_PAYLOAD_BYTES = 2 * MiB - HEADER_SIZE  # a 2 MiB block, header included
GET_BATCH = 8  # blocks per get_many: enough to keep all four devices busy
SMALL_PAYLOAD_BYTES = 64  # blocks for the index-memory and restart phases: the index, not the data, is measured
PUT_BATCH = 10_000


def rss_bytes() -> int:
    """Resident bytes after returning the C heap's free memory to the OS (glibc malloc_trim):
    what the process holds, not what the allocator keeps cached from freed temporaries."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_fio(files: list[Path], rw: str, size_bytes: int, jobs_per_file: int) -> dict:
    """fio on the same files: ``jobs_per_file`` psync jobs per file (the engine runs that many I/O
    threads per device), each on its own slice of ``size_bytes / jobs_per_file``."""
    share = size_bytes // jobs_per_file
    cmd = ["fio", "--output-format=json", "--group_reporting", f"--rw={rw}", "--bs=2M", "--direct=1",
           "--ioengine=psync", f"--size={share}", f"--numjobs={jobs_per_file}", f"--offset_increment={share}",
           "--end_fsync=1" if rw == "write" else "--invalidate=1"]
    for i, f in enumerate(files):
        cmd += [f"--name=dev{i}", f"--filename={f}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    job = json.loads(out.stdout)["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000  # % of the jobs' summed runtime
    return {"bw_bytes": side["bw_bytes"], "cpu_s_per_gib": cpu_s / (side["io_bytes"] / GiB), "command": " ".join(cmd)}


def engine_round(cfg: EngineConfig, n: int, seed: int) -> dict:
    """Format, put ``n`` 2 MiB blocks (+ flush), get them all back (as bytes, then into caller
    buffers); returns bytes/s and process CPU seconds per GiB of each phase (all threads;
    client-side block building excluded)."""
    Engine.format(cfg, force=True)
    engine = Engine.open(cfg)
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, BLOCK_PAYLOAD_BYTES, dtype=np.uint8).tobytes()
    keys = [rng.bytes(16) for _ in range(n)]
    ns = bytes(16)
    block = bytearray(HEADER_SIZE + BLOCK_PAYLOAD_BYTES)
    block[HEADER_SIZE:] = payload
    put_s = put_cpu_s = 0.0
    for k in keys:
        block[:HEADER_SIZE] = encode_header(k, ns, 0, payload)  # client work: not timed
        t0, c0 = time.perf_counter(), time.process_time()
        engine.put(block)
        put_s += time.perf_counter() - t0
        put_cpu_s += time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    engine.flush()
    put_s += time.perf_counter() - t0
    put_cpu_s += time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    got_bytes = 0
    for i in range(0, n, GET_BATCH):
        for b in engine.get_many(keys[i:i + GET_BATCH]):
            assert b is not None and len(b) == 2 * MiB
            got_bytes += len(b)
    get_s = time.perf_counter() - t0
    get_cpu_s = time.process_time() - c0
    bufs = [aligned_buffer(2 * MiB + 4096, populate=True, huge=True) for _ in range(GET_BATCH)]
    t0, c0 = time.perf_counter(), time.process_time()
    into_bytes = 0
    for i in range(0, n, GET_BATCH):
        for where in engine.get_many_placed(keys[i:i + GET_BATCH], bufs):
            assert where is not None and where[1] == 2 * MiB
            into_bytes += where[1]
    into_s = time.perf_counter() - t0
    into_cpu_s = time.process_time() - c0
    st = engine.statistics()
    engine.close()
    assert st.corrupt_reads == 0 and st.evicted_blocks == 0, st
    gib = n * 2 * MiB / GiB
    return {"engine_put_bw_bytes": n * 2 * MiB / put_s, "engine_get_bw_bytes": got_bytes / get_s,
            "engine_get_into_bw_bytes": into_bytes / into_s, "engine_put_cpu_s_per_gib": put_cpu_s / gib,
            "engine_get_cpu_s_per_gib": get_cpu_s / gib, "engine_get_into_cpu_s_per_gib": into_cpu_s / gib}


def bandwidth(work: Path, file_bytes: int, total_bytes: int, repeats: int) -> dict:
    """``repeats`` rounds of fio write, fio read, engine put, engine get, interleaved so that load
    from other processes hits both sides alike; medians and per-round ratios are reported."""
    files = [work / f"bw{i}.img" for i in range(4)]
    for f in files:
        with open(f, "wb") as fh:
            fh.truncate(file_bytes)
    cfg = EngineConfig(device_paths=tuple(str(f) for f in files))
    jobs = cfg.io_threads_per_device
    run_fio(files, "write", total_bytes // 4, jobs)  # precondition: blocks allocated for both sides
    n = total_bytes // (2 * MiB)
    rounds = []
    for r in range(repeats):
        fio_write = run_fio(files, "write", total_bytes // 4, jobs)
        fio_read = run_fio(files, "read", total_bytes // 4, jobs)
        eng = engine_round(cfg, n, seed=r)
        rounds.append({"fio_write_bw_bytes": fio_write["bw_bytes"], "fio_read_bw_bytes": fio_read["bw_bytes"],
                       "fio_write_cpu_s_per_gib": fio_write["cpu_s_per_gib"],
                       "fio_read_cpu_s_per_gib": fio_read["cpu_s_per_gib"], **eng,
                       "put_vs_fio": eng["engine_put_bw_bytes"] / fio_write["bw_bytes"],
                       "get_vs_fio": eng["engine_get_bw_bytes"] / fio_read["bw_bytes"],
                       "get_into_vs_fio": eng["engine_get_into_bw_bytes"] / fio_read["bw_bytes"]})
    med = {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}
    return {"blocks": n, "block_bytes": 2 * MiB, "files": 4, "file_bytes": file_bytes, "repeats": repeats,
            **med, "rounds": rounds,
            "fio_write_command": fio_write["command"], "fio_read_command": fio_read["command"]}


def index_memory_and_restart(work: Path, base_blocks: int, added_blocks: int) -> dict:
    cfg = EngineConfig(device_paths=(str(work / "idx0.img"), str(work / "idx1.img")), device_size_bytes=2 * GiB)
    Engine.format(cfg, force=True)
    engine = Engine.open(cfg)
    rng = np.random.default_rng(1)
    payload = bytes(SMALL_PAYLOAD_BYTES)
    ns = bytes(16)

    def put(count: int) -> None:
        for start in range(0, count, PUT_BATCH):
            m = min(PUT_BATCH, count - start)
            engine.put_many([encode_header(k, ns, 0, payload) + payload
                             for k in np.frombuffer(rng.bytes(16 * m), "V16").tolist()])

    put(base_blocks)
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    put(added_blocks)
    put_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_bytes()
    st = engine.statistics()
    engine.close()
    stored = st.blocks
    t0 = time.perf_counter()
    engine = Engine.open(cfg)
    restart_s = time.perf_counter() - t0
    st2 = engine.statistics()
    engine.close()
    assert st2.blocks == stored == base_blocks + added_blocks, (st2.blocks, stored)
    return {
        "blocks_before": base_blocks, "blocks_after": stored,
        "rss_before_bytes": rss0, "rss_after_bytes": rss1,
        "index_bytes_per_block_rss": (rss1 - rss0) / added_blocks,
        "index_table_bytes": st.index_bytes, "index_table_bytes_per_block": st.index_bytes / stored,
        "small_put_us_per_block": put_s / added_blocks * 1e6,
        "restart_blocks": st2.recovered_blocks, "restart_seconds": restart_s,
        "recovery_seconds": st2.recovery_seconds,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: checks the benchmark works (seconds)")
    ap.add_argument("--dir", default=None, help="where to put the device files (default: a temp dir under /tmp)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("out") / "engine.json"))
    ap.add_argument("--repeat", type=int, default=3, help="interleaved fio/engine rounds (medians reported)")
    ap.add_argument("--skip-bandwidth", action="store_true")
    ap.add_argument("--skip-index", action="store_true")
    args = ap.parse_args(argv)
    if shutil.which("fio") is None and not args.skip_bandwidth:
        print("fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir))
    try:
        result = {"quick": args.quick, "host_cpus": os.cpu_count(),
                  "loadavg_start": os.getloadavg()[0], "started_unix": time.time()}
        if not args.skip_bandwidth:
            file_bytes, total = (160 * MiB, 256 * MiB) if args.quick else (1280 * MiB, 2 * GiB)
            result["bandwidth"] = bandwidth(work, file_bytes, total, args.repeat)
        if not args.skip_index:
            base, added = (20_000, 200_000) if args.quick else (100_000, 1_000_000)
            result["index"] = index_memory_and_restart(work, base, added)
        result["loadavg_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    print(f"{'measure':<38} {'engine':>14} {'reference':>14} {'ratio':>7}")
    bw = result.get("bandwidth")
    if bw:
        print(f"{'(medians of ' + str(bw['repeats']) + ' interleaved rounds)':<38}")
        print(f"{'put 2 MiB blocks, 4 files (MiB/s)':<38} {bw['engine_put_bw_bytes'] / MiB:>14.1f} "
              f"{bw['fio_write_bw_bytes'] / MiB:>14.1f} {bw['put_vs_fio']:>7.2f}")
        print(f"{'get 2 MiB blocks, 4 files (MiB/s)':<38} {bw['engine_get_bw_bytes'] / MiB:>14.1f} "
              f"{bw['fio_read_bw_bytes'] / MiB:>14.1f} {bw['get_vs_fio']:>7.2f}")
        print(f"{'get_many_placed into buffers (MiB/s)':<38} {bw['engine_get_into_bw_bytes'] / MiB:>14.1f} "
              f"{bw['fio_read_bw_bytes'] / MiB:>14.1f} {bw['get_into_vs_fio']:>7.2f}")
        print(f"{'CPU s per GiB: put (fio write)':<38} {bw['engine_put_cpu_s_per_gib']:>14.2f} "
              f"{bw['fio_write_cpu_s_per_gib']:>14.2f}")
        print(f"{'CPU s per GiB: get bytes (fio read)':<38} {bw['engine_get_cpu_s_per_gib']:>14.2f} "
              f"{bw['fio_read_cpu_s_per_gib']:>14.2f}")
        print(f"{'CPU s/GiB: get_many_placed (fio read)':<38} {bw['engine_get_into_cpu_s_per_gib']:>14.2f} "
              f"{bw['fio_read_cpu_s_per_gib']:>14.2f}")
    ix = result.get("index")
    if ix:
        added = ix["blocks_after"] - ix["blocks_before"]
        label = f"index bytes/block (RSS, +{added} blocks)"
        print(f"{label:<38} {ix['index_bytes_per_block_rss']:>14.1f} "
              f"{'budget 64':>14} {ix['index_bytes_per_block_rss'] / 64:>7.2f}")
        label = f"restart with {ix['restart_blocks']} blocks (s)"
        print(f"{label:<38} {ix['restart_seconds']:>14.2f} "
              f"{'goal 10':>14} {ix['restart_seconds'] / 10:>7.2f}")
    print(f"load average {result['loadavg_start']:.1f} -> {result['loadavg_end']:.1f} on {result['host_cpus']} CPUs")


if __name__ == "__main__":
    sys.exit(main())
