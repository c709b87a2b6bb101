"""Soak: kill -9 cycles of a kvtierd under four writers with hard pins, soft pins, durable and
buffered PUTs and deletes, checked after every restart.

    .venv/bin/python perf/soak.py                 # 100 cycles (make soak)
    .venv/bin/python perf/soak.py --cycles 5      # a smoke run

Each cycle: four writers (a BlockClient each) run for ``--cycle-s`` seconds, each op one of a
durable PUT, a buffered PUT, a hard PIN of a block it stored durably, a soft PIN, an UNPIN or a
DELETE of a block it stored; hard pins are kept under PINNED_SHARE_MAX of the capacity. Then the
daemon is killed (SIGKILL) and started again on the same store, and read back:

- **wrong bytes**: a block served with other bytes than were stored under its key (keys are never
  reused), among every pinned, deleted and recent key and a sample of the others;
- **acknowledged durable lost**: a durable PUT acknowledged with less than RECENT_SHARE of the
  capacity written after it (all writers together: FIFO eviction cannot have reached it) that is
  missing;
- **acknowledged deletes resurrected**: a DELETE acknowledged whose key is served again;
- **pins lost**: a hard PIN acknowledged (and not undone) whose block is missing;
- **refusals for lack of room**: PUTs answered NO_SPACE (hard pins stay far under the share that
  could fill the store, so every one is a refusal while evictable bytes existed);
- **wedged cycles**: cycles in which some writer got nothing but NO_SPACE.

Prints a line per cycle and a JSON summary (``--out``). Exit status 1 when any count that must be 0
is not.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
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

NS = b"\x50" * 16
DEVICE_MIB, DEVICES, REGION_MIB = 16, 4, 4
CAPACITY_BYTES = DEVICE_MIB * DEVICES << 20
PINNED_SHARE_MAX = 0.10
RECENT_SHARE = 0.25  # a durable block with less than this share of the capacity written after it cannot be evicted
SAMPLE_CHECKED = 300  # other keys read back per cycle
SIZES = (4096, 64 << 10, 256 << 10, 1 << 20)
WRITERS = 4


class Ledger:
    """What the writers were told, with a clock of bytes acknowledged."""

    def __init__(self):
        self.lock = threading.Lock()
        self.payloads: dict[bytes, int] = {}  # key -> payload seed (the block is rebuilt from it)
        self.durable_at: dict[bytes, int] = {}  # key -> bytes acknowledged before its durable PUT
        self.pinned: dict[bytes, int] = {}  # key -> length
        self.deleted: set[bytes] = set()
        self.written = 0
        self.counts = dict(durable_puts=0, buffered_puts=0, pins=0, soft_pins=0, unpins=0, deletes=0, refusals=0,
                           other_errors=0)


def block_of(key: bytes, seed: int) -> bytes:
    size = SIZES[seed % len(SIZES)]
    return encode_block(key, NS, 0, random.Random(seed).randbytes(size - 64))


def writer(addr: str, ledger: Ledger, writer_id: int, cycle: int, until: float, refused: list) -> None:
    rng = random.Random(cycle * 100 + writer_id)
    mine: list[bytes] = []
    n = 0
    with BlockClient(addr, timeout_s=30.0) as client:
        while time.monotonic() < until:
            op = rng.random()
            try:
                if op < 0.70 or not mine:
                    n += 1
                    key = f"{cycle:05d}{writer_id}{n:09d}".encode()[:16].ljust(16, b"-")
                    seed = rng.getrandbits(31)
                    blk = block_of(key, seed)
                    durable = rng.random() < 0.5
                    client.put_many([(key, blk)], durable=durable, ns_id=NS)
                    with ledger.lock:
                        ledger.payloads[key] = seed
                        if durable:
                            ledger.durable_at[key] = ledger.written
                        ledger.written += len(blk)
                        ledger.counts["durable_puts" if durable else "buffered_puts"] += 1
                    mine.append(key)
                elif op < 0.78:
                    key = rng.choice(mine)
                    with ledger.lock:
                        if key not in ledger.durable_at or key in ledger.deleted or \
                                sum(ledger.pinned.values()) > PINNED_SHARE_MAX * CAPACITY_BYTES:
                            continue
                    if client.pin([key])[0]:
                        with ledger.lock:
                            if key not in ledger.deleted:
                                ledger.pinned[key] = SIZES[ledger.payloads[key] % len(SIZES)]
                                ledger.counts["pins"] += 1
                elif op < 0.84:
                    client.pin([rng.choice(mine)], ttl_s=30.0)
                    ledger.counts["soft_pins"] += 1
                elif op < 0.90:  # half of them undo a hard pin, so pins keep landing in new regions
                    with ledger.lock:
                        pinned = sorted(ledger.pinned)
                    key = rng.choice(pinned) if pinned and rng.random() < 0.5 else rng.choice(mine)
                    client.unpin([key])
                    with ledger.lock:
                        ledger.pinned.pop(key, None)
                        ledger.counts["unpins"] += 1
                else:
                    key = rng.choice(mine)
                    mine.remove(key)
                    client.delete_many([key])
                    with ledger.lock:
                        ledger.deleted.add(key)
                        ledger.pinned.pop(key, None)
                        ledger.counts["deletes"] += 1
            except p.RemoteError as exc:
                with ledger.lock:
                    if exc.code == p.ErrorCode.NO_SPACE:
                        ledger.counts["refusals"] += 1
                        refused.append(writer_id)
                    else:
                        ledger.counts["other_errors"] += 1


def check(addr: str, ledger: Ledger, rng: random.Random) -> dict:
    found = dict(wrong_bytes=0, durable_lost=0, deletes_resurrected=0, pins_lost=0)
    with ledger.lock:
        recent = [k for k, at in ledger.durable_at.items()
                  if ledger.written - at < RECENT_SHARE * CAPACITY_BYTES and k not in ledger.deleted]
        pinned = list(ledger.pinned)
        deleted = list(ledger.deleted)
        others = rng.sample(list(ledger.payloads), min(SAMPLE_CHECKED, len(ledger.payloads)))
        payloads = dict(ledger.payloads)
    with BlockClient(addr, timeout_s=60.0) as client:
        for key in set(recent) | set(pinned) | set(others):
            got = client.get(key, ns_id=NS)
            if key in deleted:
                continue
            if got is None:
                found["pins_lost"] += key in pinned
                found["durable_lost"] += key in recent and key not in pinned
            elif bytes(got)[64:] != block_of(key, payloads[key])[64:]:
                found["wrong_bytes"] += 1
        for key in deleted:
            found["deletes_resurrected"] += client.get(key, ns_id=NS) is not None
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--cycle-s", type=float, default=2.0, help="seconds the writers run before each kill -9")
    ap.add_argument("--out", help="JSON summary path")
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="kvtier-soak-", dir="/var/tmp"))
    ledger, totals, wedged = Ledger(), dict(wrong_bytes=0, durable_lost=0, deletes_resurrected=0, pins_lost=0), 0
    rng = random.Random(7)
    started = time.monotonic()
    d = start_kvtierd(data, "--device-size", f"{DEVICE_MIB}m", "--region-size", f"{REGION_MIB}m")
    try:
        for cycle in range(args.cycles):
            refused: list[int] = []
            until = time.monotonic() + args.cycle_s
            threads = [threading.Thread(target=writer, args=(d.data_addr, ledger, w, cycle, until, refused))
                       for w in range(WRITERS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            d.kill()
            d.start()
            found = check(d.data_addr, ledger, rng)
            for name, n in found.items():
                totals[name] += n
            wedged += len(set(refused)) == WRITERS and ledger.counts["refusals"] > 0
            print(f"[soak {time.strftime('%H:%M:%S')}] cycle {cycle + 1}/{args.cycles}: written "
                  f"{ledger.written / CAPACITY_BYTES:.1f}x capacity, {ledger.counts}, {found}", flush=True)
    finally:
        d.kill()
        shutil.rmtree(data, ignore_errors=True)
    summary = {"cycles": args.cycles, "cycle_s": args.cycle_s, "writers": WRITERS, "capacity_bytes": CAPACITY_BYTES,
               "written_x_capacity": round(ledger.written / CAPACITY_BYTES, 1), **ledger.counts, **totals,
               "wedged_cycles": wedged, "seconds": round(time.monotonic() - started, 1),
               "command": "perf/soak.py " + " ".join(sys.argv[1:])}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    bad = totals["wrong_bytes"] + totals["durable_lost"] + totals["deletes_resurrected"] + totals["pins_lost"] + \
        ledger.counts["refusals"] + wedged
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
