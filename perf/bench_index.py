"""The in-memory index alone: batch lookups (``BlockIndex.find_many``) of 1024 keys.

    .venv/bin/python perf/bench_index.py

Three tables: 1 M hashed keys (kvtier's own keys are BLAKE2b digests), probed with
1024 present and 1024 absent keys; and 20 000 keys that count up in their first 8 bytes
(a client that does not hash), probed the same way, the absent ones counting up from
10 000 000 -- the case that used to pile keys into one run of slots, which every absent
key then walked. Best of 5 rounds of 0.3 s; writes perf/out/index.json.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtier.daemon.engine.index import BlockIndex  # noqa: E402

BATCH = 1024


def keys_per_s(index: BlockIndex, k0: np.ndarray, k1: np.ndarray) -> float:
    """Best of 5 rounds, each as many batches as fit in 0.3 s (at least one)."""
    best = float("inf")
    for _ in range(5):
        t0, batches = time.perf_counter(), 0
        while batches == 0 or time.perf_counter() - t0 < 0.3:
            index.find_many(k0, k1)
            batches += 1
        best = min(best, (time.perf_counter() - t0) / batches)
    return len(k0) / best


def table(k0: np.ndarray, k1: np.ndarray) -> BlockIndex:
    index = BlockIndex()
    n = len(k0)
    index.insert_many(k0, k1, np.arange(n, dtype=np.uint64), np.full(n, 64, np.uint32), np.zeros(n, np.uint32))
    return index


def main() -> int:
    rng = np.random.default_rng(7)
    out = {}
    n = 1_000_000
    k0, k1 = (rng.integers(0, 2**64, n, dtype=np.uint64) for _ in range(2))
    hashed = table(k0, k1)
    a0, a1 = (rng.integers(0, 2**64, BATCH, dtype=np.uint64) for _ in range(2))
    out["hashed_1m_present_keys_per_s"] = keys_per_s(hashed, k0[-BATCH:], k1[-BATCH:])
    out["hashed_1m_absent_keys_per_s"] = keys_per_s(hashed, a0, a1)
    n = 20_000
    c0, c1 = np.arange(n, dtype=np.uint64), np.full(n, 0x6B6579, np.uint64)
    counting = table(c0, c1)
    out["counting_20k_present_keys_per_s"] = keys_per_s(counting, c0[:BATCH], c1[:BATCH])
    out["counting_20k_absent_keys_per_s"] = keys_per_s(counting, c0[:BATCH] + np.uint64(10_000_000), c1[:BATCH])
    for name, value in out.items():
        print(f"{name:<36} {value / 1e6:8.2f} M keys/s")
    dest = ROOT / "perf" / "out" / "index.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
