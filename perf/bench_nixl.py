"""The nixl transport against kvtier's TCP GET, raw NIXL transfers, iperf3 and fio, in one run.

    .venv/bin/python perf/bench_nixl.py            # 2 MiB and 32 MiB blocks, 64 MiB each
    .venv/bin/python perf/bench_nixl.py --quick    # fewer rounds

Steps (every reference in the same run, so ratios mean something on a shared machine):

1. GET (end to end: the daemon reads the blocks into an arena, the client verifies
   every CRC): kvtierd's device files on tmpfs (the blocks in the daemon's DRAM),
   2 MiB and 32 MiB blocks. kvtier TCP GET (one connection, ``copy=False``) and the
   nixl transport alternate round by round, over shared memory (UCX ``self,sm,tcp``)
   and over TCP (``self,tcp``), each in a process of its own (UCX reads its settings
   once per process).
2. Raw NIXL transfers between two processes, DRAM to DRAM, 32 MiB: the daemon's
   choice, WRITE with a notification (the daemon initiates) vs READ (the client
   initiates), over shared memory and over TCP.
3. iperf3 on loopback, one stream: the TCP ceiling.
4. NIXL's POSIX file backend vs fio vs a ``preadv`` loop, O_DIRECT, 16 MiB reads of the
   same file.

Prints a markdown table and writes ``perf/out/nixl.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
LOOPBACK = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib*", "NIXL_LOG_LEVEL": "WARN"}
TLS = {"sm": "self,sm,tcp", "tcp": "self,tcp"}
REGION_MIB = 64
FLASH_STREAMS = 4  # GETs at once from flash: KVCache's default streams
NS = b"\x0b" * 16


def _rate(nbytes: int, seconds: list[float]) -> dict:
    return {"best_gbs": nbytes / min(seconds) / 1e9, "median_gbs": nbytes / statistics.median(seconds) / 1e9}


# -- 1. end-to-end GET -------------------------------------------------------------
def child_get(tls: str, block_mib: int, total_mib: int, rounds: int, where: str = "dram") -> dict:
    """``where``: ``dram``, device files on tmpfs (the daemon reads them into an arena, from the page cache); ``flash``,
    device files on the disk under perf/out, the blocks sealed out of the DRAM image (O_DIRECT reads),
    fetched as KVCache does, in FLASH_STREAMS GETs at once (fio gets as many jobs, one per device)."""
    from daemon_proc import start_kvtierd
    from kvtier.client import BlockClient
    from kvtier.client.nixl_transport import NixlTransport
    from kvtier.common.blockformat import encode_block

    os.environ.update(LOOPBACK, KVTIER_NIXL_TLS=TLS[tls])
    count = max(1, total_mib // block_mib)
    parent = "/dev/shm" if where == "dram" else str(ROOT / "perf" / "out")
    Path(parent).mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="kvtier-nixl-", dir=parent))
    filler_mib = 0 if where == "dram" else 2 * REGION_MIB  # seals the blocks' region: none left in DRAM
    device_mib = max(64, 2 * (total_mib + filler_mib) // 4 + 2 * block_mib)
    d = start_kvtierd(data_dir, "--nixl", "on", "--nixl-tls", TLS[tls], "--region-size", f"{REGION_MIB}m",
                      "--device-size", f"{device_mib}m", env={**os.environ})
    try:
        keys = [struct.pack("<QQ", 7, i) for i in range(count)]
        blocks = [encode_block(k, NS, 0, os.urandom((block_mib << 20) - 64)) for k in keys]
        nbytes = sum(len(b) for b in blocks)
        streams = 1 if where == "dram" else FLASH_STREAMS
        with BlockClient(d.data_addr, pool_size=streams) as client:
            client.put_many(list(zip(keys, blocks)), ns_id=NS)
            for i in range(filler_mib // 2):
                client.put_many([(struct.pack("<QQ", 8, i), encode_block(struct.pack("<QQ", 8, i), NS, 0,
                                                                          bytes((2 << 20) - 64)))], ns_id=NS)
            client.flush()
            del blocks
            _, locations = client.lookup_locations(keys, ns_id=NS)
            geometry = client.geometry()
            devices = sorted(str(p) for p in data_dir.glob("device*.img"))
            by_id = device_paths(devices)
            fio_ranges = {by_id[geometry.device_ids[dev]]: r for dev, r in block_ranges(geometry, locations).items()}
            fio_rates: list[float] = []
            transport = NixlTransport(d.data_addr, pool_size=streams)
            lengths, seqs = [loc.length for loc in locations], [loc.seq for loc in locations]
            tcp_s, nixl_s = [], []
            for _ in range(rounds):
                started = time.perf_counter()
                got = in_streams(lambda part: client.get_many(part, ns_id=NS, copy=False), keys, streams)
                tcp_s.append(time.perf_counter() - started)
                assert all(g is not None for g in got)
                del got
                started = time.perf_counter()
                got = in_streams(lambda part: transport.get_many(part, [lengths[keys.index(k)] for k in part],
                                                                 [seqs[keys.index(k)] for k in part], NS), keys, streams)
                nixl_s.append(time.perf_counter() - started)
                assert all(g is not None for g in got)
                del got
                if where == "flash":  # the reference in the same round: the host's caches as warm as ours
                    fio_rates.append(fio_devices(fio_ranges))
            stats = transport.statistics()
            transport.close()
        out = {"tls": TLS[tls], "where": where, "transport": stats.transport, "block_mib": block_mib,
               "blocks": count, "tcp": _rate(nbytes, tcp_s),
               "nixl": _rate(nbytes, nixl_s)}
        if where == "dram":
            out["single_copy"] = single_copy(devices[0], nbytes, rounds)
        else:
            out["fio_devices"] = {"best_gbs": max(fio_rates), "median_gbs": statistics.median(fio_rates),
                                  "devices": len(fio_ranges), "command": FIO_DEVICES_COMMAND}
        return out
    finally:
        d.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def in_streams(get, keys: list, streams: int) -> list:
    """``get`` of ``keys`` in ``streams`` contiguous parts at once; the blocks in key order."""
    if streams == 1 or len(keys) < 2:
        return get(keys)
    from concurrent.futures import ThreadPoolExecutor

    bounds = [len(keys) * s // streams for s in range(streams + 1)]
    parts = [keys[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    with ThreadPoolExecutor(len(parts)) as pool:
        return [block for got in pool.map(get, parts) for block in got]


def single_copy(path: str, nbytes: int, rounds: int) -> dict:
    """The ceiling of a WRITE over shared memory here: ``process_vm_writev`` (what UCX's CMA transport
    does) of ``nbytes`` from a read-only mapping of a tmpfs device file into an anonymous buffer."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    size = min(nbytes, os.path.getsize(path))
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    source = np.frombuffer(mapping, np.uint8)
    target = np.ones(size, np.uint8)
    local, remote = IoVec(source.ctypes.data, size), IoVec(target.ctypes.data, size)
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        if libc.process_vm_writev(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != size:
            raise OSError(ctypes.get_errno(), "process_vm_writev")
        seconds.append(time.perf_counter() - started)
    del source
    mapping.close()
    os.close(fd)
    return _rate(size, seconds)


def block_ranges(geometry, locations) -> dict[int, list[tuple[int, int]]]:
    """Per device index, the (offset, length) runs its share of the blocks lies in, merged where they
    touch (page-aligned): no byte of a region the blocks do not fill (unwritten space reads back
    as zeros without touching the disk)."""
    pieces: dict[int, list[tuple[int, int]]] = {}
    for loc in locations:
        for dev, offset, length in geometry.map_range(loc.logical_offset, loc.length):
            pieces.setdefault(dev, []).append((offset // 4096 * 4096, -(-(offset + length) // 4096) * 4096))
    runs: dict[int, list[tuple[int, int]]] = {}
    for dev, spans in pieces.items():
        merged: list[list[int]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        runs[dev] = [(lo, hi - lo) for lo, hi in merged]
    return runs


def device_paths(paths: list[str]) -> dict[str, str]:
    from kvtier.daemon.engine.superblock import decode_superblock

    out = {}
    for path in paths:
        with open(path, "rb") as f:
            out[decode_superblock(f.read(4096)).device_uuid.hex()] = path
    return out


FIO_DEVICES_COMMAND = ("fio --rw=read --bs=2m --direct=1 --ioengine=psync, one job per device file and run of "
                       "the blocks' bytes there, the k-th runs of every device together (stonewall between), "
                       "once a round after the round's GETs")


def fio_devices(runs: dict[str, list[tuple[int, int]]]) -> float:
    """GB/s of fio reading exactly the blocks' byte runs of the device files, every device at once
    (the daemon's RAID0 reads them so), 2 MiB O_DIRECT reads."""
    args = []
    for k in range(max(len(r) for r in runs.values())):
        group = [(path, r[k]) for path, r in sorted(runs.items()) if k < len(r)]
        for i, (path, (offset, size)) in enumerate(group):
            args += [f"--name=run{k}dev{i}", f"--filename={path}", f"--offset={offset}", f"--size={size}"]
            if i == 0 and k:
                args.append("--stonewall")
    out = subprocess.run(["fio", "--rw=read", "--bs=2m", "--direct=1", "--ioengine=psync", "--group_reporting",
                          "--output-format=json", *args], capture_output=True, text=True, timeout=300)
    groups = json.loads(out.stdout)["jobs"]
    return sum(g["read"]["io_bytes"] for g in groups) / (sum(g["read"]["runtime"] for g in groups) / 1e3) / 1e9


# -- 2. raw transfers ----------------------------------------------------------------
def _agent(name: str, progress_thread: bool):
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                              sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))


def _send(sock, data: bytes) -> None:
    sock.sendall(struct.pack("<I", len(data)) + data)


def _recv(sock) -> bytes:
    def exactly(n):
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("peer closed")
            out += chunk
        return out
    return exactly(struct.unpack("<I", exactly(4))[0])


def child_raw_target(port_file: str, nbytes: int) -> None:
    """The waiting side: its progress thread runs; it answers each round once the data is in."""
    import numpy as np
    agent = _agent(f"target-{os.getpid()}", progress_thread=True)
    buf = np.full(nbytes, 7, np.uint8)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    listener = socket.create_server(("127.0.0.1", 0))
    Path(port_file + ".tmp").write_text(str(listener.getsockname()[1]))
    os.rename(port_file + ".tmp", port_file)
    sock, _ = listener.accept()
    peer = agent.add_remote_agent(_recv(sock))
    peer = peer.decode() if isinstance(peer, bytes) else peer
    _send(sock, agent.get_agent_metadata())
    _send(sock, struct.pack("<Q", buf.ctypes.data))
    while (command := _recv(sock)) != b"quit":
        if command.startswith(b"wait:"):  # WRITE: the data is in once the notification is
            tag = command[5:]
            while not agent.check_remote_xfer_done(peer, tag):
                pass
        _send(sock, b"ok")
    os._exit(0)


def raw_transfer(tls: str, mode: str, nbytes: int, rounds: int) -> dict:
    """The initiator (polls itself, no progress thread) in a child process, its own child the target."""
    env = {**os.environ, **LOOPBACK, "UCX_TLS": TLS[tls], "UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
    out = subprocess.run([sys.executable, __file__, "--child-raw", tls, mode, str(nbytes), str(rounds)],
                         capture_output=True, text=True, env=env, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not line:
        raise RuntimeError(f"raw transfer child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(line[-1])


def child_raw_initiator(tls: str, mode: str, nbytes: int, rounds: int) -> None:
    import numpy as np
    port_file = tempfile.mktemp(prefix="kvtier-nixl-port-")
    target = subprocess.Popen([sys.executable, __file__, "--child-raw-target", port_file, str(nbytes)])
    deadline = time.monotonic() + 30
    while not os.path.exists(port_file):
        if time.monotonic() > deadline or target.poll() is not None:
            raise RuntimeError("the raw-transfer target did not start")
        time.sleep(0.05)
    agent = _agent(f"initiator-{os.getpid()}", progress_thread=False)
    buf = np.zeros(nbytes, np.uint8)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    sock = socket.create_connection(("127.0.0.1", int(Path(port_file).read_text())))
    os.unlink(port_file)
    _send(sock, agent.get_agent_metadata())
    peer = agent.add_remote_agent(_recv(sock))
    peer = peer.decode() if isinstance(peer, bytes) else peer
    remote_address = struct.unpack("<Q", _recv(sock))[0]
    pieces = 16
    piece = nbytes // pieces
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(buf.ctypes.data + i * piece, piece, 0) for i in range(pieces)],
                                  "DRAM")
    remote = agent.prep_xfer_dlist(peer, [(remote_address + i * piece, piece, 0) for i in range(pieces)], "DRAM")
    seconds = []
    for r in range(rounds + 1):  # the first round sets up the connection: not counted
        tag = b"r%d" % r
        started = time.perf_counter()
        handle = agent.make_prepped_xfer(mode, local, list(range(pieces)), remote, list(range(pieces)),
                                         tag if mode == "WRITE" else b"")
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        assert state == "DONE", state
        handle.release()
        _send(sock, b"wait:" + tag if mode == "WRITE" else b"done")
        _recv(sock)
        if r:
            seconds.append(time.perf_counter() - started)
    if mode == "READ":
        assert int(buf[0]) == 7 and int(buf[-1]) == 7
    _send(sock, b"quit")
    target.wait(30)
    print(json.dumps({"tls": TLS[tls], "mode": mode, "bytes": nbytes, **_rate(nbytes, seconds)}), flush=True)
    os._exit(0)


# -- 3. iperf3 ----------------------------------------------------------------------
def iperf3(seconds: int) -> dict:
    if shutil.which("iperf3") is None:
        return {"skipped": "iperf3 is not installed (apt-get install -y iperf3)"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port), "-B", "127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-J"],
                             capture_output=True, text=True, timeout=seconds + 30)
        doc = json.loads(out.stdout)
        return {"gbs": doc["end"]["sum_received"]["bits_per_second"] / 8 / 1e9}
    finally:
        server.wait(10)


# -- 4. file reads -------------------------------------------------------------------
def file_reads(path: str, file_mib: int, rounds: int) -> dict:
    from kvtier.client.nixl_file_reads import NixlFileReads
    from kvtier.common.aligned import aligned_buffer

    piece = 16 << 20
    nbytes = file_mib << 20
    with open(path, "wb") as fh:
        for _ in range(file_mib // 16):
            fh.write(os.urandom(piece))
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffer = aligned_buffer(nbytes)
    views = [buffer[i * piece:(i + 1) * piece] for i in range(nbytes // piece)]
    reads = NixlFileReads([fd])
    nixl_s, preadv_s, fio = [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        reads.read([(0, i * piece, v) for i, v in enumerate(views)])
        nixl_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        for i, v in enumerate(views):
            os.preadv(fd, [v], i * piece)
        preadv_s.append(time.perf_counter() - started)
        out = subprocess.run(["fio", "--name=read", f"--filename={path}", "--rw=read", "--bs=16m", "--direct=1",
                              "--ioengine=psync", f"--size={file_mib}m", "--output-format=json"],
                             capture_output=True, text=True, timeout=300)
        fio.append(json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"] / 1e9)
    reads.close()
    os.close(fd)
    return {"file_mib": file_mib, "nixl_posix": _rate(nbytes, nixl_s), "preadv": _rate(nbytes, preadv_s),
            "fio_best_gbs": max(fio), "fio_median_gbs": statistics.median(fio)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-get":
        print(json.dumps(child_get(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])),
              flush=True)
        os._exit(0)  # a UCX backend exists: skip its teardown at exit (docs/nixl.md)
    if len(sys.argv) > 1 and sys.argv[1] == "--child-raw":
        child_raw_initiator(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    if len(sys.argv) > 1 and sys.argv[1] == "--child-raw-target":
        child_raw_target(sys.argv[2], int(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--total-mib", type=int, default=64, help="bytes of blocks per GET run")
    ap.add_argument("--file-dir", default=str(ROOT / "perf" / "out"), help="where the fio / POSIX file goes")
    args = ap.parse_args()
    rounds = 3 if args.quick else 6
    results: dict = {"machine": f"{os.cpu_count()} cores, shared", "get": [], "raw": []}
    for tls, block_mib, where in [("sm", 2, "dram"), ("sm", 32, "dram"), ("tcp", 2, "dram"), ("tcp", 32, "dram"),
                                  ("sm", 2, "flash"), ("sm", 32, "flash")]:
        print(f"GET: {tls}, {block_mib} MiB blocks, {where}", file=sys.stderr, flush=True)
        total_mib = args.total_mib * (FLASH_STREAMS if where == "flash" else 1)  # each stream as much as one DRAM GET
        out = subprocess.run([sys.executable, __file__, "--child-get", tls, str(block_mib), str(total_mib),
                              str(rounds), where], capture_output=True, text=True, timeout=600)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not line:
            raise RuntimeError(f"GET child failed ({out.returncode}): {out.stderr[-3000:]}")
        results["get"].append(json.loads(line[-1]))
    for tls in ("sm", "tcp"):
        for mode in ("WRITE", "READ"):
            results["raw"].append(raw_transfer(tls, mode, 32 << 20, rounds))
    results["iperf3"] = iperf3(2 if args.quick else 4)
    Path(args.file_dir).mkdir(parents=True, exist_ok=True)
    path = os.path.join(args.file_dir, "nixl-file-read.bin")
    try:
        results["files"] = file_reads(path, 256, rounds)
    finally:
        os.unlink(path)
    out_dir = ROOT / "perf" / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "nixl.json").write_text(json.dumps(results, indent=2))
    print_table(results)
    os._exit(0)


def print_table(r: dict) -> None:
    print("| GET | UCX_TLS | blocks in | block | kvtier TCP GET best (median) GB/s | "
          "nixl best (median) GB/s | nixl / TCP (best) | ceiling: single copy or fio, best GB/s | nixl / ceiling |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for g in r["get"]:
        ceiling = g.get("single_copy") or g.get("fio_devices")
        print(f"| {g['transport']} | {g['tls']} | {g['where']} | {g['block_mib']} MiB x{g['blocks']} | "
              f"{g['tcp']['best_gbs']:.2f} ({g['tcp']['median_gbs']:.2f}) | "
              f"{g['nixl']['best_gbs']:.2f} ({g['nixl']['median_gbs']:.2f}) | "
              f"{g['nixl']['best_gbs'] / g['tcp']['best_gbs']:.2f}x | {ceiling['best_gbs']:.2f} | "
              f"{g['nixl']['best_gbs'] / ceiling['best_gbs']:.2f}x |")
    print()
    print("| raw NIXL, 32 MiB | UCX_TLS | best (median) GB/s |")
    print("| --- | --- | --- |")
    for x in r["raw"]:
        print(f"| {x['mode']} | {x['tls']} | {x['best_gbs']:.2f} ({x['median_gbs']:.2f}) |")
    print(f"\niperf3 loopback, 1 stream: {r['iperf3']}")
    f = r["files"]
    print(f"\nfile reads, {f['file_mib']} MiB, 16 MiB O_DIRECT: NIXL POSIX {f['nixl_posix']['best_gbs']:.2f} "
          f"({f['nixl_posix']['median_gbs']:.2f}) GB/s, preadv {f['preadv']['best_gbs']:.2f} "
          f"({f['preadv']['median_gbs']:.2f}), fio {f['fio_best_gbs']:.2f} ({f['fio_median_gbs']:.2f}); "
          f"NIXL / fio = {f['nixl_posix']['best_gbs'] / f['fio_best_gbs']:.2f}")


if __name__ == "__main__":
    main()
