"""NIXL tenant isolation against a real kvtierd, over shared memory and over UCX TCP: a client with
the token takes every byte of metadata the daemon hands it, treats every address-like value in it
as the daemon's memory, and posts its own READs and WRITEs there while another tenant stores and
loads through NIXL (its traffic, and the attacker's own legitimate NIXL_GETs, move the daemon's
worker). It must read none of the other tenant's bytes, change none of the daemon's memory, and
the daemon must serve on (tests/nixl_attacker_child.py is the attacker)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

import torch  # noqa: E402

from nixl_daemon import LOOPBACK_ENV, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.kvcache import KVCache  # noqa: E402
from kvtier.common.blockformat import encode_block  # noqa: E402
from kvtier.common.keys import KVLayout, Namespace  # noqa: E402

os.environ.update(LOOPBACK_ENV)
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=32)
MARKER = b"victim-kv-secret"  # the victim's KV is this, repeated: any 16 bytes of it read elsewhere is a leak
ATTACKER_NS = b"\x0a" * 16
ATTACKER_KEY = b"\xa7" * 16
ATTACK_S = 8.0
STORED_ROUNDS_MAX = 200  # 4 blocks of 64 KiB each: 50 MiB, a fifth of the daemon's store


def _marker_kv(tokens: int):
    shape = (1, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    per_tensor = tokens * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2
    raw = bytearray(MARKER * (per_tensor // len(MARKER)))
    return [tuple(torch.frombuffer(bytearray(raw), dtype=torch.float16).view(shape) for _ in "kv")
            for _ in range(LAYOUT.num_layers)]


def _same(loaded, kv) -> bool:
    return all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for pair, ref in zip(loaded.layers, kv) for a, b in zip(pair, ref))


@pytest.fixture(params=["sm", "tcp"])
def daemon(request):
    # device files on tmpfs: the daemon's devices are memory it could be tempted to hand out
    data = Path(tempfile.mkdtemp(prefix="kvtier-isolation-", dir="/dev/shm"))
    tls = () if request.param == "sm" else ("--nixl-tls", "self,tcp")
    d = start_nixl_daemon(data, "--device-size", "64m", "--region-size", "8m", *tls)
    d.tls = "self,sm,tcp" if request.param == "sm" else "self,tcp"
    try:
        yield d
    finally:
        if d.alive():
            d.stop()
        shutil.rmtree(data, ignore_errors=True)


class Victim(threading.Thread):
    """Stores new prefixes of marker KV and loads them back through NIXL until stopped."""

    def __init__(self, addr: str):
        super().__init__(daemon=True)
        self.addr = addr
        self.stop = threading.Event()
        self.rounds = 0
        self.stored: list[tuple[list[int], list]] = []
        self.failure: str | None = None

    def run(self) -> None:
        ns = Namespace("victim-model", LAYOUT, tenant_salt="victim")
        try:
            with KVCache(ns, self.addr, hot_pool_bytes=0, transport="nixl") as cache:
                assert cache.wait_nixl_ready(10.0)
                while not self.stop.is_set():
                    if len(self.stored) < STORED_ROUNDS_MAX:
                        tokens = [self.rounds * 1000 + i for i in range(32 * 4)]
                        kv = _marker_kv(len(tokens))
                        assert cache.store(tokens, kv, durable=self.rounds % 2 == 0) == 4
                        self.stored.append((tokens, kv))
                    else:  # the store stays far from full (nothing evicted): loads only, of what is there
                        tokens, kv = self.stored[self.rounds % STORED_ROUNDS_MAX]
                    loaded = cache.load(tokens)
                    assert loaded.num_tokens == len(tokens) and _same(loaded, kv), "a load came back wrong"
                    self.rounds += 1
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"


@pytest.mark.slow  # waits out a NIXL timeout or bound
def test_a_token_holder_reads_no_other_tenants_bytes_and_writes_no_daemon_memory(daemon):
    with BlockClient(daemon.data_addr) as client:  # the attacker's own block: its kick is a legitimate NIXL_GET
        client.put_many([(ATTACKER_KEY, encode_block(ATTACKER_KEY, ATTACKER_NS, 0, os.urandom(1 << 20)))],
                        ns_id=ATTACKER_NS)
    victim = Victim(daemon.data_addr)
    victim.start()
    attacker = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("nixl_attacker_child.py")), daemon.data_addr, MARKER.hex(),
         ATTACKER_KEY.hex(), ATTACKER_NS.hex(), str(ATTACK_S)],
        capture_output=True, timeout=ATTACK_S + 120, env={**os.environ, **LOOPBACK_ENV, "UCX_TLS": daemon.tls})
    victim.stop.set()
    victim.join(60)
    assert attacker.returncode == 0, attacker.stderr.decode()[-3000:]
    stats = json.loads(attacker.stdout.decode().strip().splitlines()[-1])
    assert daemon.alive(), daemon.log_tail()
    assert stats["metadata_bytes"] > 0 and stats["kicks_served"] > 0, stats  # the attack ran, the daemon served it
    assert stats["marker_hits"] == 0 and stats["reads_done"] == 0 and stats["bytes_read"] == 0, stats
    assert stats["writes_done"] == 0, stats
    assert "error" not in stats and "kick_error" not in stats, stats
    assert victim.failure is None and victim.rounds > 0, victim.failure
    ns = Namespace("victim-model", LAYOUT, tenant_salt="victim")
    with KVCache(ns, daemon.data_addr, hot_pool_bytes=0, transport="tcp") as cache:  # the daemon's memory unchanged
        found = [cache.load(tokens).num_tokens for tokens, kv in victim.stored]
    assert found == [len(t) for t, _ in victim.stored], (found, daemon.log_tail())
    assert daemon.stop() == 0, daemon.log_tail()
