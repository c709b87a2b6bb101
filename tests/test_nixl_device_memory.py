"""NIXL GETs written straight from the daemon's device memory (device files on a memory
filesystem), part by part: the bytes arrive whole and verified, the blocks are counted, and a
block whose bytes changed on the device fails the client's check and is a miss."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

nixl_api = pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from test_nixl_transport import LOOPBACK_ENV, NS, put_blocks, start_nixl_daemon  # noqa: E402
from kvtier.client import BlockClient  # noqa: E402
from kvtier.client.nixl_transport import NixlTransport  # noqa: E402
from kvtier.daemon.engine.memory_backed import on_memory_filesystem  # noqa: E402

SHM = "/dev/shm"


@pytest.fixture(scope="module")
def shm_daemon():
    if not on_memory_filesystem(SHM):
        pytest.skip(f"{SHM} is not a memory filesystem here")
    path = Path(tempfile.mkdtemp(prefix="kvtier-test-nixl-", dir=SHM))
    d = start_nixl_daemon(path, "--stripe-size", "256k")
    yield d
    try:
        assert d.stop() == 0, d.log_tail()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _get(addr, keys, locations):
    transport = NixlTransport(addr)
    try:
        got = transport.get_many(keys, [loc.length for loc in locations], [loc.seq for loc in locations], NS)
        return [None if g is None else bytes(g) for g in got], transport.statistics()
    finally:
        transport.close()


def _device_stats(addr) -> dict:
    with BlockClient(addr) as client:
        return client.stats()["nixl"]


def test_blocks_on_memory_devices_are_written_from_where_they_lie(shm_daemon):
    keys, blocks, locations = put_blocks(shm_daemon.data_addr, 6, (3 << 20) + 1000, seed=40)  # parts cut blocks
    with BlockClient(shm_daemon.data_addr) as client:
        client.flush()  # written in place and synced: on the devices, so in their memory
    before = _device_stats(shm_daemon.data_addr)
    got, stats = _get(shm_daemon.data_addr, keys, locations)
    assert [g[64:] for g in got] == [b[64:] for b in blocks] and stats.corrupt_blocks == 0
    after = _device_stats(shm_daemon.data_addr)
    assert after["blocks_from_device_memory"] - before.get("blocks_from_device_memory", 0) == 6
    assert after["device_memories"] == len(list(shm_daemon.data_dir.glob("device*.img"))) > 1
    assert after["device_memory_bytes"] > 0


def test_blocks_not_yet_on_the_devices_come_from_the_arena_in_the_same_get(shm_daemon):
    on_devices = put_blocks(shm_daemon.data_addr, 2, 100_000, seed=41)
    with BlockClient(shm_daemon.data_addr) as client:
        client.flush()
    buffered = put_blocks(shm_daemon.data_addr, 2, 100_000, seed=42)  # in the open region's DRAM image only
    keys, blocks = on_devices[0] + buffered[0], on_devices[1] + buffered[1]
    before = _device_stats(shm_daemon.data_addr).get("blocks_from_device_memory", 0)
    got, _ = _get(shm_daemon.data_addr, keys, on_devices[2] + buffered[2])
    assert [g[64:] for g in got] == [b[64:] for b in blocks]
    assert _device_stats(shm_daemon.data_addr)["blocks_from_device_memory"] - before == 2


def test_a_block_changed_on_its_device_fails_at_the_client_and_is_a_miss(shm_daemon):
    keys, blocks, locations = put_blocks(shm_daemon.data_addr, 3, 200_000, seed=43)
    with BlockClient(shm_daemon.data_addr) as client:
        client.flush()
    probe = blocks[1][1000:1064]  # payload bytes of block 1, found in its device file
    for path in shm_daemon.data_dir.glob("device*.img"):
        at = path.read_bytes().find(probe)
        if at >= 0:
            with open(path, "r+b") as f:  # as a region rewritten under the index would leave it
                f.seek(at + 10)
                f.write(bytes([probe[10] ^ 0xFF]))
            break
    else:
        pytest.fail("block 1's bytes are in no device file")
    got, stats = _get(shm_daemon.data_addr, keys, locations)
    assert got[1] is None and stats.corrupt_blocks == 1
    assert got[0][64:] == blocks[0][64:] and got[2][64:] == blocks[2][64:]
    with BlockClient(shm_daemon.data_addr) as client:  # the fallback: the open region's image is still intact
        assert client.get_many([keys[1]], ns_id=NS)[0][64:] == blocks[1][64:]
