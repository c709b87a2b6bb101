"""Does a block's CRC get cheaper next to its send? The sender's CPU for 1 GiB of engine-layout rows.

A TCP store reads every byte twice on the client: once for the payload CRC (the header that carries
it goes first) and once for the kernel's copy into the socket. If the second read found the bytes
still in the cache, sending a block's CRC after its payload (a trailer, a protocol change) would
save most of one pass. This measures that before anyone builds it: the same rows (a
``[32 layers, 2, 1, 8 heads, 8192 tokens, 128]`` int16 tensor, 64 KiB rows at a 2 MiB stride, as
``bench_store_load.py`` stores them) CRC'd and sent over a socketpair to a draining child process,
in four orders:

- ``cold``: the CRC of every block, then every send (today's pipeline: a chunk is sealed well
  before its PUT, so the send reads it from memory again);
- ``per_block``: each 32 MiB block CRC'd, then sent at once;
- ``per_mib_crc_first`` / ``per_mib_send_first``: 1 MiB at a time (inside L2), CRC then send, or
  send then CRC (the trailer's order).

Prints and writes the sender thread's CPU seconds per GiB for each order, per round.

    .venv/bin/python perf/bench_crc_send_order.py --rounds 3 --out perf/results/<date>/crc_send_order.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import crc32c
import numpy as np

LAYERS, HEADS, TOKENS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 8192, 128, 256
ROWS_PER_MIB = 16  # 64 KiB rows
GiB = 1 << 30


def block_rows(bits: np.ndarray, block: int) -> list[np.ndarray]:
    """Block ``block``'s rows in payload order: layer, K/V, head."""
    start, end = block * BLOCK_TOKENS, (block + 1) * BLOCK_TOKENS
    return [bits[layer, which, 0, head, start:end]
            for layer in range(LAYERS) for which in range(2) for head in range(HEADS)]


def send_all(sock: socket.socket, rows: list) -> None:
    rows, i = list(rows), 0
    while i < len(rows):
        n = sock.sendmsg(rows[i:i + 512])
        while n:
            if n >= rows[i].nbytes:
                n -= rows[i].nbytes
                i += 1
            else:
                rows[i] = memoryview(rows[i]).cast("B")[n:]
                n = 0


def crc_of(rows: list) -> int:
    crc = 0
    for row in rows:
        crc = crc32c.crc32c(row, crc)
    return crc


def orders(sock: socket.socket, blocks: list[list[np.ndarray]]) -> dict:
    def cold():
        for rows in blocks:
            crc_of(rows)
        for rows in blocks:
            send_all(sock, rows)

    def per_block():
        for rows in blocks:
            crc_of(rows)
            send_all(sock, rows)

    def per_mib(crc_first: bool):
        for rows in blocks:
            for j in range(0, len(rows), ROWS_PER_MIB):
                piece = rows[j:j + ROWS_PER_MIB]
                if crc_first:
                    crc_of(piece)
                send_all(sock, piece)
                if not crc_first:
                    crc_of(piece)

    runs = {"cold": cold, "per_block": per_block, "per_mib_crc_first": lambda: per_mib(True),
            "per_mib_send_first": lambda: per_mib(False)}
    out = {}
    for name, run in runs.items():
        t0 = time.thread_time()
        run()
        out[name] = time.thread_time() - t0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch  # the engine's memory, as bench_store_load.py's requests are (not NumPy's, which asks for huge pages)

    gen = torch.Generator().manual_seed(20261206)
    bits = torch.randint(-32768, 32768, (LAYERS, 2, 1, HEADS, TOKENS, HEAD_DIM), generator=gen,
                         dtype=torch.int16).numpy()
    blocks = [block_rows(bits, b) for b in range(TOKENS // BLOCK_TOKENS)]
    nbytes = bits.nbytes
    sender, receiver = socket.socketpair()
    for s in (sender, receiver):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    child = os.fork()
    if child == 0:
        sender.close()
        sink = bytearray(1 << 20)
        while receiver.recv_into(sink):
            pass
        os._exit(0)
    receiver.close()
    rounds = []
    try:
        for r in range(args.rounds):
            got = {k: v * GiB / nbytes for k, v in orders(sender, blocks).items()}
            rounds.append(got)
            print(f"[round {r + 1}/{args.rounds}] " + "  ".join(f"{k} {v:.3f}" for k, v in got.items())
                  + "  (sender CPU s/GiB)", file=sys.stderr)
    finally:
        sender.close()
        os.waitpid(child, 0)
    result = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv),
              "bytes": nbytes, "sender_cpu_s_per_gib": rounds}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
