"""KV events of a real kvtierd over real ZMQ sockets on 127.0.0.1: what a PUT, a delete, an
eviction and delete_all publish, contiguous numbering, replay and the snapshot."""
from __future__ import annotations

import hashlib

import pytest
import zmq

from kvtier.client import BlockClient
from kvtier.common.blockformat import encode_block
from kvtier.daemon.events import kv_event_format as fmt
from kvtier.daemon.events.snapshot import snapshot_from_document

from kv_events_fixtures import Subscription, admin_get, admin_post, start_events_daemon

NS = bytes(range(16))
MiB = 1 << 20


def key(i: int, salt: bytes = b"t") -> bytes:
    return hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=16).digest()


def block(i: int, size: int = 4096, salt: bytes = b"t") -> tuple[bytes, bytes]:
    """(key, block): what BlockClient.put_many takes."""
    return key(i, salt), encode_block(key(i, salt), NS, 1, bytes([i % 251]) * size)


class Mirror:
    """The key set the events describe."""

    def __init__(self):
        self.keys: set[bytes] = set()

    def apply(self, batch: fmt.KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, fmt.BlockStored):
                self.keys |= set(event.block_hashes)
            elif isinstance(event, fmt.BlockRemoved):
                self.keys -= set(event.block_hashes)
            else:
                self.keys.clear()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def daemon(tmp_path):
    d = start_events_daemon(tmp_path / "d", "--device-size", "16m", "--region-size", "1m", "--stripe-size", "128k")
    yield d
    if d.alive():
        assert d.stop() == 0, d.log_tail()


def replay(ctx, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(5000), "no replay answer"
            frames = sock.recv_multipart()
            assert frames[0] == b""
            if frames[2] == fmt.END_SEQ:
                return out
            out.append((fmt.decode_seq(frames[2]), frames[3]))
    finally:
        sock.close(linger=0)


def test_put_delete_evict_and_delete_all_publish_contiguous_vllm_batches(daemon, ctx):
    with BlockClient(daemon.data_addr) as client:
        assert "kv_events" in client.server_info()["features"]
        sub = Subscription(ctx, daemon.events_endpoint)
        mirror = Mirror()
        first_seq, first = sub.wait_served(lambda i: client.put_many([block(1000 + i)]))
        mirror.apply(first)
        received = [(first_seq, first)]

        def next_batch():
            got = sub.receive()
            assert got is not None, "no KV event"
            assert got[0] == received[-1][0] + 1, f"seq {got[0]} after {received[-1][0]}: not contiguous"
            received.append(got)
            mirror.apply(got[1])
            return got[1]

        probes = {key(1000 + i) for i in range(50)} & mirror.keys  # probe PUTs whose event came
        client.put_many([block(i) for i in range(3)])
        batch = next_batch()
        while not any(key(0) in getattr(e, "block_hashes", []) for e in batch.events):
            batch = next_batch()  # a late probe's event
        (stored,) = batch.events
        assert isinstance(stored, fmt.BlockStored) and stored.block_hashes == [key(0), key(1), key(2)]
        assert stored.medium == "STORAGE" and stored.token_ids == [] and stored.parent_block_hash is None
        assert client.delete_many([key(1)]) == [True]
        (removed,) = next_batch().events
        assert isinstance(removed, fmt.BlockRemoved) and removed.block_hashes == [key(1)]
        admin_post(daemon, "/v1/evict", {"keys": [key(2).hex()]})
        (removed,) = next_batch().events
        assert removed.block_hashes == [key(2)]

        # fill past the store's 64 MiB: reclaims evict whole regions
        for i in range(100):
            client.put_many([block(100 + i, 900_000)])
        evicted = set()
        while sub.sock.poll(2000):
            batch = next_batch()
            for event in batch.events:
                if isinstance(event, fmt.BlockRemoved):
                    evicted |= set(event.block_hashes)
        assert key(0) in evicted and len(evicted) > 20
        snapshot = snapshot_from_document(admin_get(daemon, "/v1/kv-events/snapshot"))
        assert snapshot.seq == received[-1][0]
        assert set(snapshot.keys()) == mirror.keys
        assert client.lookup([k for k in mirror.keys if k not in probes][:1]) == 1

        admin_post(daemon, "/v1/evict", {"all": True})
        (cleared,) = next_batch().events
        assert isinstance(cleared, fmt.AllBlocksCleared) and mirror.keys == set()
        client.put_many([block(7)])
        next_batch()
        assert mirror.keys == {key(7)} == set(snapshot_from_document(admin_get(daemon, "/v1/kv-events/snapshot")).keys())
        sub.close()

    info = admin_get(daemon, "/v1/kv-events")
    assert info["seq_last"] == received[-1][0] and info["batches_dropped"] == 0
    assert info["events_cleared"] == 1 and info["endpoint"] == daemon.events_endpoint
    import urllib.request
    with urllib.request.urlopen(f"http://{daemon.admin_addr}/metrics", timeout=30) as reply:
        metrics = reply.read().decode()
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert float(values["kvtier_kv_events_last_seq"]) == float(received[-1][0])
    assert 'kvtier_kv_events_total{type="AllBlocksCleared"} 1.0' in metrics
    # the replay socket answers the same batches, byte for byte
    replayed = replay(ctx, daemon.replay_endpoint, received[0][0])
    assert [seq for seq, _ in replayed] == [seq for seq, _ in received]
    assert [fmt.decode_batch(p) for _, p in replayed] == [b for _, b in received]


def test_a_bad_replay_request_gets_the_end_marker_and_replay_serves_on(daemon, ctx):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.replay_endpoint)
    try:
        sock.send_multipart([b"", b"\x01\x02"])  # a 2-byte sequence number
        assert sock.poll(5000)
        assert sock.recv_multipart() == [b"", b"", fmt.END_SEQ, b""]
    finally:
        sock.close(linger=0)
    with BlockClient(daemon.data_addr) as client:
        client.put_many([block(1)])
    start = snapshot_from_document(admin_get(daemon, "/v1/kv-events/snapshot")).seq
    assert [seq for seq, _ in replay(ctx, daemon.replay_endpoint, start)] == [start]
    assert admin_get(daemon, "/v1/kv-events")["replay_bad_requests"] == 1


def test_kv_events_are_off_by_default(kvtierd):
    with BlockClient(kvtierd.data_addr) as client:
        assert "kv_events" not in client.server_info()["features"]


def test_a_busy_kv_events_port_is_a_startup_error_naming_it(tmp_path, ctx):
    from ports import free_port
    from daemon_proc import start_kvtierd
    port = free_port()
    taken = ctx.socket(zmq.PUB)
    taken.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(RuntimeError, match="did not become ready") as info:
            start_kvtierd(tmp_path / "d", "--kv-events-endpoint", f"tcp://127.0.0.1:{port}")
        assert f"tcp://127.0.0.1:{port}" in str(info.value)
    finally:
        taken.close(linger=0)
