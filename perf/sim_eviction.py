"""Eviction policies on kvperf's prefix trace, simulated block by block at region granularity.

Which blocks a full store keeps decides its hit ratio. This replays kvperf's synthetic
prefix trace (system prompt | shared document | unique user turn, Zipf popularity) against
a model of the engine's log-structured store -- blocks append to an open region, a full
store reclaims a whole sealed region chosen by the eviction policy, and the reinsertion
policy moves the blocks it picks into the new region -- using the engine's own policy
classes (``kvtier.daemon.engine.eviction``, ``.reinsertion``). Each request does what a
connector does: LOOKUP (the leading run of present blocks is the hit), GET those, PUT the
rest. References in the same run: an exact block-level LRU and Belady's optimum (block
level, no region constraint) with the same capacity.

    .venv/bin/python perf/sim_eviction.py --requests 10000 --capacity-fraction 0.2

The hit ratio is hit blocks over requested blocks (the unique user turns never hit, so
the ceiling is the shared fraction of each prompt).
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import sys
import time
from collections import OrderedDict, deque
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # noqa: E402  (run from a checkout)
from kvtier.daemon.engine.eviction import EVICTION_POLICIES, make_policy  # noqa: E402
from kvtier.daemon.engine.reinsertion import HOT_REINSERT_FRACTION_MAX, make_reinsertion  # noqa: E402
from kvtier.tools.kvperf.options import JobOptions  # noqa: E402
from kvtier.tools.kvperf.trace import SyntheticTrace  # noqa: E402

REGION_BLOCKS_DEFAULT = 32  # a 64 MiB region of 2 MiB blocks
S3_SMALL_FRACTION = 0.1  # S3-FIFO's small queue: a tenth of the regions
S3_GHOST_FRACTION = 0.9  # ghost entries: as many as the main queue holds blocks


def chains(job: JobOptions, requests: int) -> list[list[int]]:
    """Each prompt's chained block keys (an 8-byte BLAKE2b chain, like the real keys but cheaper)."""
    out = []
    prompts = SyntheticTrace(job, 0).prompts()
    for _ in range(requests):
        tokens = next(prompts)
        prev, keys = b"", []
        for i in range(len(tokens) // job.block_tokens):
            prev = hashlib.blake2b(prev + tokens[i * job.block_tokens:(i + 1) * job.block_tokens].tobytes(),
                                   digest_size=8).digest()
            keys.append(int.from_bytes(prev, "little"))
        out.append(keys)
    return out


class LogStore:
    """The engine's store, modelled: regions of ``region_blocks`` blocks, one open region,
    whole-region reclaim in the eviction policy's order, reinsertion of the blocks it picks."""

    def __init__(self, regions: int, region_blocks: int, eviction: str, reinsert_hits: int):
        self.region_blocks = region_blocks
        self.policy = make_policy(eviction)
        self.reinsertion = make_reinsertion(reinsert_hits)
        self.blocks: list[list[int]] = [[] for _ in range(regions)]
        self.where: dict[int, int] = {}
        self.hits: dict[int, int] = {}
        self.free = deque(range(1, regions))
        self.open = 0

    def lookup(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.where:
                break
            n += 1
        return n

    def read(self, keys: list[int]) -> None:
        for k in keys:
            self.hits[k] = min(self.hits[k] + 1, 255)
            self.policy.touch(self.where[k])

    def put(self, key: int) -> None:
        if key in self.where:
            return
        if len(self.blocks[self.open]) == self.region_blocks:
            self._roll()
        self.blocks[self.open].append(key)
        self.where[key] = self.open
        self.hits[key] = 0

    def _roll(self) -> None:
        self.policy.track(self.open)
        if self.free:
            self.open = self.free.popleft()
            return
        victim = next(iter(self.policy.candidates()))
        self.policy.remove(victim)
        live = self.blocks[victim]
        hits = np.array([self.hits[k] for k in live], np.int64)
        keep = self.reinsertion.select(hits, np.ones(len(live), np.int64),
                                       int(self.region_blocks * HOT_REINSERT_FRACTION_MAX))
        for k, kept in zip(live, keep):
            if kept:
                self.hits[k] = 0  # reset when moved, as the engine does
            else:
                del self.where[k], self.hits[k]
        self.blocks[victim] = [k for k, kept in zip(live, keep) if kept]
        self.open = victim


class S3FifoLogStore:
    """S3-FIFO over regions: new blocks go to a small FIFO log; a reclaim of a small region
    moves the blocks read since written to the main log and remembers the others' keys in a
    ghost FIFO; a block whose key is a ghost goes straight to main; a reclaim of a main region
    reinserts its blocks read since written (or moved), up to the reinsertion budget."""

    def __init__(self, regions: int, region_blocks: int):
        small = max(2, int(regions * S3_SMALL_FRACTION))
        self.small = LogStore(small, region_blocks, "fifo", 0)
        self.main = LogStore(regions - small, region_blocks, "fifo", 1)
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.ghost_max = int((regions - small) * region_blocks * S3_GHOST_FRACTION)
        self.small._roll = self._roll_small

    def _store_of(self, key: int):
        return self.small if key in self.small.where else self.main

    def lookup(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.small.where and k not in self.main.where:
                break
            n += 1
        return n

    def read(self, keys: list[int]) -> None:
        for k in keys:
            self._store_of(k).read([k])

    def put(self, key: int) -> None:
        if key in self.small.where or key in self.main.where:
            return
        if key in self.ghost:
            del self.ghost[key]
            self.main.put(key)
        else:
            self.small.put(key)

    def _roll_small(self) -> None:
        s = self.small
        s.policy.track(s.open)
        if s.free:
            s.open = s.free.popleft()
            return
        victim = next(iter(s.policy.candidates()))
        s.policy.remove(victim)
        for k in s.blocks[victim]:
            read = s.hits.pop(k) > 0
            del s.where[k]
            if read:
                self.main.put(k)
            else:
                self.ghost[k] = None
                if len(self.ghost) > self.ghost_max:
                    self.ghost.popitem(last=False)
        s.blocks[victim] = []
        s.open = victim


class BlockLru:
    """Exact LRU over blocks, no regions: the offline reference."""

    def __init__(self, capacity: int):
        self.capacity, self.order = capacity, OrderedDict()

    def lookup(self, keys):
        n = 0
        for k in keys:
            if k not in self.order:
                break
            n += 1
        return n

    def read(self, keys):
        for k in keys:
            self.order.move_to_end(k)

    def put(self, key):
        if key in self.order:
            self.order.move_to_end(key)
            return
        self.order[key] = None
        if len(self.order) > self.capacity:
            self.order.popitem(last=False)


def belady_hit_ratio(trace: list[list[int]], capacity: int) -> float:
    """Belady's optimum at block level: on a miss, evict the block needed farthest in the future."""
    flat = [k for keys in trace for k in keys]
    next_use = [0] * len(flat)
    seen: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i], len(flat) + i)
        seen[flat[i]] = i
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []
    hits = requested = 0
    pos = 0
    for keys in trace:
        leading = True
        for k in keys:
            nu = next_use[pos]
            pos += 1
            requested += 1
            if k in cached:
                hits += leading
            else:
                leading = False
                if len(cached) >= capacity:
                    while True:
                        far, victim = heapq.heappop(heap)
                        if cached.get(victim) == -far:
                            break
                    if -far < nu:  # the newcomer is needed later than anything cached: do not keep it
                        cached[victim] = -far
                        heapq.heappush(heap, (far, victim))
                        continue
                    del cached[victim]
            cached[k] = nu
            heapq.heappush(heap, (-nu, k))
    return hits / requested


def replay(store, trace: list[list[int]]) -> float:
    hits = requested = 0
    for keys in trace:
        n = store.lookup(keys)
        store.read(keys[:n])
        for k in keys[n:]:
            store.put(k)
        hits += n
        requested += len(keys)
    return hits / requested


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--capacity-fraction", type=float, default=0.2,
                    help="store capacity over the trace's distinct blocks (0.2: the trace is 5x the store)")
    ap.add_argument("--region-blocks", type=int, default=REGION_BLOCKS_DEFAULT)
    ap.add_argument("--prefix-docs", type=int, default=JobOptions.prefix_docs)
    ap.add_argument("--prefix-systems", type=int, default=JobOptions.prefix_systems)
    ap.add_argument("--prefix-share", type=float, default=JobOptions.prefix_share)
    ap.add_argument("--theta", type=float, default=JobOptions.random_distribution)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="sweep capacity fractions 0.01..0.3 and plot hit ratio per policy to this PNG")
    return ap.parse_args(argv)


def run(args) -> dict:
    job = replace(JobOptions(name="sim"), prefix_docs=args.prefix_docs, prefix_systems=args.prefix_systems,
                  prefix_share=args.prefix_share,
                  random_distribution=args.theta)
    started = time.perf_counter()
    trace = chains(job, args.requests)
    distinct = len({k for keys in trace for k in keys})
    capacity = max(2 * args.region_blocks, int(distinct * args.capacity_fraction))
    regions = capacity // args.region_blocks
    print(f"trace: {args.requests} requests, {sum(map(len, trace))} blocks, {distinct} distinct; "
          f"store: {regions} regions x {args.region_blocks} blocks ({time.perf_counter() - started:.1f} s)",
          file=sys.stderr)
    results = {}
    candidates = {f"{ev}" + (f"+reinsert{r}" if r else ""): (lambda ev=ev, r=r: LogStore(regions, args.region_blocks,
                                                                                          ev, r))
                  for ev in EVICTION_POLICIES for r in (0, 1)}
    candidates["s3fifo"] = lambda: S3FifoLogStore(regions, args.region_blocks)
    candidates["block-lru (offline reference)"] = lambda: BlockLru(regions * args.region_blocks)
    for name, make in candidates.items():
        t0 = time.perf_counter()
        results[name] = replay(make(), trace)
        print(f"  {name:32s} hit ratio {results[name]:.4f}  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    t0 = time.perf_counter()
    results["belady (block level)"] = belady_hit_ratio(trace, regions * args.region_blocks)
    print(f"  {'belady (block level)':32s} hit ratio {results['belady (block level)']:.4f}  "
          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    lru = results["block-lru (offline reference)"]
    doc = {"requests": args.requests, "distinct_blocks": distinct, "capacity_blocks": regions * args.region_blocks,
           "region_blocks": args.region_blocks, "prefix_docs": args.prefix_docs, "prefix_share": args.prefix_share, "theta": args.theta,
           "hit_ratio": results, "vs_block_lru": {k: v / lru if lru else None for k, v in results.items()},
           "points_over_fifo": {k: 100 * (v - results["fifo"]) for k, v in results.items()}}
    return doc


SWEEP_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)


def sweep(args) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    docs = [run(replace_args(args, capacity_fraction=f)) for f in SWEEP_FRACTIONS]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in docs[0]["hit_ratio"]:
        ax.plot(SWEEP_FRACTIONS, [d["hit_ratio"][name] for d in docs], marker="o", label=name,
                linestyle="--" if "reference" in name or "belady" in name else "-")
    ax.set_xscale("log")
    ax.set_xlabel("store capacity / distinct blocks of the trace")
    ax.set_ylabel("prefix hit ratio (blocks)")
    ax.set_title(f"kvperf prefix trace, {args.requests} requests, {args.prefix_docs} documents")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    if args.json:
        Path(args.json).write_text(json.dumps(docs, indent=1))
    print(json.dumps(docs, indent=1))
    return 0


def replace_args(args, **changes):
    return argparse.Namespace(**{**vars(args), **changes})


def main(argv=None) -> int:
    args = parse(argv)
    if args.plot:
        return sweep(args)
    doc = run(args)
    print(json.dumps(doc, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
