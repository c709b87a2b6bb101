#!/usr/bin/env python3
"""Steady-state benchmark of the block engine: a store written many times over its capacity.

    .venv/bin/python perf/bench_steady_state.py [--capacity-mib 256] [--fill-x 20] [--dir DIR]
                                                [--out perf/out/steady_state.json]

1. Fill: four writer threads (two of 2 MiB blocks, two of 64 KiB blocks, buffered puts) write
   ``--fill-x`` times the store's capacity while a reader thread runs LOOKUPs and GETs of keys
   written recently. PUT throughput of the empty store (the first half capacity written, before
   any eviction) against the steady state (from 2x capacity written to the end); LOOKUP and GET
   p99 during the fill against the same reader on the idle store (writers stopped).
2. Durable stream: one writer of durable 64 KiB puts while the reader runs GETs of sealed
   blocks (read from flash in both phases); GET p99 against idle.
3. Region rollover: the time per region filled, with 1 k and with 100 k regions of 8 KiB (sparse
   files, three blocks a region), once the store is full (every rollover takes a clean region the
   worker reclaimed); the first pass over the empty store is reported too.

Files are O_DIRECT files in ``--dir`` (a temporary directory by default). Absolute figures are
noisy on a shared machine: compare the ratios, which are measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvtier.common.blockformat import HEADER_SIZE, encode_block
from kvtier.daemon.engine import Engine, EngineConfig
from kvtier.daemon.engine import regionfmt as fmt
from kvtier.daemon.engine.index import BlockIndex

MiB = 1 << 20
NS = bytes(16)
LARGE_PAYLOAD = 2 * MiB - HEADER_SIZE
SMALL_PAYLOAD = 64 * 1024 - HEADER_SIZE
RECENT_KEYS = 256  # the reader picks among the keys written last (likely still stored)
READER_BATCH = 4  # keys per LOOKUP and per GET


def key_of(writer: int, i: int) -> bytes:
    return writer.to_bytes(4, "little") + i.to_bytes(12, "little")


class Recent:
    """Keys written lately, shared by the writers and the reader."""

    def __init__(self):
        self._lock = threading.Lock()
        self._keys: list[bytes] = []

    def add(self, key: bytes) -> None:
        with self._lock:
            self._keys.append(key)
            if len(self._keys) > 4 * RECENT_KEYS:
                del self._keys[:-RECENT_KEYS]

    def sample(self, rng, n: int) -> list[bytes]:
        with self._lock:
            keys = self._keys[-RECENT_KEYS:]
        return [keys[int(rng.integers(len(keys)))] for _ in range(n)] if keys else []


def private_index(keys: int = 100_000) -> BlockIndex:
    """A table of the engine's kind that nothing else touches: probing it during the fill times what
    the machine (two cores, the GIL, the writers' CPU) does to any probe, without the engine."""
    index = BlockIndex()
    rng = np.random.default_rng(7)
    k0, k1 = rng.integers(1, 1 << 63, keys, dtype=np.uint64), rng.integers(1, 1 << 63, keys, dtype=np.uint64)
    index.insert_many(k0, k1, np.zeros(keys, np.uint64), np.ones(keys, np.uint32), np.zeros(keys, np.uint32))
    return index


def reader(engine, recent: Recent, stop: threading.Event, lookups: list, gets: list, pause_s: float,
           probes: list | None = None) -> None:
    rng = np.random.default_rng(1)
    private = private_index()
    while not stop.is_set():
        keys = recent.sample(rng, READER_BATCH)
        if not keys:
            time.sleep(0.001)
            continue
        k0, k1 = fmt.keys_to_halves(keys)
        t0 = time.perf_counter()
        private.find_many(k0, k1)
        t1 = time.perf_counter()
        engine.lookup(keys)
        t2 = time.perf_counter()
        engine.get_many(keys)
        t3 = time.perf_counter()
        if probes is not None:
            probes.append(t1 - t0)
        lookups.append(t2 - t1)
        gets.append(t3 - t2)
        stop.wait(pause_s)


def p99_us(samples: list) -> float:
    return float(np.percentile(np.array(samples), 99) * 1e6) if samples else float("nan")


def open_store(directory: Path, capacity_bytes: int, region_bytes: int, devices: int = 2, **kw) -> Engine:
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    paths = []
    for i in range(devices):
        path = directory / f"d{i}.img"
        with open(path, "wb") as f:
            f.truncate(capacity_bytes // devices + (1 << 20))  # sparse: the superblock area too
        paths.append(str(path))
    cfg = EngineConfig(device_paths=tuple(paths), stripe_size_bytes=min(1 << 20, region_bytes // devices),
                       region_size_bytes=region_bytes, **kw)
    Engine.format(cfg)
    return Engine.open(cfg)


def fill_phase(engine: Engine, capacity_bytes: int, fill_x: float) -> dict:
    recent, stop = Recent(), threading.Event()
    written = [0]
    marks: list[tuple[float, int]] = []  # (time, bytes written) samples for the throughput phases
    lock = threading.Lock()
    target = int(capacity_bytes * fill_x)

    def writer(w: int, payload: int) -> None:
        data = np.random.default_rng(w).integers(0, 256, payload, dtype=np.uint8).tobytes()
        i = 0
        while True:
            with lock:
                if written[0] >= target:
                    return
            key = key_of(w, i)
            engine.put(encode_block(key, NS, 0, data))
            recent.add(key)
            with lock:
                written[0] += payload + HEADER_SIZE
                marks.append((time.perf_counter(), written[0]))
            i += 1

    # idle reader figures: a few blocks written, then the reader alone
    for w, payload in ((0, LARGE_PAYLOAD), (2, SMALL_PAYLOAD)):
        data = bytes(payload)
        for i in range(64):
            engine.put(encode_block(key_of(100 + w, i), NS, 0, data))
            recent.add(key_of(100 + w, i))
    idle_lookups, idle_gets, idle_probes = [], [], []
    idle_stop = threading.Event()
    t = threading.Thread(target=reader, args=(engine, recent, idle_stop, idle_lookups, idle_gets, 0.0005, idle_probes))
    t.start()
    time.sleep(3)
    idle_stop.set()
    t.join()

    lookups, gets, probes = [], [], []
    rt = threading.Thread(target=reader, args=(engine, recent, stop, lookups, gets, 0.0005, probes))
    rt.start()
    writers = [threading.Thread(target=writer, args=(w, LARGE_PAYLOAD if w < 2 else SMALL_PAYLOAD)) for w in range(4)]
    t0 = time.perf_counter()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    elapsed = time.perf_counter() - t0
    stop.set()
    rt.join()
    times = np.array([m[0] for m in marks]) - t0
    done = np.array([m[1] for m in marks])

    def rate(lo_bytes: float, hi_bytes: float) -> float:
        sel = (done >= lo_bytes) & (done <= hi_bytes)
        if sel.sum() < 2:
            return float("nan")
        return float((done[sel][-1] - done[sel][0]) / (times[sel][-1] - times[sel][0]))

    st = engine.statistics()
    return {"written_bytes": int(written[0]), "seconds": elapsed,
            "put_empty_bytes_per_s": rate(0, capacity_bytes * 0.5),
            "put_steady_bytes_per_s": rate(capacity_bytes * 2, target),
            "lookup_p99_idle_us": p99_us(idle_lookups), "get_p99_idle_us": p99_us(idle_gets),
            "lookup_p99_fill_us": p99_us(lookups), "get_p99_fill_us": p99_us(gets),
            "private_probe_p99_idle_us": p99_us(idle_probes), "private_probe_p99_fill_us": p99_us(probes),
            "reader_ops_idle": len(idle_gets), "reader_ops_fill": len(gets),
            "evicted_regions": st.evicted_regions, "clean_region_waits": st.clean_region_waits,
            "clean_region_wait_seconds": st.clean_region_wait_seconds, "reclaims": st.reclaims}


def durable_phase(engine: Engine, seconds: float) -> dict:
    recent, stop = Recent(), threading.Event()
    data = bytes(SMALL_PAYLOAD)
    for i in range(128):
        engine.put(encode_block(key_of(200, i), NS, 0, data))
        recent.add(key_of(200, i))
    for i in range(2 * engine.region_size_bytes // len(data)):  # the reader's blocks sealed: read from flash
        engine.put(encode_block(key_of(202, i), NS, 0, data))
    idle_l, idle_g, l, g = [], [], [], []
    idle_stop = threading.Event()
    t = threading.Thread(target=reader, args=(engine, recent, idle_stop, idle_l, idle_g, 0.0005))
    t.start()
    time.sleep(seconds / 2)
    idle_stop.set()
    t.join()
    puts = [0]

    def durable_writer() -> None:
        i = 0
        while not stop.is_set():
            engine.put(encode_block(key_of(201, i), NS, 0, data), durable=True)
            i += 1
        puts[0] = i

    before = engine.statistics()
    rt = threading.Thread(target=reader, args=(engine, recent, stop, l, g, 0.0005))
    wt = threading.Thread(target=durable_writer)
    rt.start()
    wt.start()
    time.sleep(seconds)
    stop.set()
    rt.join()
    wt.join()
    after = engine.statistics()
    return {"get_p99_idle_us": p99_us(idle_g), "get_p99_durable_us": p99_us(g), "durable_puts": puts[0],
            "durable_puts_per_s": puts[0] / seconds, "group_commits": after.group_commits - before.group_commits,
            "reader_ops": len(g)}


def rollover_phase(directory: Path, regions: int, measured: int) -> dict:
    """Fill the empty store once, then time ``measured`` more regions: each rollover takes a
    clean region the worker reclaimed (the store is full)."""
    region = 8 * 1024
    engine = open_store(directory, regions * region, region, devices=1)
    data = bytes(1000)  # 1064-byte blocks: three a region
    per_region = 3
    first_pass = regions * per_region
    t0 = time.perf_counter()
    for i in range(first_pass):
        engine.put(encode_block(i.to_bytes(16, "little"), NS, 0, data))
    t1 = time.perf_counter()
    before = engine.statistics()
    for i in range(first_pass, first_pass + measured * per_region):
        engine.put(encode_block(i.to_bytes(16, "little"), NS, 0, data))
    t2 = time.perf_counter()
    st = engine.statistics()
    engine.close()
    shutil.rmtree(directory)
    return {"regions": regions, "rollover_us": (t2 - t1) / measured * 1e6, "rollovers": measured,
            "reclaims": st.reclaims - before.reclaims, "first_pass_rollover_us": (t1 - t0) / regions * 1e6,
            "index_blocks": st.blocks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity-mib", type=int, default=256)
    ap.add_argument("--fill-x", type=float, default=20.0)
    ap.add_argument("--region-mib", type=int, default=16)
    ap.add_argument("--durable-seconds", type=float, default=6.0)
    ap.add_argument("--rollover-regions", default="1000,100000")
    ap.add_argument("--rollovers", type=int, default=2000, help="rollovers timed once the store is full")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default="perf/out/steady_state.json")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-steady-"))
    out: dict = {"capacity_mib": args.capacity_mib, "fill_x": args.fill_x, "region_mib": args.region_mib,
                 "cpus": os.cpu_count()}
    engine = open_store(base / "fill", args.capacity_mib * MiB, args.region_mib * MiB)
    out["fill"] = fill_phase(engine, engine.statistics().regions_total * args.region_mib * MiB, args.fill_x)
    out["durable"] = durable_phase(engine, args.durable_seconds)
    out["clean_regions_target"] = engine.statistics().clean_regions_target
    engine.close()
    shutil.rmtree(base / "fill")
    out["rollover"] = [rollover_phase(base / f"roll{n}", int(n), args.rollovers)
                       for n in args.rollover_regions.split(",")]
    f = out["fill"]
    out["ratios"] = {
        "put_steady_over_empty": f["put_steady_bytes_per_s"] / f["put_empty_bytes_per_s"],
        "lookup_p99_fill_over_idle": f["lookup_p99_fill_us"] / f["lookup_p99_idle_us"],
        # the same probe on a table no other thread touches, during the same fill: the machine's share
        "private_probe_p99_fill_over_idle": f["private_probe_p99_fill_us"] / f["private_probe_p99_idle_us"],
        "lookup_p99_fill_over_private_probe_fill": f["lookup_p99_fill_us"] / f["private_probe_p99_fill_us"],
        "get_p99_fill_over_idle": f["get_p99_fill_us"] / f["get_p99_idle_us"],
        "get_p99_durable_over_idle": out["durable"]["get_p99_durable_us"] / out["durable"]["get_p99_idle_us"],
        "rollover_100k_over_1k": out["rollover"][-1]["rollover_us"] / out["rollover"][0]["rollover_us"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
