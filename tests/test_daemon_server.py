"""DataServer in-process on a real engine and real sockets: paths that need
settings the command line does not expose (a small reply payload limit)."""
import os

import pytest

from kvtier.client import BlockClient
from kvtier.client.blockformat import HEADER_SIZE, encode_block
from kvtier.daemon.engine import Engine, EngineConfig
from kvtier.daemon.server import DataServer

NS = b"\x0c" * 16


@pytest.fixture
def engine(tmp_path):
    cfg = EngineConfig(device_paths=tuple(str(tmp_path / f"dev{i}") for i in range(2)),
                       device_size_bytes=32 << 20, stripe_size_bytes=256 << 10, region_size_bytes=2 << 20)
    eng = Engine.open(cfg, create_if_missing=True)
    yield eng
    eng.close()


def test_gets_over_the_reply_limit_are_deferred_and_fetched_again(engine):
    server = DataServer(engine, "127.0.0.1", 0, region_size_bytes=2 << 20, payload_bytes_max=1 << 20)
    host, port = server.start()
    try:
        keys = [bytes([7]) + i.to_bytes(15, "little") for i in range(40)]
        blocks = [encode_block(k, NS, 0, os.urandom(100_000 + i)) for i, k in enumerate(keys)]  # ~4 MiB in all
        with BlockClient(f"{host}:{port}") as c:
            assert c.server_info()["limits"]["payload_bytes_max"] == 1 << 20
            assert len(c.put_many(list(zip(keys, blocks)))) == 40  # the client splits the PUT too
            got = c.get_many(keys + [b"\x00" * 16])
            assert [g[HEADER_SIZE:] for g in got[:40]] == [b[HEADER_SIZE:] for b in blocks] and got[40] is None
            assert c.statistics().frames >= 5  # 4 MiB through 1 MiB replies: several rounds
    finally:
        server.stop()
    stats = server.statistics()
    assert stats.requests["get"] >= 4 and stats.namespaces["none"].hits == 40
    assert stats.latency["get"].cumulative_counts[-1] == stats.requests["get"]
    with pytest.raises(TypeError):
        stats.requests["get"] = 0  # a frozen snapshot


def test_statistics_count_bytes_and_ops(engine):
    server = DataServer(engine, "127.0.0.1", 0, region_size_bytes=2 << 20)
    host, port = server.start()
    try:
        key = b"\x09" * 16
        block = encode_block(key, NS, 0, os.urandom(50_000))
        with BlockClient(f"{host}:{port}", pool_size=1) as c:
            c.put(key, block)
            assert c.get(key)[HEADER_SIZE:] == block[HEADER_SIZE:]
    finally:
        server.stop()  # joins the connection threads: every request is recorded
    stats = server.statistics()
    assert stats.requests["put"] == 1 and stats.requests["get"] == 1 and stats.requests["hello"] == 1
    assert stats.bytes_in > len(block) and stats.bytes_out > len(block)
    assert stats.total_connections == 1 and stats.errors == {} and stats.open_connections == 0
