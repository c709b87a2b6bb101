"""KVCache store / load against LMCache's local-disk backend, fio and iperf3, in one run.

    .venv/bin/python perf/bench_store_load.py            # 1 GiB, Llama-3-8B layout
    .venv/bin/python perf/bench_store_load.py --quick    # 256 MiB in 1024-token requests, a smoke run

Layout: Llama-3-8B (32 layers, 8 KV heads, head dim 128, float16), 256-token
blocks = 32 MiB per block raw; requests of 8192 tokens (32 blocks, 1 GiB each).
Every part works in one temp dir under /var/tmp (the disk, not tmpfs), one
after the other, so the references share the disk and the hour:

1. kvtier: kvtierd on 4 device files; ``KVCache(hot_pool_bytes=0, transport="tcp")``
   ``store(tokens, kv, durable=True)`` of every request; page cache dropped and
   kvtierd restarted; ``load(tokens, out=...)`` of every request into an output
   zeroed before the clock starts (LMCache's retrieve is given its outputs the same
   way), bytes compared with what was stored; ``lookup(tokens)`` of one request's 32 blocks, p50/p99.
   CPU: this process (``time.process_time``) and the daemon (/proc/PID/stat)
   around the timed calls only. One more request, of other tokens, is stored first and
   loaded first after each restart, untimed: a daemon in service has touched its reply
   buffers before, and LMCache's retrieve runs in the process that stored.
2. LMCache 0.5.6, ``LocalDiskBackend`` with O_DIRECT, its CPU cache off, in its
   own venv (perf/lmcache_side.py, a subprocess; the same tokens and bytes);
   store (+ fsync of its files, which LMCache itself never does), page cache
   dropped, retrieve, lookup.
3. fio in the same dir: 2 MiB blocks, QD1 (psync), direct=1; write (end_fsync),
   page cache dropped, read. Same byte count as the stores.
4. iperf3 on loopback, as many streams as KVCache's GET streams.

Where NIXL is installed, step 1 also stores every request again, under a second namespace,
through ``transport="nixl"`` (the daemon READs each block from the request's KV over shared
memory), and loads every request through it (the daemon writes each block into the output's
rows), page cache dropped and kvtierd restarted before.

Writes perf/results/<UTC date>/store_load.json and prints a table; every
kvtier figure is also a ratio to min(fio, iperf3) and to LMCache of this run.
Needs root (drop_caches), fio and iperf3 (Debian packages), and for step 2 the
venv: ``python3 -m venv /var/tmp/lmcache-venv; /var/tmp/lmcache-venv/bin/pip
install torch==2.13.0; /var/tmp/lmcache-venv/bin/pip install lmcache==0.5.6``.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import selectors
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "perf"))

from daemon_proc import device_map_of, start_kvtierd  # noqa: E402
from lmcache_side import make_request  # noqa: E402  (one generator of the data, both halves)

GiB = 1 << 30
MiB = 1 << 20
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 256  # Llama-3-8B, 256-token blocks
REQUEST_TOKENS = 8192  # 32 blocks per request
TOTAL_BYTES = GiB  # what the brief asks: 1 GiB stored, then loaded
QUICK_TOTAL_BYTES, QUICK_REQUEST_TOKENS = 256 * MiB, 1024
TOTAL_BYTES_MAX = 8 * GiB  # a bound on the disk and memory one run may take (the data is held twice)
SEED = 20261201
LOOKUP_ROUNDS = 200  # p99 of 200 samples: the 2nd-worst; each is well under a millisecond
DEVICES = 4  # kvtierd device files (daemon_proc's default layout)
REGION_SIZE = "128m"  # three 32 MiB blocks (+ headers) per region
KVCACHE_STREAMS = 4  # KVCache's GET streams per daemon (pool_size); iperf3 gets as many
IPERF3_SECONDS = 5
IPERF3_READY_TIMEOUT_S = 10  # iperf3 -s listens within milliseconds
FIO_TIMEOUT_S = 600  # one fio job at QD1 on a slow virtual disk: 1 GiB at >= 2 MB/s
LMCACHE_TIMEOUT_S = 900  # the whole LMCache half: install-free import (~10 s) + store + retrieve
LMCACHE_PYTHON = "/var/tmp/lmcache-venv/bin/python"
WORK_PARENT = "/var/tmp"  # on the root disk, as /work is; /tmp may be tmpfs
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
NIXL_LOOPBACK = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib*", "NIXL_LOG_LEVEL": "WARN"}
NIXL_READY_TIMEOUT_S = 30.0


def progress(msg: str) -> None:
    print(f"[bench_store_load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (longest mount-point match)."""
    best, kind = "", "?"
    path = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, typ, *_ = line.split()
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
            best, kind = mnt, typ
    return kind


class Meter:
    """Wall, this process's CPU and the daemon's CPU, summed over ``with`` blocks; and the
    garbage collections of this process inside them (count per generation, CPU seconds)."""

    def __init__(self):
        self.wall_s = self.client_s = self.daemon_s = self.gc_s = 0.0
        self.gc_collections = [0, 0, 0]
        self.pid = None
        self._gc_started: dict[int, float] = {}

    def __call__(self, pid: int) -> "Meter":
        self.pid = pid
        return self

    def __enter__(self) -> "Meter":
        gc.callbacks.append(self._on_gc)
        self._d0 = process_cpu_s(self.pid)
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s += time.perf_counter() - self._t0
        self.client_s += time.process_time() - self._c0
        self.daemon_s += process_cpu_s(self.pid) - self._d0
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        thread = threading.get_ident()  # a collection runs on whichever thread triggered it
        if phase == "start":
            self._gc_started[thread] = time.thread_time()
        elif thread in self._gc_started:
            self.gc_s += time.thread_time() - self._gc_started.pop(thread)
            self.gc_collections[info["generation"]] += 1


def percentiles_us(samples_s: list[float]) -> dict:
    us = sorted(s * 1e6 for s in samples_s)
    return {"p50": statistics.median(us), "p99": us[int(0.99 * (len(us) - 1))], "rounds": len(us)}


# -- 1. kvtier ---------------------------------------------------------------
def bench_kvtier(work: Path, requests: int, request_tokens: int, total: int) -> dict:
    import torch

    from kvtier.client.kvcache import KVCache
    from kvtier.common.keys import KVLayout, Namespace

    layout = KVLayout(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float16",
                      block_tokens=BLOCK_TOKENS)
    ns = Namespace("llama-3-8b-bench", layout)
    assert layout.block_raw_bytes == 32 * MiB
    request_bytes = request_tokens // BLOCK_TOKENS * layout.block_raw_bytes
    device_size = f"{max(512, 3 * (total + request_bytes) // DEVICES // MiB)}m"  # 2/3 full after both stores
    nixl = importlib.util.find_spec("nixl_cu12") is not None
    d = start_kvtierd(work, "--device-size", device_size, "--region-size", REGION_SIZE, "--stripe-size", "1m",
                      "--nixl", "on" if nixl else "off", env={**os.environ, **NIXL_LOOPBACK})
    try:
        reqs = [make_request(SEED, i, request_tokens, LAYERS, KV_HEADS, HEAD_DIM) for i in range(requests)]
        warmup = make_request(SEED, requests, request_tokens, LAYERS, KV_HEADS, HEAD_DIM)  # other tokens, untimed
        warm_out = torch.zeros(LAYERS, 2, 1, KV_HEADS, request_tokens, HEAD_DIM, dtype=torch.float16)
        store = store_all(d, ns, reqs, warmup, total, "tcp")
        # the same requests again under another namespace (other keys), the daemon READing them from our memory
        store_nixl = store_all(d, Namespace("llama-3-8b-bench-nixl", layout), reqs, warmup, total, "nixl") \
            if nixl else None
        progress("kvtier: drop page cache, restart kvtierd")
        drop_page_cache()
        d.restart()
        load = Meter()
        # the engine's own KV memory, allocated before the clock starts, as LMCache's retrieve is given its outputs
        outs = [torch.zeros(LAYERS, 2, 1, KV_HEADS, request_tokens, HEAD_DIM, dtype=torch.float16) for _ in reqs]
        with KVCache(ns, d.data_addr, hot_pool_bytes=0, transport="tcp", pool_size=KVCACHE_STREAMS) as cache:
            cache.load(warmup[0], out=warm_out)  # untimed: a daemon just restarted touches its reply buffers once
            for (tokens, kv), out in zip(reqs, outs):
                with load(d.pid):
                    got = cache.load(tokens, out=out)
                assert got.num_tokens == request_tokens and got.blocks_warm == request_tokens // BLOCK_TOKENS, \
                    f"load gave {got.num_tokens} tokens ({got.blocks_hot} hot, {got.blocks_warm} warm)"
                check_same(kv, got.layers)
                del got
            progress(f"kvtier: loaded and checked {total / load.wall_s / 1e9:.2f} GB/s; lookups")
            lookup = lookup_latencies(cache, reqs[0][0], request_tokens)
            cache.flush()  # direct reads serve sealed regions only
        progress("kvtier: drop page cache, restart kvtierd; load again by direct device reads")
        drop_page_cache()
        d.restart()
        direct = Meter()
        with KVCache(ns, d.data_addr, hot_pool_bytes=0, transport="direct", pool_size=KVCACHE_STREAMS,
                     device_map=device_map_of(d)) as cache:
            cache.load(warmup[0], out=warm_out)
            for (tokens, kv), out in zip(reqs, outs):
                out.zero_()
                with direct(d.pid):
                    got = cache.load(tokens, out=out)
                assert got.transports == {"direct": request_tokens // BLOCK_TOKENS}, got.transports
                check_same(kv, got.layers)
                del got
        progress(f"kvtier: loaded by direct reads and checked {total / direct.wall_s / 1e9:.2f} GB/s")
        by_nixl = load_by_nixl(d, ns, reqs, outs, total, (warmup[0], warm_out)) if nixl else None
        per_gib = lambda m: {"client": m.client_s * GiB / total, "daemon": m.daemon_s * GiB / total,  # noqa: E731
                             "total": (m.client_s + m.daemon_s) * GiB / total,
                             "client_gc": m.gc_s * GiB / total, "client_gc_collections": m.gc_collections}
        cpu = {"store": per_gib(store), "load": per_gib(load), "load_direct": per_gib(direct)}
        if by_nixl is not None:
            cpu["load_nixl"] = per_gib(by_nixl)
            cpu["store_nixl"] = per_gib(store_nixl)
        return {"bytes": total, "blocks": total // layout.block_raw_bytes, "device_size": device_size,
                "devices": DEVICES, "region_size": REGION_SIZE, "transport": "tcp", "hot_pool_bytes": 0,
                "store_bytes_per_s": total / store.wall_s, "load_bytes_per_s": total / load.wall_s,
                "store_nixl_bytes_per_s": None if store_nixl is None else total / store_nixl.wall_s,
                "load_direct_bytes_per_s": total / direct.wall_s,
                "load_nixl_bytes_per_s": None if by_nixl is None else total / by_nixl.wall_s,
                "cpu_s_per_gib": cpu,
                "lookup_us": lookup["tokens"], "lookup_keys_us": lookup["keys"], "bytes_checked": True}
    finally:
        d.stop()


def store_all(d, ns, reqs, warmup, total: int, transport: str):
    """Every request stored durably through ``transport``, after one untimed request of other tokens."""
    from kvtier.client.kvcache import KVCache

    progress(f"kvtier: store {len(reqs)} requests ({total / GiB:.2f} GiB) through {transport}, durable "
             "(after one untimed request)")
    meter = Meter()
    with KVCache(ns, d.data_addr, hot_pool_bytes=0, transport=transport, pool_size=KVCACHE_STREAMS) as cache:
        if transport == "nixl" and not cache.wait_nixl_ready(NIXL_READY_TIMEOUT_S):
            raise RuntimeError(f"the nixl transport was not ready within {NIXL_READY_TIMEOUT_S} s")
        cache.store(*warmup, durable=True)  # the daemon's and the client's buffers touched once, as in service
        for tokens, kv in reqs:
            with meter(d.pid):
                written = cache.store(tokens, kv, durable=True)
            assert written == len(tokens) // BLOCK_TOKENS, f"stored {written} blocks"
        if transport == "nixl":
            puts = [dm.nixl.ready().statistics() for dm in cache._warm.daemons]
            assert all(s.put_blocks >= written * len(reqs) for s in puts), f"blocks not PUT through NIXL: {puts}"
    progress(f"kvtier: stored through {transport} {total / meter.wall_s / 1e9:.2f} GB/s")
    return meter


def load_by_nixl(d, ns, reqs, outs, total: int, warmup):
    """Page cache dropped, kvtierd restarted: every request loaded through the nixl transport into
    its zeroed output (the daemon scatters each block into the output's rows), bytes compared."""
    from kvtier.client.kvcache import KVCache

    progress("kvtier: drop page cache, restart kvtierd; load again through NIXL")
    drop_page_cache()
    d.restart()
    meter = Meter()
    with KVCache(ns, d.data_addr, hot_pool_bytes=0, transport="nixl", pool_size=KVCACHE_STREAMS) as cache:
        if not cache.wait_nixl_ready(NIXL_READY_TIMEOUT_S):
            raise RuntimeError("the nixl transport was not ready within "
                               f"{NIXL_READY_TIMEOUT_S} s: {cache.statistics().as_dict().get('warm')}")
        cache.load(warmup[0], out=warmup[1])
        for (tokens, kv), out in zip(reqs, outs):
            out.zero_()
            with meter(d.pid):
                got = cache.load(tokens, out=out)
            assert got.transports == {"nixl": len(tokens) // BLOCK_TOKENS}, got.transports
            check_same(kv, got.layers)
            del got
    progress(f"kvtier: loaded through NIXL and checked {total / meter.wall_s / 1e9:.2f} GB/s")
    return meter


def check_same(kv, layers) -> None:
    import torch

    assert len(layers) == len(kv)
    for i, ((k, v), (k2, v2)) in enumerate(zip(kv, layers)):
        if not (torch.equal(k.view(torch.int16), k2.view(torch.int16))
                and torch.equal(v.view(torch.int16), v2.view(torch.int16))):
            raise AssertionError(f"loaded KV of layer {i} differs from what was stored")


def lookup_latencies(cache, tokens, request_tokens: int) -> dict:
    """``lookup(tokens)`` (hashes the tokens, one LOOKUP) and ``lookup_keys``
    (keys hashed beforehand: the round trip alone) of one request's blocks."""
    assert cache.lookup(tokens) == request_tokens
    keys = cache.keys_for(tokens)
    out = {}
    for name, fn, arg in (("tokens", cache.lookup, tokens), ("keys", cache.lookup_keys, keys)):
        lat = []
        for _ in range(LOOKUP_ROUNDS):
            t0 = time.perf_counter()
            fn(arg)
            lat.append(time.perf_counter() - t0)
        out[name] = dict(percentiles_us(lat), blocks=len(keys))
    return out


# -- 2. LMCache --------------------------------------------------------------
def bench_lmcache(work: Path, python: str, requests: int, request_tokens: int, children: list) -> dict:
    if not Path(python).exists():
        return {"skipped": f"{python} not found (see the module doc for the venv)"}
    cfg = {"dir": str(work), "requests": requests, "request_tokens": request_tokens, "layers": LAYERS,
           "heads": KV_HEADS, "head_dim": HEAD_DIM, "block_tokens": BLOCK_TOKENS, "seed": SEED,
           "io_threads": KVCACHE_STREAMS}
    cmd = [python, str(ROOT / "perf" / "lmcache_side.py"), json.dumps(cfg)]
    env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_LOG_LEVEL=os.environ.get("LMCACHE_LOG_LEVEL", "WARNING"))
    env.pop("PYTHONPATH", None)
    progress(f"lmcache: {shlex.join(cmd[:2])} ... (its own venv)")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, env=env, text=True, start_new_session=True)
    children.append(proc)
    try:
        out, _ = proc.communicate(timeout=LMCACHE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"lmcache_side.py ran past {LMCACHE_TIMEOUT_S} s")
    if proc.returncode != 0:
        raise RuntimeError(f"lmcache_side.py exited {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


# -- 3. fio and 4. iperf3 ----------------------------------------------------
def bench_fio(work: Path, total: int) -> dict:
    """2 MiB, QD1, direct=1 write (end_fsync) then, page cache dropped, read."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "fio.dat"
    out = {}
    for rw in ("write", "read"):
        if rw == "read":
            drop_page_cache()
        cmd = ["fio", "--output-format=json", "--name=store_load", f"--filename={path}", "--ioengine=psync",
               "--direct=1", "--bs=2m", "--iodepth=1", f"--rw={rw}", f"--size={total}", "--numjobs=1",
               "--end_fsync=1" if rw == "write" else "--end_fsync=0"]
        progress(f"fio {rw}: {total / GiB:.2f} GiB, 2 MiB, QD1, O_DIRECT")
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                        timeout=FIO_TIMEOUT_S).stdout)
        job = res["jobs"][0]
        side = job[rw]
        runtime_s = job["job_runtime"] / 1e3
        cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * runtime_s
        out[rw] = {"bytes_per_s": side["bw_bytes"], "bytes": side["io_bytes"],
                   "cpu_s_per_gib": cpu_s * GiB / side["io_bytes"],
                   "clat_us_p50": side["clat_ns"]["percentile"].get("50.000000", 0) / 1e3,
                   "clat_us_p99": side["clat_ns"]["percentile"].get("99.000000", 0) / 1e3,
                   "command": shlex.join(cmd)}
    path.unlink()
    return out


def bench_iperf3(streams: int, seconds: int, children: list) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["iperf3", "-s", "-1", "--forceflush", "-B", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    children.append(server)
    with selectors.DefaultSelector() as sel:  # it prints a banner once it listens
        sel.register(server.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=IPERF3_READY_TIMEOUT_S):
            raise RuntimeError(f"iperf3 -s printed nothing in {IPERF3_READY_TIMEOUT_S} s")
    cmd = ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-P", str(streams), "-t", str(seconds), "-J"]
    progress(f"iperf3: {shlex.join(cmd)}")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30)
    server.wait(timeout=30)
    doc = json.loads(res.stdout or "{}")
    if "end" not in doc or "sum_received" not in doc["end"]:
        raise RuntimeError(f"iperf3 failed: {res.stdout[-500:]} {res.stderr[-500:]}")
    cpu = doc["end"].get("cpu_utilization_percent", {})
    return {"bytes_per_s": doc["end"]["sum_received"]["bits_per_second"] / 8, "streams": streams,
            "seconds": seconds, "cpu_utilization_percent": cpu, "command": shlex.join(cmd)}


# -- ratios and report -------------------------------------------------------
def ratios(r: dict) -> dict:
    k, fio, ip = r["kvtier"], r["fio"], r["iperf3"]["bytes_per_s"]
    out = {"store_vs_min_fio_write_iperf3": k["store_bytes_per_s"] / min(fio["write"]["bytes_per_s"], ip),
           **({} if k.get("store_nixl_bytes_per_s") is None else
              {"store_nixl_vs_fio_write": k["store_nixl_bytes_per_s"] / fio["write"]["bytes_per_s"]}),
           "load_vs_min_fio_read_iperf3": k["load_bytes_per_s"] / min(fio["read"]["bytes_per_s"], ip),
           "load_direct_vs_fio_read": k["load_direct_bytes_per_s"] / fio["read"]["bytes_per_s"],
           **({} if k.get("load_nixl_bytes_per_s") is None else
              {"load_nixl_vs_fio_read": k["load_nixl_bytes_per_s"] / fio["read"]["bytes_per_s"]}),
           # CPU per GiB against fio's for the same direction (fio's own usr+sys over its runtime)
           "store_cpu_total_vs_fio_write": k["cpu_s_per_gib"]["store"]["total"] / fio["write"]["cpu_s_per_gib"],
           "load_cpu_total_vs_fio_read": k["cpu_s_per_gib"]["load"]["total"] / fio["read"]["cpu_s_per_gib"]}
    lm = r.get("lmcache", {})
    if "skipped" not in lm:
        out.update({
            # kvtier's store is durable (fsynced by the daemon): against LMCache's write + fsync, and its
            # own completion without fsync
            "store_vs_lmcache_durable": k["store_bytes_per_s"] / lm["store_durable_bytes_per_s"],
            "store_vs_lmcache": k["store_bytes_per_s"] / lm["store_bytes_per_s"],
            **({} if k.get("store_nixl_bytes_per_s") is None else
               {"store_nixl_vs_lmcache_durable": k["store_nixl_bytes_per_s"] / lm["store_durable_bytes_per_s"]}),
            "load_vs_lmcache": k["load_bytes_per_s"] / lm["load_bytes_per_s"],
            "load_direct_vs_lmcache": k["load_direct_bytes_per_s"] / lm["load_bytes_per_s"],
            **({} if k.get("load_nixl_bytes_per_s") is None else
               {"load_nixl_vs_lmcache": k["load_nixl_bytes_per_s"] / lm["load_bytes_per_s"]}),
            # kvtier client + daemon against LMCache's one process (it does all of its work in-process)
            "store_cpu_total_vs_lmcache": k["cpu_s_per_gib"]["store"]["total"] / lm["cpu_s_per_gib"]["store_durable"],
            "load_cpu_total_vs_lmcache": k["cpu_s_per_gib"]["load"]["total"] / lm["cpu_s_per_gib"]["load"],
            "store_cpu_client_vs_lmcache": k["cpu_s_per_gib"]["store"]["client"]
            / lm["cpu_s_per_gib"]["store_durable"],
            "load_cpu_client_vs_lmcache": k["cpu_s_per_gib"]["load"]["client"] / lm["cpu_s_per_gib"]["load"],
            "lookup_p50_vs_lmcache": k["lookup_us"]["p50"] / lm["lookup_us"]["p50"],
            "lookup_p99_vs_lmcache": k["lookup_us"]["p99"] / lm["lookup_us"]["p99"],
        })
    return out


def print_table(r: dict) -> None:
    gb = lambda v: f"{v / 1e9:6.2f} GB/s"  # noqa: E731
    k, fio, lm = r["kvtier"], r["fio"], r.get("lmcache", {})
    rows = [("kvtier store (durable)", gb(k["store_bytes_per_s"])),
            ("kvtier load (after drop_caches + restart)", gb(k["load_bytes_per_s"])),
            ("kvtier load, direct device reads", gb(k["load_direct_bytes_per_s"])),
            ("kvtier CPU s/GiB direct load: client / daemon",
             f"{k['cpu_s_per_gib']['load_direct']['client']:6.2f} / {k['cpu_s_per_gib']['load_direct']['daemon']:.2f}"),
            *([] if k.get("load_nixl_bytes_per_s") is None else [
                ("kvtier store through NIXL (durable, the daemon READs)", gb(k["store_nixl_bytes_per_s"])),
                ("kvtier CPU s/GiB NIXL store: client / daemon",
                 f"{k['cpu_s_per_gib']['store_nixl']['client']:6.2f} / {k['cpu_s_per_gib']['store_nixl']['daemon']:.2f}"),
                ("kvtier load through NIXL (shared memory)", gb(k["load_nixl_bytes_per_s"])),
                ("kvtier CPU s/GiB NIXL load: client / daemon",
                 f"{k['cpu_s_per_gib']['load_nixl']['client']:6.2f} / {k['cpu_s_per_gib']['load_nixl']['daemon']:.2f}")]),
            ("kvtier CPU s/GiB store: client / daemon",
             f"{k['cpu_s_per_gib']['store']['client']:6.2f} / {k['cpu_s_per_gib']['store']['daemon']:.2f}"),
            ("kvtier CPU s/GiB load: client / daemon",
             f"{k['cpu_s_per_gib']['load']['client']:6.2f} / {k['cpu_s_per_gib']['load']['daemon']:.2f}"),
            ("kvtier client GC s/GiB (full collections), TCP store / load",
             f"{k['cpu_s_per_gib']['store']['client_gc']:6.3f} ({k['cpu_s_per_gib']['store']['client_gc_collections'][2]})"
             f" / {k['cpu_s_per_gib']['load']['client_gc']:.3f} ({k['cpu_s_per_gib']['load']['client_gc_collections'][2]})"),
            (f"kvtier lookup {k['lookup_us']['blocks']} blocks p50 / p99",
             f"{k['lookup_us']['p50']:6.0f} / {k['lookup_us']['p99']:.0f} us"),
            ("kvtier lookup_keys (no hashing) p50 / p99",
             f"{k['lookup_keys_us']['p50']:6.0f} / {k['lookup_keys_us']['p99']:.0f} us")]
    if "skipped" in lm:
        rows.append(("LMCache", f"skipped: {lm['skipped']}"))
    else:
        rows += [("LMCache store (its completion)", gb(lm["store_bytes_per_s"])),
                 ("LMCache store + fsync", gb(lm["store_durable_bytes_per_s"])),
                 ("LMCache retrieve (after drop_caches)", gb(lm["load_bytes_per_s"])),
                 ("LMCache CPU s/GiB store+fsync / retrieve",
                  f"{lm['cpu_s_per_gib']['store_durable']:6.2f} / {lm['cpu_s_per_gib']['load']:.2f}"),
                 ("LMCache copy connector store / retrieve",
                  f"{gb(lm['connector_bytes_per_s']['store'])} / {gb(lm['connector_bytes_per_s']['load'])}"),
                 (f"LMCache lookup {lm['lookup_us']['blocks']} chunks p50 / p99",
                  f"{lm['lookup_us']['p50']:6.0f} / {lm['lookup_us']['p99']:.0f} us")]
    rows += [("fio write 2 MiB QD1 direct (+end_fsync)", gb(fio["write"]["bytes_per_s"])),
             ("fio read 2 MiB QD1 direct", gb(fio["read"]["bytes_per_s"])),
             ("fio CPU s/GiB write / read",
              f"{fio['write']['cpu_s_per_gib']:6.2f} / {fio['read']['cpu_s_per_gib']:.2f}"),
             (f"iperf3 loopback, {r['iperf3']['streams']} streams", gb(r["iperf3"]["bytes_per_s"]))]
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    print()
    for name, v in r["ratios"].items():
        print(f"{name:<{width}}  {v:7.2f}")


def reap_children(grace_s: float = 10.0) -> None:
    """End this process's own children that are still running (a kvtierd whose
    start was interrupted before its handle was returned): SIGTERM, then SIGKILL."""
    me, pids = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        if int(fields[1]) == me and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pid in pids:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)  # bounded by grace_s: a cleanup path, not a wait for a result


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_TOTAL_BYTES // MiB} MiB in {QUICK_REQUEST_TOKENS}-token requests (a smoke run)")
    ap.add_argument("--total-mib", type=int, help=f"bytes stored and loaded (default {TOTAL_BYTES // MiB})")
    ap.add_argument("--lmcache-python", default=LMCACHE_PYTHON, help="python of the LMCache venv")
    ap.add_argument("--skip-lmcache", action="store_true")
    ap.add_argument("--out", help="JSON path (default perf/results/<UTC date>/store_load.json)")
    args = ap.parse_args(argv)

    request_tokens = QUICK_REQUEST_TOKENS if args.quick else REQUEST_TOKENS
    total = (args.total_mib * MiB) if args.total_mib else (QUICK_TOTAL_BYTES if args.quick else TOTAL_BYTES)
    request_bytes = request_tokens // BLOCK_TOKENS * 32 * MiB
    if total % request_bytes or not 0 < total <= TOTAL_BYTES_MAX:
        ap.error(f"total must be a multiple of {request_bytes // MiB} MiB (one request), at most "
                 f"{TOTAL_BYTES_MAX // GiB} GiB")
    if os.geteuid() != 0:
        ap.error("needs root: it drops the page cache (/proc/sys/vm/drop_caches)")
    for tool in ("fio", "iperf3"):
        if shutil.which(tool) is None:
            ap.error(f"{tool} not found: apt-get install {tool}")
    requests = total // request_bytes
    started, t_start = time.gmtime(), time.monotonic()
    out_path = Path(args.out) if args.out else ROOT / "perf" / "results" / time.strftime("%Y-%m-%d", started) \
        / "store_load.json"
    work = Path(tempfile.mkdtemp(prefix="kvtier-store-load-", dir=WORK_PARENT))
    fs = fs_type(work)
    if fs in ("tmpfs", "ramfs"):
        shutil.rmtree(work)
        ap.error(f"{WORK_PARENT} is {fs}: the benchmark needs a disk")

    children: list[subprocess.Popen] = []
    for signum in (signal.SIGINT, signal.SIGTERM):  # clean up on kill as on Ctrl-C (also where SIGINT was ignored)
        signal.signal(signum, _interrupted)
    result = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", started),
              "command": shlex.join([sys.executable.replace(str(ROOT) + "/", ""), "perf/bench_store_load.py",
                                     *sys.argv[1:]]),
              "config": {"layout": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                    "dtype": "float16", "block_tokens": BLOCK_TOKENS},
                         "block_raw_bytes": 32 * MiB, "request_tokens": request_tokens, "requests": requests,
                         "total_bytes": total, "work_dir": str(work), "work_fs": fs, "cpus": os.cpu_count(),
                         "loadavg_start": os.getloadavg()}}
    try:
        result["kvtier"] = bench_kvtier(work / "kvtierd", requests, request_tokens, total)
        shutil.rmtree(work / "kvtierd")
        if args.skip_lmcache:
            result["lmcache"] = {"skipped": "--skip-lmcache"}
        else:
            result["lmcache"] = bench_lmcache(work / "lmcache", args.lmcache_python, requests, request_tokens,
                                              children)
        shutil.rmtree(work / "lmcache", ignore_errors=True)
        result["fio"] = bench_fio(work / "fio", total)
        result["iperf3"] = bench_iperf3(KVCACHE_STREAMS, IPERF3_SECONDS, children)
    except KeyboardInterrupt:
        progress("interrupted: cleaning up")
        raise
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reap_children()
        shutil.rmtree(work, ignore_errors=True)
    result["config"]["loadavg_end"] = os.getloadavg()
    result["config"]["wall_s"] = time.monotonic() - t_start
    result["ratios"] = ratios(result)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    progress(f"wrote {out_path}")
    if result["kvtier"].get("load_nixl_bytes_per_s") is not None:
        sys.stdout.flush()
        os._exit(0)  # a UCX backend exists in this process: skip its teardown at exit (docs/nixl.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
