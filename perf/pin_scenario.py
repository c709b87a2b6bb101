"""The pin scenario of issue 31: can hard pins wedge a small store?

    .venv/bin/python perf/pin_scenario.py                 # 600 s
    .venv/bin/python perf/pin_scenario.py --seconds 60    # a smoke run

A kvtierd on 2 x 64 MiB device files with 8 MiB regions (default eviction). Two writers store
buffered 1 MiB blocks as fast as they can; a third stores 4 KiB blocks durably and hard-pins
each, 20 a second, until the pinned-bytes limit refuses a pin; from then on it unpins its oldest
pin before each new one, so pins keep landing in new regions for the whole run. Counted:

- **NO_SPACE refusals of PUTs and DELETEs**: every one is a refusal while evictable bytes exist
  (the pins stay under ``pinned_fraction_max`` of the capacity);
- pins acknowledged, pins refused by the pinned-bytes limit (a PIN refusal is expected);
- after the run: a clean restart, then durable PUTs (each must succeed) and every pin read back.

Prints a line every 10 s and a JSON summary (``--out``); exit status 1 when a PUT or DELETE was
refused NO_SPACE, a pin was lost, or a durable PUT failed after the restart.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import start_kvtierd  # noqa: E402

from kvtier.client import BlockClient  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402
from kvtier.wire import connection as p  # noqa: E402

PINS_PER_S = 20


def key_of(kind: str, n: int) -> bytes:
    return f"{kind}{n:015d}".encode()[:16]


def bulk_writer(addr: str, tag: str, until: float, counts: collections.Counter, lock: threading.Lock) -> None:
    payload = os.urandom((1 << 20) - 64)
    with BlockClient(addr, timeout_s=60.0) as client:
        n = 0
        while time.monotonic() < until:
            n += 1
            key = key_of(tag, n)
            try:
                client.put(key, encode_block(key, bytes(16), 0, payload))
                with lock:
                    counts["bulk_puts"] += 1
            except p.RemoteError as exc:
                with lock:
                    counts[f"bulk_put_{exc.code.name}"] += 1


def pinner(addr: str, until: float, counts: collections.Counter, lock: threading.Lock, pinned: list) -> None:
    payload = os.urandom(4096 - 64)
    with BlockClient(addr, timeout_s=60.0) as client:
        n = 0
        next_at = time.monotonic()
        while time.monotonic() < until:
            next_at += 1 / PINS_PER_S
            time.sleep(max(0.0, next_at - time.monotonic()))
            n += 1
            key = key_of("p", n)
            try:
                client.put(key, encode_block(key, bytes(16), 0, payload), durable=True)
                if counts["pin_limit_refusals"] and pinned:  # at the limit: one out, one in
                    client.unpin([pinned.pop(0)])
                    with lock:
                        counts["unpins"] += 1
                if client.pin([key])[0]:
                    pinned.append(key)
                    with lock:
                        counts["pins"] += 1
                if n % 50 == 0:  # deletes go through the same room check as PUTs
                    gone = key_of("p", n - 25)
                    if gone not in pinned:
                        client.delete_many([gone])
                        with lock:
                            counts["deletes"] += 1
            except p.RemoteError as exc:
                with lock:
                    if exc.code == p.ErrorCode.NO_SPACE and "pinned_fraction_max" in str(exc):
                        counts["pin_limit_refusals"] += 1
                    else:
                        counts[f"pinner_{exc.code.name}"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--out", help="JSON summary path")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtier-pin-scenario-"))
    d = start_kvtierd(work / "d", "--device-size", "64m", "--region-size", "8m", "--stripe-size", "1m")
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    pinned: list[bytes] = []
    started = time.monotonic()
    until = started + args.seconds
    threads = [threading.Thread(target=bulk_writer, args=(d.data_addr, tag, until, counts, lock)) for tag in "ab"]
    threads.append(threading.Thread(target=pinner, args=(d.data_addr, until, counts, lock, pinned)))
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(min(10.0, max(0.1, until - time.monotonic() + 0.5)))
        with lock:
            print(f"{time.monotonic() - started:6.0f} s  {dict(counts)}  pinned {len(pinned)}", flush=True)
    for t in threads:
        t.join()
    assert d.stop() == 0, d.log_tail()
    d.start()
    after = collections.Counter()
    try:
        with BlockClient(d.data_addr, timeout_s=60.0) as client:
            after["pins_lost"] = sum(client.get(k) is None for k in pinned)
            for n in range(200):
                key = key_of("r", n)
                try:
                    client.put(key, encode_block(key, bytes(16), 0, os.urandom(4032)), durable=True)
                    after["durable_puts_after_restart"] += 1
                except p.RemoteError as exc:
                    after[f"after_restart_{exc.code.name}"] += 1
            stats = client.stats()["engine"]
    finally:
        d.stop()
    refused = sum(v for k, v in counts.items() if k.endswith("NO_SPACE"))
    summary = {"seconds": args.seconds, "counts": dict(counts), "pins_held": len(pinned), "after_restart": dict(after),
               "no_space_refusals": refused, "pinned_bytes": stats.get("pinned_bytes"),
               "capacity_bytes": 2 * 64 << 20, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    bad = refused or after["pins_lost"] or after["durable_puts_after_restart"] != 200
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
