"""Child process for the SIGKILL crash test (tests/test_recovery_crash.py).

    engine_crash_child.py STORE_DIR FIRST_INDEX [evicting]

Opens (or creates) the store in STORE_DIR and puts blocks FIRST_INDEX,
FIRST_INDEX+1, ... forever: most durable, some buffered, with an occasional
flush; now and then it deletes or pins one of its acknowledged blocks. After
each durable operation returns it prints ``acked N`` / ``deleted N`` /
``pinned N`` (flushed), so the parent knows exactly what was acknowledged
when it kills the child; ``deleting N`` goes out before a delete starts.

``evicting``: a store of 24 regions that the puts fill many times over, written by three
threads at once (durable puts commit in groups; the reclaim worker evicts and moves pinned
blocks in the background); every block a thread pins it also acknowledges as ``pinned N``.
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


def evicting_config(store_dir: str) -> EngineConfig:
    return EngineConfig(device_paths=(str(Path(store_dir) / "a.img"), str(Path(store_dir) / "b.img")),
                        device_size_bytes=12 * MiB, stripe_size_bytes=256 * 1024, region_size_bytes=MiB)


def crash_block(i: int) -> bytes:
    return block(i, 1000 + (i * 7919) % 60_000)


def evicting_writer(engine, first: int, seed: int, out_lock) -> None:
    rng = random.Random(seed)
    i, acked = first, []
    while True:
        durable = rng.random() < 0.5
        engine.put(crash_block(i), durable=durable)
        if durable:
            acked.append(i)
            with out_lock:
                print(f"acked {i}", flush=True)
        if acked and rng.random() < 0.05:
            victim = acked.pop(rng.randrange(len(acked)))
            with out_lock:
                print(f"deleting {victim}", flush=True)
            engine.delete_many([key(victim)])
            with out_lock:
                print(f"deleted {victim}", flush=True)
        if acked and rng.random() < 0.02:
            chosen = acked.pop(rng.randrange(len(acked)))  # never deleted after: pinned for good
            if engine.pin_many([key(chosen)]) == [True]:
                with out_lock:
                    print(f"pinned {chosen}", flush=True)
        if rng.random() < 0.01:
            engine.flush()
        i += 1


def main_evicting(store_dir: str, first: int) -> None:
    import threading

    engine = Engine.open(evicting_config(store_dir), create_if_missing=True)
    print("ready", flush=True)
    out_lock = threading.Lock()
    threads = [threading.Thread(target=evicting_writer, args=(engine, first + t * 100_000, first + t, out_lock),
                                daemon=True) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[3] == "evicting":
        main_evicting(sys.argv[1], int(sys.argv[2]))
        return
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
