"""Child process for the SIGKILL crash test (tests/test_recovery_crash.py).

    engine_crash_child.py STORE_DIR FIRST_INDEX

Opens (or creates) the store in STORE_DIR and puts blocks FIRST_INDEX,
FIRST_INDEX+1, ... forever: most durable, some buffered, with an occasional
flush; now and then it deletes or pins one of its acknowledged blocks. After
each durable operation returns it prints ``acked N`` / ``deleted N`` /
``pinned N`` (flushed), so the parent knows exactly what was acknowledged
when it kills the child; ``deleting N`` goes out before a delete starts.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

from kvtier.daemon.engine import Engine, EngineConfig

from test_engine import block, key

MiB = 1 << 20


def crash_config(store_dir: str) -> EngineConfig:
    return EngineConfig(device_paths=(str(Path(store_dir) / "a.img"), str(Path(store_dir) / "b.img")),
                        device_size_bytes=64 * MiB, stripe_size_bytes=256 * 1024, region_size_bytes=MiB)


def crash_block(i: int) -> bytes:
    return block(i, 1000 + (i * 7919) % 60_000)


def main() -> None:
    store_dir, first = sys.argv[1], int(sys.argv[2])
    rng = random.Random(first)
    engine = Engine.open(crash_config(store_dir), create_if_missing=True)
    print("ready", flush=True)
    i = first
    acked: list[int] = []
    while True:
        durable = rng.random() < 0.7
        engine.put(crash_block(i), durable=durable)
        if durable:
            acked.append(i)
            print(f"acked {i}", flush=True)
        if rng.random() < 0.03:
            engine.flush()
        if acked and rng.random() < 0.05:
            victim = acked.pop(rng.randrange(len(acked)))
            print(f"deleting {victim}", flush=True)  # from here on the parent cannot count on it
            engine.delete_many([key(victim)])
            print(f"deleted {victim}", flush=True)
        if acked and rng.random() < 0.05:
            chosen = acked[rng.randrange(len(acked))]
            engine.pin_many([key(chosen)])
            print(f"pinned {chosen}", flush=True)
        i += 1


if __name__ == "__main__":
    main()
