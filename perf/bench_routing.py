"""Routing-table accuracy under churn (issue 16): 4 kvtierd nodes publishing KV events, a
``kvtier-router`` process following them, and a trace of requests over Zipf-popular prefixes.

Each request: the client's ``EdgePicker`` asks the router for the node holding the longest
stored prefix; every node is asked with one LOOKUP how much of the chain it holds (the truth,
right after the answer); the chosen node then stores the blocks it lacked (the engine's
prefill saved). A prefix no node holds is placed on a random node, as a KV-unaware load
balancer would. The stores are small, so reclaims evict all the time, and one node is
restarted halfway while requests go on. ``--clients N`` keeps N requests in flight (the
truth of one is then read while others store and evict). A request is *routed right* when its node holds the longest prefix any
node holds. Same-run references, judged on the same truth: a random node, and the
rendezvous owner of the chain's first key.

    .venv/bin/python perf/bench_routing.py                 # 3000 requests
    .venv/bin/python perf/bench_routing.py --requests 500  # quick

Writes ``perf/results/2026-12-01/routing.json`` and prints a markdown summary.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import start_kvtierd  # noqa: E402
from kv_events_fixtures import free_port  # noqa: E402
from kvtier.client import BlockClient, ClientError, EdgePicker  # noqa: E402
from kvtier.client.routing import Rendezvous  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402

RESULTS = ROOT / "perf" / "results" / "2026-12-01"
NODE_ARGS = ("--device-size", "4m", "--region-size", "1m", "--stripe-size", "128k")  # 16 MiB a node
NS = Namespace("bench-routing", KVLayout(4, 2, 64, block_tokens=16))
PAYLOAD_BYTES = 16 << 10
READY_RE = re.compile(r"^kvtier-router ready http=(\S+)")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def start_nodes(base: Path, count: int):
    nodes = []
    for i in range(count):
        events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        d = start_kvtierd(base / f"node{i}", *NODE_ARGS, "--kv-events-endpoint", events,
                          "--kv-events-replay-endpoint", replay, admin=f"127.0.0.1:{free_port()}")
        d.node_id, d.events_endpoint, d.replay_endpoint = f"node{i}", events, replay
        nodes.append(d)
    return nodes


def start_router(nodes, probe_fraction: float):
    args = [sys.executable, "-m", "kvtier.tools.router.cli", "--listen", "127.0.0.1:0",
            "--probe-fraction", str(probe_fraction), "--log-level", "warning"]
    for d in nodes:
        args += ["--node", f"{d.node_id},events={d.events_endpoint},replay={d.replay_endpoint},"
                           f"admin=http://{d.admin_addr},data={d.data_addr}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = READY_RE.match(line)
    if match is None:
        proc.kill()
        raise RuntimeError(f"kvtier-router did not start: {line!r}")
    return proc, match.group(1)


def router_stats(address: str) -> dict:
    import urllib.request
    with urllib.request.urlopen(f"http://{address}/v1/stats", timeout=30) as reply:
        return json.loads(reply.read())


def build_trace(requests: int, prefixes: int, prefix_blocks: int, zipf_s: float, seed: int):
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, prefixes + 1) ** zipf_s
    picks = rng.choice(prefixes, size=requests, p=weights / weights.sum())
    bt = NS.layout.block_tokens
    heads = [rng.integers(0, 32000, prefix_blocks * bt).tolist() for _ in range(prefixes)]
    for i, p in enumerate(picks.tolist()):
        yield heads[p] + rng.integers(0, 32000, 2 * bt).tolist()  # the prefix, then a unique user turn


def held(clients: dict, keys) -> dict[str, int]:
    out = {}
    for address, client in clients.items():
        try:
            out[address] = client.lookup(keys)
        except (OSError, ClientError):
            out[address] = 0  # down (restarting): holds nothing for its clients
    return out


def run(args) -> dict:
    base = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    nodes = start_nodes(base, args.nodes)
    router, router_address = start_router(nodes, args.probe_fraction)
    edges = [d.data_addr for d in nodes]
    clients = {a: BlockClient(a, timeout_s=5.0, pool_size=args.clients) for a in edges}
    picker = EdgePicker(edges, router_url=f"http://{router_address}", timeout_s=1.0, retry_after_s=0.5)
    rendezvous = Rendezvous(edges)
    tally = collections.Counter()
    lock = threading.Lock()

    def serve(i: int, tokens: list[int]) -> None:
        rng = np.random.default_rng([args.seed, i])
        keys = NS.keys(tokens)
        choice = picker.pick(keys)
        truth = held(clients, keys)
        best = max(truth.values())
        address = choice.address
        placed_random = choice.source != "router"
        if placed_random:
            address = edges[int(rng.integers(len(edges)))]  # a new prefix: a load balancer's pick
        right = truth[address] == best
        owner = rendezvous.members[int(rendezvous.owners([keys[0]])[0])]
        counts = {"requests": 1, "router_right": right, "placed_random": placed_random,
                  "router_picks": not placed_random}
        if best > 0:
            counts.update(held_somewhere=1, router_right_held=right,
                          random_right_held=truth[edges[int(rng.integers(len(edges)))]] == best,
                          rendezvous_right_held=truth[owner] == best)
        missing = keys[truth[address]:]
        try:
            clients[address].put_many([(k, encode_block(k, NS.id, 1, bytes(PAYLOAD_BYTES))) for k in missing])
            counts["blocks_stored"] = len(missing)
        except (OSError, ClientError):
            counts["put_failures"] = 1
        with lock:
            tally.update({k: int(v) for k, v in counts.items()})

    trace = list(build_trace(args.requests, args.prefixes, args.prefix_blocks, args.zipf, args.seed))
    half = len(trace) // 2
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(serve, range(half), trace[:half]))
            log(f"{half} requests, routed right {tally['router_right'] / tally['requests']:.4f}; "
                f"restarting {nodes[2].node_id} while the rest run")
            restart = threading.Thread(target=nodes[2].restart)
            restart.start()
            list(pool.map(serve, range(half, len(trace)), trace[half:]))
            restart.join()
        elapsed = time.perf_counter() - started
        stats = router_stats(router_address)
        evicted = {}
        for d in nodes:
            with BlockClient(d.data_addr) as c:
                evicted[d.node_id] = c.stats()["engine"]["evicted_blocks"]
    finally:
        for client in clients.values():
            client.close()
        router.terminate()
        router.wait(30)
        for d in nodes:
            if d.alive():
                d.stop()
    held_n = tally["held_somewhere"]

    def share(name: str) -> float | None:
        return round(tally[name] / held_n, 4) if held_n else None

    return {
        "config": vars(args), "elapsed_s": round(elapsed, 2), "tally": dict(tally),
        "routed_right": round(tally["router_right"] / tally["requests"], 4),
        "routed_right_when_held": share("router_right_held"), "random_right_when_held": share("random_right_held"),
        "rendezvous_right_when_held": share("rendezvous_right_held"),
        "router_probe_accuracy": stats["accuracy"], "router_table": stats["table"],
        "router_subscriber": stats["subscriber"], "evicted_blocks_since_start": evicted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--clients", type=int, default=1, help="requests in flight at once (threads)")
    ap.add_argument("--prefixes", type=int, default=300)
    ap.add_argument("--prefix-blocks", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--probe-fraction", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--json", default=str(RESULTS / "routing.json"))
    args = ap.parse_args()
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    t = result["tally"]
    print(f"| clients | requests | held somewhere | routed right (all) | routed right (held) | random (held) | "
          f"rendezvous (held) | router probe accuracy | gaps | snapshots | replays |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    acc = result["router_probe_accuracy"] or {}
    print(f"| {args.clients} | {t['requests']} | {t['held_somewhere']} | {result['routed_right']} | {result['routed_right_when_held']} | "
          f"{result['random_right_when_held']} | {result['rendezvous_right_when_held']} | "
          f"{acc.get('accuracy')} ({acc.get('accurate')}/{acc.get('probed')}) | {result['router_table']['gaps']} | "
          f"{result['router_table']['snapshots_loaded']} | {result['router_subscriber'].get('replays', 0)} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
