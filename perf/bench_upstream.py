"""Cold vs warm GET of a prefix at an edge kvtierd whose region is across a shaped WAN
(1 Gbit/s tbf, 20 ms from a delay proxy; ``tests/wan_link.py``), with the same GET at the
region directly, across the same WAN, as the reference. Needs root (network namespaces).

    sudo .venv/bin/python perf/bench_upstream.py --reps 10 --blocks 32 --block-kib 256

Prints one JSON document: per case the median and p90 of the GET's wall time in ms.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import start_kvtierd  # noqa: E402
from wan_link import REGION_TOKEN, start_wan_region, wan_namespace  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402


def prefix(ns: bytes, blocks: int, payload_bytes: int):
    keys = [os.urandom(16) for _ in range(blocks)]
    return keys, [encode_block(k, ns, 0, os.urandom(payload_bytes)) for k in keys]


def timed_get(client: BlockClient, keys, ns: bytes, origins: list | None = None) -> float:
    started = time.perf_counter()
    got = client.get_many(keys, ns_id=ns, origins=origins)
    elapsed = time.perf_counter() - started
    assert all(g is not None for g in got), "a block of the prefix was missing"
    return elapsed


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"median_ms": round(1000 * ordered[len(ordered) // 2], 2),
            "p90_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 2),
            "samples": len(ordered)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-kib", type=int, default=256)
    args = ap.parse_args()
    ns = os.urandom(16)
    with tempfile.TemporaryDirectory() as tmp, wan_namespace() as netns:
        tmp = Path(tmp)
        link = start_wan_region(netns, tmp / "region", tmp / "region-token")
        edge = start_kvtierd(tmp / "edge", "--upstream", link.proxy.address, "--upstream-token-file",
                             str(tmp / "region-token"), "--device-size", "512m", "--region-size", "8m")
        try:
            with BlockClient(link.proxy.address, token=REGION_TOKEN) as region, \
                    BlockClient(edge.data_addr) as at_edge:
                prefixes = [prefix(ns, args.blocks, args.block_kib * 1024) for _ in range(args.reps)]
                for keys, blocks in prefixes:
                    region.put_many(list(zip(keys, blocks)), ns_id=ns)
                region.ping(), at_edge.ping()
                reference, cold, warm = [], [], []
                for keys, _ in prefixes:
                    reference.append(timed_get(region, keys, ns))  # the region directly, across the WAN
                    origins: list = []
                    cold.append(timed_get(at_edge, keys, ns, origins))
                    assert all(origins), "a cold GET was served locally"
                    origins = []
                    warm.append(timed_get(at_edge, keys, ns, origins))
                    assert not any(origins), "a warm GET went upstream"
        finally:
            edge.stop()
            link.close()
    doc = {"prefix_bytes": args.blocks * args.block_kib * 1024, "blocks": args.blocks, "reps": args.reps,
           "wan": "tbf 1gbit both veth ends + 20 ms per reply frame (delay proxy)",
           "region_direct_over_wan": summary(reference), "edge_cold": summary(cold), "edge_warm": summary(warm)}
    doc["cold_over_reference"] = round(doc["edge_cold"]["median_ms"] / doc["region_direct_over_wan"]["median_ms"], 2)
    doc["warm_over_reference"] = round(doc["edge_warm"]["median_ms"] / doc["region_direct_over_wan"]["median_ms"], 2)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
