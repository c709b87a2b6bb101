"""kvtierd over loopback TCP against fio, iperf3 and redis, all in one run.

    .venv/bin/python perf/bench_tcp.py            # 1 GiB of 2 MiB blocks
    .venv/bin/python perf/bench_tcp.py --quick    # 128 MiB, seconds

Steps (each reference is measured in the same run, so ratios are meaningful
on a noisy machine):

1. kvtierd on 4 device files; 4 connections PUT 2 MiB blocks; flush.
2. kvtierd restarted (SIGTERM, start): GET of every block with 4 connections,
   so reads come from flash (the engine uses O_DIRECT, no page cache).
3. LOOKUP of 1024-key chains on one and on 4 connections: keys/s.
3b. The engine alone in this process (4 threads, same sizes): the ceiling
   the daemon could reach, to tell protocol overhead from engine cost.
4. fio on the same device files (daemon stopped): 2 MiB sequential write and
   read, direct=1, one job per file; and the devices' write ceiling (16 MiB
   writes, iodepth 16): how far PUT is from what the disk itself can take.
5. iperf3 on loopback, 4 streams.
6. redis-server + redis-py, 4 connections, the same blocks (SET then GET).
7. (``--transport-compare``) the concurrency-model check: a 2 MiB echo over
   threads + blocking sockets vs asyncio + uvloop with a buffered protocol.

Next to each rate, CPU seconds per GiB (and per LOOKUP key) of the daemon and
of the client are recorded: on a shared, loaded machine the rates swing with
the neighbours' load, the CPU cost of the work does not.

Writes ``perf/out/tcp.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import start_kvtierd  # noqa: E402

from kvtier.client import BlockClient  # noqa: E402
from kvtier.common.blockformat import HEADER_SIZE, encode_block  # noqa: E402

BLOCK_PAYLOAD_BYTES = 2 << 20  # 2 MiB blocks, as the issue asks
CONNECTIONS = 4
BATCH_BLOCKS = 4  # blocks per put_many/get_many call per connection
LOOKUP_CHAIN_KEYS = 1024
NS = b"\x42" * 16
GiB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, every thread (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


class CpuMeter:
    """CPU seconds spent by this process and by ``pid`` over a ``with`` block.

    On a shared, loaded machine wall-clock rates swing with the neighbours'
    load; CPU seconds per byte or per key do not, so they tell whether a change
    made the work cheaper (resolution: one clock tick, 10 ms; run long enough)."""

    def __init__(self, pid: int | None = None):
        self.pid, self.client_s, self.server_s = pid, 0.0, 0.0

    def __enter__(self) -> "CpuMeter":
        self._c0 = time.process_time()
        self._s0 = process_cpu_s(self.pid) if self.pid else 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.client_s = time.process_time() - self._c0
        self.server_s = (process_cpu_s(self.pid) - self._s0) if self.pid else 0.0


def parallel(fn, parts) -> float:
    """Run fn(part) on one thread per part; wall seconds; re-raises a failure."""
    errors = []

    def run(part):
        try:
            fn(part)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in parts]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def make_blocks(n: int):
    payload = os.urandom(BLOCK_PAYLOAD_BYTES)  # one random payload, distinct headers: cheap to build
    keys = [i.to_bytes(4, "little") + b"bench-tcp-k" + bytes(1) for i in range(n)]
    blocks = [encode_block(k, NS, 0, payload[:BLOCK_PAYLOAD_BYTES - (i % 7)]) for i, k in enumerate(keys)]
    return keys, blocks


def bench_kvtierd(work: Path, keys, blocks, device_size: str, region_size: str,
                  devices: list[str] | None = None) -> dict:
    """``devices``: block devices to run on (formatted here), else device files in ``work``."""
    device_args = [a for dev in devices for a in ("--device", dev)] + ["--format", "--force"] if devices else []
    d = start_kvtierd(work / "kvtierd", "--device-size", device_size, "--region-size", region_size,
                      "--stripe-size", "1m", *device_args)
    d.args = [a for a in d.args if a not in ("--format", "--force")]  # a restart keeps the store
    total = sum(len(b) for b in blocks)
    shares = [list(range(i, len(keys), CONNECTIONS)) for i in range(CONNECTIONS)]
    try:
        def put(idx):
            with BlockClient(d.data_addr, pool_size=1) as c:
                for j in range(0, len(idx), BATCH_BLOCKS):
                    c.put_many([(keys[i], blocks[i]) for i in idx[j:j + BATCH_BLOCKS]])
        with CpuMeter(d.proc.pid) as put_cpu:
            put_s = parallel(put, shares)
        with BlockClient(d.data_addr) as c:
            t0 = time.perf_counter()
            c.flush()
            flush_s = time.perf_counter() - t0
        d.restart()  # reads below come from flash
        misses = [0]

        def get(idx):
            with BlockClient(d.data_addr, pool_size=1) as c:
                for j in range(0, len(idx), BATCH_BLOCKS):
                    chunk = idx[j:j + BATCH_BLOCKS]
                    for i, got in zip(chunk, c.get_many([keys[i] for i in chunk])):
                        if got is None or len(got) != len(blocks[i]):
                            misses[0] += 1
        with CpuMeter(d.proc.pid) as get_cpu:
            get_s = parallel(get, shares)

        def get_views(idx):
            with BlockClient(d.data_addr, pool_size=1) as c:
                for j in range(0, len(idx), BATCH_BLOCKS):
                    chunk = idx[j:j + BATCH_BLOCKS]
                    for i, got in zip(chunk, c.get_many([keys[i] for i in chunk], copy=False)):
                        if got is None or len(got) != len(blocks[i]):
                            misses[0] += 1
        with CpuMeter(d.proc.pid) as views_cpu:
            get_views_s = parallel(get_views, shares)
        # spot-check bytes (the client already verified CRC and key of every block)
        with BlockClient(d.data_addr) as c:
            sample = c.get(keys[len(keys) // 2])
            assert sample[HEADER_SIZE:] == blocks[len(keys) // 2][HEADER_SIZE:]
            lookup = bench_lookup(c, keys, d.proc.pid)
        per_gib = lambda cpu: {"daemon": cpu.server_s * GiB / total, "client": cpu.client_s * GiB / total}  # noqa: E731
        return {"put_bytes_per_s": total / put_s, "put_then_flush_bytes_per_s": total / (put_s + flush_s),
                "get_bytes_per_s": total / get_s, "get_views_bytes_per_s": total / get_views_s,
                "get_misses": misses[0], "bytes": total, "blocks": len(blocks),
                "cpu_s_per_gib": {"put": per_gib(put_cpu), "get": per_gib(get_cpu), "get_views": per_gib(views_cpu)},
                **lookup}
    finally:
        d.stop()


def bench_engine_alone(work: Path, keys, blocks, device_size: str, region_size: str) -> dict:
    """The engine in this process, no protocol: what the daemon could reach at best."""
    from kvtier.daemon.config import parse_size
    from kvtier.daemon.engine import Engine, EngineConfig
    (work / "engine").mkdir(parents=True, exist_ok=True)
    cfg = EngineConfig(device_paths=tuple(str(work / "engine" / f"dev{i}.img") for i in range(4)),
                       device_size_bytes=parse_size(device_size), stripe_size_bytes=1 << 20,
                       region_size_bytes=parse_size(region_size))
    total = sum(len(b) for b in blocks)
    shares = [list(range(i, len(keys), CONNECTIONS)) for i in range(CONNECTIONS)]
    eng = Engine.open(cfg, create_if_missing=True)
    try:
        put_s = parallel(lambda idx: [eng.put_many([blocks[i] for i in idx[j:j + BATCH_BLOCKS]])
                                      for j in range(0, len(idx), BATCH_BLOCKS)], shares)
    finally:
        eng.close()
    eng = Engine.open(cfg)
    try:
        with CpuMeter() as get_cpu:
            get_s = parallel(lambda idx: [eng.get_many([keys[i] for i in idx[j:j + BATCH_BLOCKS]])
                                          for j in range(0, len(idx), BATCH_BLOCKS)], shares)
        chain = [keys[i % len(keys)] for i in range(LOOKUP_CHAIN_KEYS)]
        rounds, t0 = 0, time.perf_counter()
        with CpuMeter() as lookup_cpu:
            while time.perf_counter() - t0 < 0.5:
                eng.lookup(chain)
                rounds += 1
        lookup_s = (time.perf_counter() - t0) / rounds
    finally:
        eng.close()
    shutil.rmtree(work / "engine", ignore_errors=True)
    return {"engine_put_bytes_per_s": total / put_s, "engine_get_bytes_per_s": total / get_s,
            "engine_lookup_keys_per_s": LOOKUP_CHAIN_KEYS / lookup_s,
            "engine_get_cpu_s_per_gib": get_cpu.client_s * GiB / total,
            "engine_lookup_cpu_us_per_key": lookup_cpu.client_s * 1e6 / (rounds * LOOKUP_CHAIN_KEYS)}


def bench_lookup(c: BlockClient, keys, daemon_pid: int) -> dict:
    chain = [keys[i % len(keys)] for i in range(LOOKUP_CHAIN_KEYS)]
    assert c.lookup(chain) == LOOKUP_CHAIN_KEYS
    rounds, t0 = 0, time.perf_counter()
    with CpuMeter(daemon_pid) as cpu:
        while time.perf_counter() - t0 < 1.0:
            c.lookup(chain)
            rounds += 1
    one = (time.perf_counter() - t0) / rounds
    shares = [chain] * CONNECTIONS
    per_thread = max(rounds // 2, 10)

    def spin(ch):
        with BlockClient(c._host + f":{c._port}", pool_size=1) as cc:
            for _ in range(per_thread):
                cc.lookup(ch)
    wall = parallel(spin, shares)
    leading, locs = c.lookup_locations(chain)
    assert leading == LOOKUP_CHAIN_KEYS and all(loc is not None and loc.sealed for loc in locs)
    loc_rounds, t0 = 0, time.perf_counter()
    with CpuMeter(daemon_pid) as loc_cpu:
        while time.perf_counter() - t0 < 1.0:
            c.lookup_locations(chain)
            loc_rounds += 1
    loc_one = (time.perf_counter() - t0) / loc_rounds
    loc_keys = loc_rounds * LOOKUP_CHAIN_KEYS
    return {"lookup_locations_keys_per_s_1conn": LOOKUP_CHAIN_KEYS / loc_one,
            "lookup_locations_cpu_us_per_key": {"daemon": loc_cpu.server_s * 1e6 / loc_keys,
                                                "client": loc_cpu.client_s * 1e6 / loc_keys},
            "lookup_keys_per_s_1conn": LOOKUP_CHAIN_KEYS / one,
            "lookup_keys_per_s_4conn": CONNECTIONS * per_thread * LOOKUP_CHAIN_KEYS / wall,
            "lookup_rtt_ms_1024": one * 1e3,
            "lookup_cpu_us_per_key": {"daemon": cpu.server_s * 1e6 / (rounds * LOOKUP_CHAIN_KEYS),
                                      "client": cpu.client_s * 1e6 / (rounds * LOOKUP_CHAIN_KEYS)}}


def bench_fio(devices: list[Path], size: str) -> dict:
    """fio on the device files: one sequential 2 MiB job per file, direct I/O; and what the
    devices take with deep queues (16 MiB writes, 16 in flight per file): the write ceiling.
    A daemon seal keeps one 16 MiB write in flight per device of a 4-device array."""
    out = {}
    runs = (("write", "psync", "2m", 1, "fio_write_bytes_per_s"), ("read", "psync", "2m", 1, "fio_read_bytes_per_s"),
            ("write", "libaio", "16m", 16, "fio_write_ceiling_bytes_per_s"))
    for rw, engine, bs, depth, name in runs:
        cmd = ["fio", "--output-format=json", f"--ioengine={engine}", "--direct=1", f"--bs={bs}", f"--rw={rw}",
               f"--iodepth={depth}", f"--size={size}", "--group_reporting"]
        for i, dev in enumerate(devices):
            cmd += [f"--name=dev{i}", f"--filename={dev}"]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        out[name] = res["jobs"][0][rw]["bw_bytes"]
    return out


class RamDevices:
    """Loop devices over files in /dev/shm: block devices whose medium is DRAM, as redis's is.
    With them the comparison with redis is of the software alone; with the VM's virtual disk,
    reads and writes are bound by that disk (fio in the same run says by how much). Needs root."""

    def __init__(self, count: int, size: str):
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir="/dev/shm"))
        self.paths: list[str] = []
        try:
            for i in range(count):
                backing = self.dir / f"dev{i}"
                subprocess.run(["truncate", "-s", size, str(backing)], check=True)
                out = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                                     capture_output=True, text=True)
                self.paths.append(out.stdout.strip())
        except (OSError, subprocess.CalledProcessError) as exc:
            self.close()
            raise SystemExit(f"--ram-devices needs root and losetup: {exc}") from exc

    def close(self) -> None:
        for path in self.paths:
            subprocess.run(["losetup", "-d", path], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def bench_iperf3(seconds: int) -> dict:
    """iperf3 over loopback with as many streams as kvtierd had connections."""
    port = free_port()
    server = subprocess.Popen(["iperf3", "-s", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for attempt in range(20):
            res = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-P", str(CONNECTIONS), "-t",
                                  str(seconds), "-J"], capture_output=True, text=True, timeout=seconds + 30)
            doc = json.loads(res.stdout or "{}")
            if "end" in doc and "sum_received" in doc["end"]:
                return {"iperf3_bytes_per_s": doc["end"]["sum_received"]["bits_per_second"] / 8}
            time.sleep(0.2)  # the server was not listening yet
        raise RuntimeError(f"iperf3 failed: {res.stdout[-500:]} {res.stderr[-500:]}")
    finally:
        server.kill()
        server.wait()


def bench_redis(keys, blocks) -> dict:
    import redis
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                               "--bind", "127.0.0.1", "--proto-max-bulk-len", "64mb"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        total = sum(len(b) for b in blocks)
        shares = [list(range(i, len(keys), CONNECTIONS)) for i in range(CONNECTIONS)]

        def put(idx):
            cl = redis.Redis(port=port)
            for j in range(0, len(idx), BATCH_BLOCKS):
                pipe = cl.pipeline(transaction=False)
                for i in idx[j:j + BATCH_BLOCKS]:
                    pipe.set(keys[i], blocks[i])
                pipe.execute()

        def get(idx):
            cl = redis.Redis(port=port)
            for j in range(0, len(idx), BATCH_BLOCKS):
                chunk = idx[j:j + BATCH_BLOCKS]
                got = cl.mget([keys[i] for i in chunk])
                assert all(g is not None and len(g) == len(blocks[i]) for g, i in zip(got, chunk))
        with CpuMeter(server.pid) as put_cpu:
            put_s = parallel(put, shares)
        with CpuMeter(server.pid) as get_cpu:
            get_s = parallel(get, shares)
        per_gib = lambda cpu: {"server": cpu.server_s * GiB / total, "client": cpu.client_s * GiB / total}  # noqa: E731
        return {"redis_set_bytes_per_s": total / put_s, "redis_get_bytes_per_s": total / get_s,
                "cpu_s_per_gib": {"set": per_gib(put_cpu), "get": per_gib(get_cpu)}}
    finally:
        server.kill()
        server.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="128 MiB instead of 1 GiB (a smoke run)")
    ap.add_argument("--work-dir", help="where device files go (default: a temp dir under perf/out)")
    ap.add_argument("--transport-compare", action="store_true", help="also run the threads vs uvloop check")
    ap.add_argument("--ram-devices", action="store_true",
                    help="run kvtierd and fio on 4 loop devices over /dev/shm (root): DRAM, as redis, not the disk")
    ap.add_argument("--echo-server", choices=("threads", "uvloop"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "perf" / "out" / "tcp.json"))
    args = ap.parse_args(argv)
    if args.echo_server:
        return run_echo_server(args.echo_server)

    total_bytes = (128 << 20) if args.quick else GiB
    n_blocks = total_bytes // BLOCK_PAYLOAD_BYTES
    device_size, region_size = ("256m", "16m") if args.quick else ("1g", "64m")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-tcp-", dir=Path(args.out).parent))
    keys, blocks = make_blocks(n_blocks)
    result = {"config": {"block_payload_bytes": BLOCK_PAYLOAD_BYTES, "connections": CONNECTIONS,
                         "batch_blocks": BATCH_BLOCKS, "total_bytes": total_bytes, "devices": 4,
                         "device_size": device_size, "region_size": region_size, "quick": args.quick,
                         "medium": "ram (loop over /dev/shm)" if args.ram_devices else "device files",
                         "engine_alone_medium": "device files", "cpus": os.cpu_count()}}
    ram = None
    try:
        ram = RamDevices(4, device_size) if args.ram_devices else None
        result["kvtierd"] = bench_kvtierd(work, keys, blocks, device_size, region_size, ram and ram.paths)
        result["engine_alone"] = bench_engine_alone(work, keys, blocks, device_size, region_size)
        devices = ram.paths if ram else sorted((work / "kvtierd").glob("device*.img"))
        result["fio"] = bench_fio(devices, "64m" if args.quick else "256m")
        result["iperf3"] = bench_iperf3(2 if args.quick else 5)
        result["redis"] = bench_redis(keys, blocks)
        if args.transport_compare:
            result["transport_compare"] = transport_compare(quick=args.quick)
    finally:
        if ram:
            ram.close()
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    result["ratios"] = ratios(result)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


# -- concurrency-model check: 2 MiB echo, threads vs asyncio + uvloop -------
ECHO_FRAME_BYTES = 2 << 20
_LEN = __import__("struct").Struct("<Q")


def run_echo_server(mode: str) -> int:
    """A server process: frames of (u64 length, bytes) are echoed back."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(f"ready {sock.getsockname()[1]}", flush=True)
    if mode == "threads":
        def serve(conn):
            buf = memoryview(bytearray(ECHO_FRAME_BYTES))
            head = bytearray(8)
            with conn:
                while True:
                    if conn.recv_into(head, 8, socket.MSG_WAITALL) < 8:
                        return
                    (n,) = _LEN.unpack(head)
                    got = 0
                    while got < n:
                        got += conn.recv_into(buf[got:n])
                    conn.sendmsg([head, buf[:n]])
        while True:
            conn, _ = sock.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
    import asyncio
    import uvloop

    class Echo(asyncio.BufferedProtocol):
        def connection_made(self, transport):
            self.t = transport
            self.buf = memoryview(bytearray(8 + ECHO_FRAME_BYTES))
            self.pos = 0

        def get_buffer(self, sizehint):
            return self.buf[self.pos:]

        def buffer_updated(self, nbytes):
            self.pos += nbytes
            if self.pos >= 8:
                (n,) = _LEN.unpack_from(self.buf)
                if self.pos >= 8 + n:
                    self.t.write(self.buf[:8 + n])
                    self.pos = 0

    async def serve_async():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Echo, sock=sock)
        await server.serve_forever()
    uvloop.run(serve_async())
    return 0


def transport_compare(quick: bool) -> dict:
    rounds = 64 if quick else 256
    out = {}
    for mode in ("threads", "uvloop"):
        proc = subprocess.Popen([sys.executable, __file__, "--echo-server", mode], stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline().split()[1])
            payload = os.urandom(ECHO_FRAME_BYTES)

            def client(_):
                with socket.create_connection(("127.0.0.1", port)) as c:
                    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    back = memoryview(bytearray(8 + ECHO_FRAME_BYTES))
                    for _ in range(rounds):
                        c.sendmsg([_LEN.pack(ECHO_FRAME_BYTES), payload])
                        got = 0
                        while got < len(back):
                            got += c.recv_into(back[got:])
            wall = parallel(client, range(CONNECTIONS))
            out[f"{mode}_echo_bytes_per_s"] = CONNECTIONS * rounds * ECHO_FRAME_BYTES / wall
        finally:
            proc.kill()
            proc.wait()
    out["threads_vs_uvloop"] = out["threads_echo_bytes_per_s"] / out["uvloop_echo_bytes_per_s"]
    return out


def ratios(r: dict) -> dict:
    k, fio, ip, rd = r["kvtierd"], r["fio"], r["iperf3"]["iperf3_bytes_per_s"], r["redis"]
    k = dict(k, get_bytes_per_s=max(k["get_bytes_per_s"], k["get_views_bytes_per_s"]))  # the better GET mode
    get_ref = min(fio["fio_read_bytes_per_s"], ip)
    put_ref = min(fio["fio_write_bytes_per_s"], ip)
    out = {
        "get_vs_min_fio_iperf3": k["get_bytes_per_s"] / get_ref,
        "put_vs_min_fio_iperf3": k["put_bytes_per_s"] / put_ref,
        "get_vs_redis": k["get_bytes_per_s"] / rd["redis_get_bytes_per_s"],
        "put_vs_redis": k["put_bytes_per_s"] / rd["redis_set_bytes_per_s"],
        "put_vs_fio_write_ceiling": k["put_bytes_per_s"] / fio["fio_write_ceiling_bytes_per_s"],
        "redis_set_vs_fio_write_ceiling": rd["redis_set_bytes_per_s"] / fio["fio_write_ceiling_bytes_per_s"],
        "lookup_keys_per_s": max(k["lookup_keys_per_s_1conn"], k["lookup_keys_per_s_4conn"]),
        "put_vs_engine_alone": k["put_bytes_per_s"] / r["engine_alone"]["engine_put_bytes_per_s"],
        "get_vs_engine_alone": k["get_bytes_per_s"] / r["engine_alone"]["engine_get_bytes_per_s"],
        "lookup_vs_engine_alone": max(k["lookup_keys_per_s_1conn"], k["lookup_keys_per_s_4conn"])
        / r["engine_alone"]["engine_lookup_keys_per_s"],
        # CPU seconds (daemon + client) per GiB or key over the engine alone's: robust to a loaded machine
        "get_views_cpu_vs_engine_alone": sum(k["cpu_s_per_gib"]["get_views"].values())
        / r["engine_alone"]["engine_get_cpu_s_per_gib"],
        "lookup_cpu_vs_engine_alone": sum(k["lookup_cpu_us_per_key"].values())
        / r["engine_alone"]["engine_lookup_cpu_us_per_key"],
    }
    out["gates"] = {
        "get>=0.8x_min(fio,iperf3)": out["get_vs_min_fio_iperf3"] >= 0.8,
        "put>=0.8x_min(fio,iperf3)": out["put_vs_min_fio_iperf3"] >= 0.8,
        "get>=1.5x_redis": out["get_vs_redis"] >= 1.5,
        "put>=1.5x_redis": out["put_vs_redis"] >= 1.5,
        "lookup>=1M_keys/s": out["lookup_keys_per_s"] >= 1e6,
    }
    return out


def print_table(r: dict) -> None:
    g = lambda v: f"{v / GiB:7.2f} GiB/s"  # noqa: E731
    k, fio, rd = r["kvtierd"], r["fio"], r["redis"]
    rows = [
        ("kvtierd PUT (4 conns, 2 MiB)", g(k["put_bytes_per_s"])),
        ("kvtierd PUT + flush", g(k["put_then_flush_bytes_per_s"])),
        ("kvtierd GET after restart", g(k["get_bytes_per_s"])),
        ("kvtierd GET, copy=False (views)", g(k["get_views_bytes_per_s"])),
        ("engine alone PUT (in-process, 4 threads)", g(r["engine_alone"]["engine_put_bytes_per_s"])),
        ("engine alone GET (in-process, 4 threads)", g(r["engine_alone"]["engine_get_bytes_per_s"])),
        ("engine alone LOOKUP 1024 keys", f"{r['engine_alone']['engine_lookup_keys_per_s'] / 1e6:7.2f} M keys/s"),
        ("fio write (same files, direct)", g(fio["fio_write_bytes_per_s"])),
        ("fio read (same files, direct)", g(fio["fio_read_bytes_per_s"])),
        ("fio write ceiling (16 MiB, iodepth 16)", g(fio["fio_write_ceiling_bytes_per_s"])),
        ("iperf3 loopback (4 streams)", g(r["iperf3"]["iperf3_bytes_per_s"])),
        ("redis SET (redis-py, 4 conns)", g(rd["redis_set_bytes_per_s"])),
        ("redis GET (redis-py, 4 conns)", g(rd["redis_get_bytes_per_s"])),
        ("LOOKUP 1024-key chain, 1 conn", f"{k['lookup_keys_per_s_1conn'] / 1e6:7.2f} M keys/s"),
        ("LOOKUP 1024-key chain, 4 conns", f"{k['lookup_keys_per_s_4conn'] / 1e6:7.2f} M keys/s"),
    ]
    for mode in ("put", "get", "get_views"):
        cpu = k["cpu_s_per_gib"][mode]
        rows.append((f"CPU s per GiB, {mode}: daemon / client", f"{cpu['daemon']:7.2f} / {cpu['client']:.2f}"))
    rows.append(("CPU s per GiB, engine alone GET", f"{r['engine_alone']['engine_get_cpu_s_per_gib']:7.2f}"))
    for mode in ("set", "get"):
        cpu = rd["cpu_s_per_gib"][mode]
        rows.append((f"CPU s per GiB, redis {mode.upper()}: server / client",
                     f"{cpu['server']:7.2f} / {cpu['client']:.2f}"))
    cpu = k["lookup_cpu_us_per_key"]
    rows.append(("CPU us per key, LOOKUP: daemon / client", f"{cpu['daemon']:7.2f} / {cpu['client']:.2f}"))
    cpu = k["lookup_locations_cpu_us_per_key"]
    rows.append(("LOOKUP with locations, 1 conn", f"{k['lookup_locations_keys_per_s_1conn'] / 1e6:7.2f} M keys/s"))
    rows.append(("CPU us per key, LOOKUP+locations: daemon / client", f"{cpu['daemon']:7.2f} / {cpu['client']:.2f}"))
    rows.append(("CPU us per key, engine alone LOOKUP",
                 f"{r['engine_alone']['engine_lookup_cpu_us_per_key']:7.2f}"))
    if "transport_compare" in r:
        for name, v in r["transport_compare"].items():
            if name.endswith("bytes_per_s"):
                rows.append((f"echo 2 MiB: {name.removesuffix('_bytes_per_s')}", g(v)))
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    print()
    for name, v in r["ratios"].items():
        if name != "gates":
            print(f"{name:<{width}}  {v:9.3f}" if v < 1e4 else f"{name:<{width}}  {v:9.3g}")
    for name, ok in r["ratios"]["gates"].items():
        print(f"gate {name:<{width - 5}}  {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    sys.exit(main())
