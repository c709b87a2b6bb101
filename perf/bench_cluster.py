"""A kvtier cluster on etcd: GET overhead of 3 and 6 nodes, kill -9 under load, a 4th node joining.

    .venv/bin/python perf/bench_cluster.py [--quick] [--out perf/out/cluster.json]

One etcd (Debian's etcd-server, as the tests use) and real kvtierd processes on loopback,
their device files side by side in one temporary directory (the same disk for every node
count), each registered with ``--cluster``:

1. **GET overhead.** 1, 3 and 6 nodes in turn; ``KVCache.load_blocks`` of every stored block
   (replicas 1 for one node, 2 on a cluster; a GET reads one copy either way) on 2 threads,
   5 rounds: wall GiB/s of the best round, CPU seconds per GiB over all of them (the
   client's and every daemon's).
   On 2 shared cores this measures the cluster's overhead (more processes, more
   connections, the placement), not scaling: the ratio to 1 node is the figure.
2. **kill -9 under load.** 3 nodes, replicas 2, lease TTL 2 s: 2 threads load a stored chain
   and check every byte, 1 thread stores buffered; one node is killed -9. Counted: requests
   that raised to the caller, wrong bytes, the time from the kill until the last data
   request went to the dead node (the client's backoff) and until it left the view (its
   lease). Then the node restarts on its data (a rejoin) and one ``kvtier cluster repair``
   pass fills what it missed.
3. **join.** 3 nodes, replicas 2, a stored keyspace; a 4th node joins. The fraction of keys
   whose first owner changed, of copies whose place moved (both ~1/4), the bytes a repair
   pass moved (only to the new node), and the share of a new chain's PUT bytes the new node
   received (about its 1/4 of the copies, never all of them).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "perf"))

from bench_tcp import parallel, process_cpu_s  # noqa: E402
from daemon_proc import start_kvtierd  # noqa: E402
from etcd_server import EtcdServer  # noqa: E402

import torch  # noqa: E402

from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402
from kvtier.tools.cluster_repair import ClusterRepairer  # noqa: E402
from kvtier.tools.cluster_repair_plan import placement_change  # noqa: E402

GET_LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=16)  # 512 KiB
SMALL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", block_tokens=16)  # 32 KiB
LEASE_TTL_S = 2
GET_THREADS = 2
GET_ROUNDS = 5
BATCH_BLOCKS = 32
WAIT_S_MAX = 20.0


class Cluster:
    """n kvtierd members of ``prefix`` in ``etcd``, their data dirs under ``base``."""

    def __init__(self, etcd: EtcdServer, base: Path, prefix: str, names: list[str]) -> None:
        self.etcd, self.base, self.prefix = etcd, base, prefix
        self.daemons = {}
        for name in names:
            self.add(name)

    def add(self, name: str):
        d = start_kvtierd(self.base / self.prefix / name, "--cluster", self.etcd.url(self.prefix), "--node-id", name,
                          "--lease-ttl", str(LEASE_TTL_S), admin="127.0.0.1:0")
        self.daemons[name] = d
        return d

    @property
    def url(self) -> str:
        return self.etcd.url(self.prefix)

    def cpu_s(self) -> float:
        return sum(process_cpu_s(d.pid) for d in self.daemons.values() if d.alive())

    def stop(self) -> None:
        for d in self.daemons.values():
            if d.alive():
                d.stop()


def wait_view(cache_or_members, node_ids) -> float:
    members = cache_or_members._warm.pool.members if isinstance(cache_or_members, KVCache) else cache_or_members
    started = time.monotonic()
    view = members.current()
    while tuple(view.node_ids) != tuple(sorted(node_ids)):
        left = WAIT_S_MAX - (time.monotonic() - started)
        if left <= 0:
            raise RuntimeError(f"members never became {sorted(node_ids)}: {view.node_ids}")
        view = members.wait_changed(view.version, left)
    return time.monotonic() - started


def node_stats(daemon) -> dict:
    with BlockClient(daemon.data_addr) as client:
        return client.stats()


def blocks_of(layout: KVLayout, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(layout.block_shape, generator=g).half() for _ in range(n)]


# --- 1. GET overhead -------------------------------------------------------------------
def get_overhead(etcd: EtcdServer, base: Path, blocks_total: int) -> dict:
    ns = Namespace(model="bench-get", layout=GET_LAYOUT, codec="raw")
    keys = ns.keys(list(range(blocks_total * GET_LAYOUT.block_tokens)))
    blocks = blocks_of(GET_LAYOUT, blocks_total, 1)
    nbytes = blocks_total * GET_LAYOUT.block_raw_bytes
    out = {}
    for n in (1, 3, 6):
        names = [f"n{i}" for i in range(n)]
        cluster = Cluster(etcd, base, f"get{n}", names)
        try:
            with KVCache(ns, cluster.url, hot_pool_bytes=0, replicas=min(2, n), timeout_s=30.0) as cache:
                wait_view(cache, names)
                for i in range(0, blocks_total, BATCH_BLOCKS):
                    cache.store_blocks(keys[i:i + BATCH_BLOCKS], blocks[i:i + BATCH_BLOCKS])
                cache.flush()
                parts = [list(range(t * BATCH_BLOCKS, blocks_total, GET_THREADS * BATCH_BLOCKS))
                         for t in range(GET_THREADS)]
                wrong = [0]

                def load(starts):
                    for s in starts:
                        got = cache.load_blocks(keys[s:s + BATCH_BLOCKS])
                        wrong[0] += sum(g is None or not torch.equal(g, b)
                                        for g, b in zip(got, blocks[s:s + BATCH_BLOCKS]))
                c0, d0 = time.process_time(), cluster.cpu_s()
                wall = min(parallel(load, parts) for _ in range(GET_ROUNDS))
                # CPU over every round: a round is a few clock ticks of a daemon
                client_s, daemons_s = time.process_time() - c0, cluster.cpu_s() - d0
                gib = nbytes / 2**30
                out[str(n)] = {"gib_per_s": gib / wall, "client_cpu_s_per_gib": client_s / gib / GET_ROUNDS,
                               "daemons_cpu_s_per_gib": daemons_s / gib / GET_ROUNDS,
                               "cpu_s_per_gib": (client_s + daemons_s) / gib / GET_ROUNDS, "wrong_blocks": wrong[0],
                               "failovers": cache.statistics().warm.failovers}
        finally:
            cluster.stop()
    for n in ("3", "6"):
        out[n]["ratio_gib_per_s_vs_1"] = out[n]["gib_per_s"] / out["1"]["gib_per_s"]
        out[n]["ratio_cpu_per_gib_vs_1"] = out[n]["cpu_s_per_gib"] / out["1"]["cpu_s_per_gib"]
    out["bytes_per_round"] = nbytes
    return out


# --- 2. kill -9 under load --------------------------------------------------------------
def kill_under_load(etcd: EtcdServer, base: Path, blocks_total: int) -> dict:
    names = ["node-a", "node-b", "node-c"]
    cluster = Cluster(etcd, base, "kill", names)
    ns = Namespace(model="bench-kill", layout=SMALL_LAYOUT, codec="raw")
    keys = ns.keys(list(range(blocks_total * SMALL_LAYOUT.block_tokens)))
    blocks = blocks_of(SMALL_LAYOUT, blocks_total, 2)
    extra_keys = ns.keys(list(range(10**6, 10**6 + 4096 * SMALL_LAYOUT.block_tokens)))
    try:
        with KVCache(ns, cluster.url, hot_pool_bytes=0, timeout_s=10.0) as cache:
            wait_view(cache, names)
            cache.store_blocks(keys, blocks)
            with cache._warm.pool.batch() as batch:
                victim = batch.view.node_ids[int(batch.placement(keys, 2)[0, 0])]
            stop = threading.Event()
            counts = {"loads": 0, "stores": 0, "failed": 0, "wrong_blocks": 0, "missing_blocks": 0}
            lock = threading.Lock()
            errors: list[str] = []

            def loader():
                while not stop.is_set():
                    try:
                        got = cache.load_blocks(keys)
                    except Exception as exc:  # noqa: BLE001 - an engine-visible failure is the figure
                        with lock:
                            counts["failed"] += 1
                            errors.append(repr(exc))
                        continue
                    bad = sum(g is not None and not torch.equal(g, b) for g, b in zip(got, blocks))
                    with lock:
                        counts["loads"] += 1
                        counts["wrong_blocks"] += bad
                        counts["missing_blocks"] += sum(g is None for g in got)

            def storer():
                i = 0
                while not stop.is_set():
                    part = extra_keys[i:i + 8]
                    i = (i + 8) % len(extra_keys)
                    try:
                        cache.store_blocks(part, blocks[:len(part)])
                    except Exception as exc:  # noqa: BLE001
                        with lock:
                            counts["failed"] += 1
                            errors.append(repr(exc))
                        continue
                    with lock:
                        counts["stores"] += 1
            threads = [threading.Thread(target=loader), threading.Thread(target=loader),
                       threading.Thread(target=storer)]
            for t in threads:
                t.start()
            stop.wait(1.0)  # the load runs a second before the kill
            before = dict(counts)
            cluster.daemons[victim].kill()
            killed_at = time.monotonic()
            left_s = wait_view(cache, [n for n in names if n != victim])
            stop.wait(1.0)  # and a second after the node left the view
            stop.set()
            for t in threads:
                t.join()
            st = cache._warm.pool.backoff.statistics()
            last_sent_s = st.last_sent_s.get(victim, killed_at) - killed_at
            doc = {"victim": victim, "lease_ttl_s": LEASE_TTL_S, **counts, "loads_before_kill": before["loads"],
                   "errors": errors[:5], "stopped_sending_s": last_sent_s, "left_view_s": left_s,
                   "goal_s": LEASE_TTL_S + 1.0, "failovers": cache.statistics().warm.failovers,
                   "read_repairs": cache.statistics().warm.repairs, "backoff_failures": st.failures,
                   "probes": st.probes}
            # the node comes back on its data (same node id): a rejoin; one repair pass fills what it missed
            restarted_at = time.monotonic()
            cluster.daemons[victim].start()
            wait_view(cache, names)
            doc["rejoin_s"] = time.monotonic() - restarted_at  # the restart (recovery included) until in the view
            repairer = ClusterRepairer(cluster.url)
            try:
                figures = repairer.run_pass()
            finally:
                repairer.close()
            doc["rejoin_repair"] = {"blocks_copied": figures.blocks_copied, "bytes_moved": figures.bytes_moved,
                                    "bytes_moved_to": figures.bytes_moved_to, "seconds": figures.last_pass_s}
            return doc
    finally:
        cluster.stop()


# --- 3. join of a 4th node --------------------------------------------------------------
def join_fourth(etcd: EtcdServer, base: Path, blocks_total: int) -> dict:
    names = ["node-a", "node-b", "node-c"]
    cluster = Cluster(etcd, base, "join", names)
    ns = Namespace(model="bench-join", layout=SMALL_LAYOUT, codec="raw")
    keys = ns.keys(list(range(blocks_total * SMALL_LAYOUT.block_tokens)))
    blocks = blocks_of(SMALL_LAYOUT, blocks_total, 3)
    try:
        with KVCache(ns, cluster.url, hot_pool_bytes=0, timeout_s=10.0) as cache:
            wait_view(cache, names)
            for i in range(0, blocks_total, 256):
                cache.store_blocks(keys[i:i + 256], blocks[i:i + 256])
            stored_bytes = sum(node_stats(d)["engine"]["bytes_stored"] for d in cluster.daemons.values())
            cluster.add("node-d")
            wait_view(cache, names + ["node-d"])
            change = placement_change(keys, names, names + ["node-d"], 2)
            repairer = ClusterRepairer(cluster.url)
            try:
                started = time.monotonic()
                figures = repairer.run_pass()
                repair_s = time.monotonic() - started
            finally:
                repairer.close()
            # new writes after the join: the new node takes its share, not all of them
            before = {n: node_stats(d)["server"]["bytes_in"] for n, d in cluster.daemons.items()}
            new_keys = ns.keys(list(range(10**7, 10**7 + blocks_total * SMALL_LAYOUT.block_tokens)))
            for i in range(0, blocks_total, 256):
                cache.store_blocks(new_keys[i:i + 256], blocks[i:i + 256])
            after = {n: node_stats(d)["server"]["bytes_in"] for n, d in cluster.daemons.items()}
            put_in = {n: after[n] - before[n] for n in after}
            loaded = cache.load_blocks(keys)
            wrong = sum(g is None or not torch.equal(g, b) for g, b in zip(loaded, blocks))
        return {"keys": blocks_total, "replicas": 2, "first_owner_changed": change.first_owner_changed,
                "copies_moved": change.copies_moved, "owner_set_changed": change.owner_set_changed,
                "goal": "within 1.2x of 1/4", "within_goal": abs(change.first_owner_changed - 0.25) <= 0.25 * 0.2
                and abs(change.copies_moved - 0.25) <= 0.25 * 0.2,
                "stored_bytes_before": stored_bytes, "repair_bytes_moved": figures.bytes_moved,
                "repair_bytes_moved_to": figures.bytes_moved_to, "repair_blocks": figures.blocks_copied,
                "repair_fraction_of_stored": figures.bytes_moved / stored_bytes, "repair_s": repair_s,
                "new_chain_put_bytes_share": {n: v / sum(put_in.values()) for n, v in put_in.items()},
                "wrong_or_missing_after_join": wrong}
    finally:
        cluster.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller data sets (seconds, not a minute)")
    ap.add_argument("--out", default=str(ROOT / "perf" / "out" / "cluster.json"))
    ap.add_argument("--only", choices=("get", "kill", "join"), action="append")
    args = ap.parse_args()
    parts = args.only or ["get", "kill", "join"]
    base = Path(tempfile.mkdtemp(prefix="kvtier-cluster-", dir="/var/tmp"))
    etcd = EtcdServer(base / "etcd")
    doc = {"quick": args.quick, "cores": len(os.sched_getaffinity(0))}
    try:
        if "get" in parts:
            doc["get"] = get_overhead(etcd, base, 64 if args.quick else 192)
        if "kill" in parts:
            doc["kill"] = kill_under_load(etcd, base, 64 if args.quick else 128)
        if "join" in parts:
            doc["join"] = join_fourth(etcd, base, 1024 if args.quick else 4096)
    finally:
        etcd.stop()
        shutil.rmtree(base, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(json.dumps(doc, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
