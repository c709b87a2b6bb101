"""KV events without sockets: the vLLM wire format, the sink's numbering and bounds, and the
engine's listener hook mirrored against the engine's own key set."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvtier.daemon.engine.block_events import NO_LISTENER
from kvtier.daemon.events import kv_event_format as fmt
from kvtier.daemon.events.event_sink import EventKind, KVEventSink, halves_to_keys
from kvtier.daemon.events.snapshot import snapshot_from_document, take_snapshot
from kvtier.daemon.engine import regionfmt

from test_engine import PAYLOAD_5_PER_REGION, NS, block, key, mem_engine

VLLM_PYTHON = Path("/var/cache/kvtier/engine-venvs/.venv-vllm/bin/python")
K1, K2 = bytes(range(16)), bytes(range(16, 32))


def sample_batch() -> fmt.KVEventBatch:
    return fmt.KVEventBatch(ts=1.5, events=[fmt.stored([K1, K2]), fmt.removed([K1]), fmt.AllBlocksCleared()])


# -- the wire format ---------------------------------------------------------------------
def test_batch_is_an_array_of_tagged_maps_as_vllm_sends_it():
    raw = msgspec.msgpack.decode(fmt.encode_batch(sample_batch()))
    assert raw[0] == 1.5
    stored, removed, cleared = raw[1]
    assert stored == {"type": "BlockStored", "block_hashes": [K1, K2], "parent_block_hash": None, "token_ids": [],
                      "block_size": 0, "lora_id": None, "medium": "STORAGE", "lora_name": None}
    assert removed == {"type": "BlockRemoved", "block_hashes": [K1], "medium": "STORAGE"}
    assert cleared == {"type": "AllBlocksCleared"}
    assert fmt.decode_batch(fmt.encode_batch(sample_batch())) == sample_batch()


def test_multipart_message_roundtrip_and_bad_messages_are_named():
    frames = fmt.message_frames(b"kv", 2**40 + 7, fmt.encode_batch(sample_batch()))
    assert frames[1] == (2**40 + 7).to_bytes(8, "big")
    assert fmt.parse_message(list(frames)) == (b"kv", 2**40 + 7, sample_batch())
    with pytest.raises(fmt.KVEventFormatError, match="3 frames"):
        fmt.parse_message(list(frames[:2]))
    with pytest.raises(fmt.KVEventFormatError, match="sequence frame of 4 bytes"):
        fmt.parse_message([b"", b"\0\0\0\1", frames[2]])
    with pytest.raises(fmt.KVEventFormatError, match="not a KVEventBatch"):
        fmt.parse_message([b"", frames[1], b"\x93garbage"])


_VLLM_ROUNDTRIP = r"""
import sys, json, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
ours = bytes.fromhex(sys.stdin.readline().strip())
batch = msgspec.msgpack.decode(ours, type=KVEventBatch)
out = [[type(e).__name__, [h.hex() for h in getattr(e, "block_hashes", [])], getattr(e, "medium", None)]
       for e in batch.events]
theirs = KVEventBatch(ts=2.5, events=[
    BlockStored(block_hashes=[bytes(range(16))], parent_block_hash=None, token_ids=[1, 2], block_size=16,
                lora_id=None, medium="GPU", lora_name=None),
    BlockRemoved(block_hashes=[bytes(range(16, 32))], medium="GPU"), AllBlocksCleared()])
print(json.dumps({"ts": batch.ts, "events": out, "theirs": msgspec.msgpack.encode(theirs).hex()}))
"""


def _vllm_available() -> bool:
    return VLLM_PYTHON.exists() and subprocess.run(
        [str(VLLM_PYTHON), "-P", "-c", "import vllm.distributed.kv_events"], capture_output=True, timeout=120).returncode == 0


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM engine venv at {VLLM_PYTHON}")
def test_vllms_own_structs_decode_our_bytes_and_we_decode_theirs():
    if not _vllm_available():
        pytest.skip("vllm.distributed.kv_events does not import in the engine venv")
    proc = subprocess.run([str(VLLM_PYTHON), "-P", "-c", _VLLM_ROUNDTRIP], input=fmt.encode_batch(sample_batch()).hex(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["ts"] == 1.5
    assert doc["events"] == [["BlockStored", [K1.hex(), K2.hex()], "STORAGE"], ["BlockRemoved", [K1.hex()], "STORAGE"],
                             ["AllBlocksCleared", [], None]]
    theirs = fmt.decode_batch(bytes.fromhex(doc["theirs"]))
    assert [type(e).__name__ for e in theirs.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert theirs.events[0].block_hashes == [K1] and theirs.events[0].token_ids == [1, 2]
    assert theirs.events[0].block_size == 16 and theirs.events[1].block_hashes == [K2]


# -- the sink ------------------------------------------------------------------------------
def halves(keys):
    return regionfmt.keys_to_halves(keys)


def test_sink_numbers_batches_contiguously_and_a_full_queue_drops_and_counts():
    sink = KVEventSink(queue_batches_max=2, first_seq=100, clock=lambda: 7.0)
    try:
        assert sink.position() == 99
        sink.blocks_stored(*halves([K1, K2]))
        sink.blocks_removed(*halves([K1]))
        sink.blocks_stored(*halves([K2]))  # the queue is full: dropped, its number spent
        sink.blocks_removed(np.zeros(0, np.uint64), np.zeros(0, np.uint64))  # nothing: no batch
        assert sink.position() == 102
        stats = sink.statistics()
        assert (stats.batches_queued, stats.batches_dropped, stats.queue_batches) == (2, 1, 2)
        taken = sink.take_all()
        assert [(b.seq, b.kind) for b in taken] == [(100, EventKind.STORED), (101, EventKind.REMOVED)]
        assert halves_to_keys(taken[0].k0, taken[0].k1) == [K1, K2] and taken[0].ts == 7.0
        sink.all_cleared()
        assert [(b.seq, b.kind) for b in sink.take_all()] == [(103, EventKind.CLEARED)]
    finally:
        sink.close()


def test_sink_starts_numbering_at_the_start_time_in_microseconds():
    before = time.time_ns() // 1000
    sink = KVEventSink()
    try:
        assert before <= sink.first_seq <= time.time_ns() // 1000
    finally:
        sink.close()


def test_snapshot_document_roundtrip_and_bad_documents():
    from kvtier.daemon.events.snapshot import KVSnapshot
    snap = KVSnapshot(seq=5, first_seq=3, packed_keys=K1 + K2)
    back = snapshot_from_document(json.loads(json.dumps(snap.as_document())))
    assert back == snap and back.keys() == [K1, K2] and back.block_count == 2
    with pytest.raises(ValueError, match="seq"):
        snapshot_from_document({"first_seq": 1, "keys": ""})
    with pytest.raises(ValueError, match="whole number"):
        snapshot_from_document({"seq": 1, "first_seq": 1, "keys": "AAAA"})


# -- the engine's hook ------------------------------------------------------------------------
class MirrorListener:
    """Keeps the key set the events describe (what a subscriber would know)."""

    def __init__(self):
        self.keys: set[bytes] = set()
        self.log: list[tuple[str, list[bytes]]] = []

    def blocks_stored(self, k0, k1):
        keys = halves_to_keys(k0, k1)
        assert not (self.keys & set(keys)), "a stored event for a key already stored"
        self.keys |= set(keys)
        self.log.append(("stored", keys))

    def blocks_removed(self, k0, k1):
        keys = halves_to_keys(k0, k1)
        assert set(keys) <= self.keys, "a removed event for a key not stored"
        self.keys -= set(keys)
        self.log.append(("removed", keys))

    def all_cleared(self):
        self.keys.clear()
        self.log.append(("cleared", []))


def engine_keys(engine) -> set[bytes]:
    k0, k1, _ = engine.stored_keys()
    return set(halves_to_keys(k0, k1))


def test_engine_reports_put_delete_namespace_delete_and_delete_all():
    engine, _, _ = mem_engine()
    try:
        mirror = MirrorListener()
        engine.set_block_listener(mirror)
        engine.put_many([block(i) for i in range(4)])
        assert mirror.log == [("stored", [key(i) for i in range(4)])]
        engine.put_many([block(0), block(4)])  # a present key is a no-op: only the new one is reported
        assert mirror.log[-1] == ("stored", [key(4)])
        assert engine.delete_many([key(1), key(99)]) == [True, False]
        assert mirror.log[-1] == ("removed", [key(1)])
        other_ns = bytes(16)
        engine.put_many([block(10, ns=other_ns), block(11, ns=other_ns)])
        assert engine.delete_namespace(other_ns) == 2
        assert mirror.log[-1][0] == "removed" and set(mirror.log[-1][1]) == {key(10), key(11)}
        assert mirror.keys == engine_keys(engine) == {key(0), key(2), key(3), key(4)}
        engine.delete_all()
        assert mirror.log[-1] == ("cleared", []) and engine_keys(engine) == set()
        engine.set_block_listener(NO_LISTENER)
        engine.put(block(50))
        assert mirror.keys == set()
    finally:
        engine.close()


@pytest.mark.parametrize("reinsert_hits", [0, 1])
def test_engine_reports_evictions_and_moved_blocks_so_the_mirror_stays_exact(reinsert_hits):
    engine, _, _ = mem_engine(regions=4, reinsertion_hits_min=reinsert_hits)
    try:
        mirror = MirrorListener()
        engine.set_block_listener(mirror)
        engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(5)])
        engine.pin_many([key(0)])
        engine.get(key(1))  # a hot block: moved by a reclaim when reinsertion is on
        for i in range(5, 40):
            engine.put(block(i, PAYLOAD_5_PER_REGION))
            assert mirror.keys == engine_keys(engine), f"after put {i}"
        assert engine.statistics().evicted_blocks > 0
        assert any(kind == "removed" for kind, _ in mirror.log)
        assert engine.statistics().reinsertions > 0
        assert key(0) in mirror.keys  # pinned: moved, and never reported (its key stayed stored)
        assert not any(key(0) in keys for kind, keys in mirror.log[1:])
    finally:
        engine.close()


def test_snapshot_seq_matches_the_state_it_describes():
    engine, _, _ = mem_engine()
    sink = KVEventSink(first_seq=1)
    try:
        engine.set_block_listener(sink)
        engine.put_many([block(i) for i in range(3)])
        engine.delete_many([key(0)])
        snap = take_snapshot(engine, sink)
        assert snap.seq == 2 and set(snap.keys()) == {key(1), key(2)}
        engine.put(block(7))
        assert take_snapshot(engine, sink).seq == 3
    finally:
        engine.close()
        sink.close()


# -- configuration ------------------------------------------------------------------------------
def test_kv_events_flags_and_toml_keys_and_their_errors(tmp_path):
    from kvtier.daemon.config import ConfigError, config_from_args
    cfg = config_from_args(["--kv-events-endpoint", "tcp://127.0.0.1:0",
                            "--kv-events-replay-endpoint", "tcp://127.0.0.1:7413"])
    assert (cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint) == ("tcp://127.0.0.1:0", "tcp://127.0.0.1:7413")
    assert config_from_args([]).kv_events_endpoint is None  # off by default
    toml = tmp_path / "kvtierd.toml"
    toml.write_text('kv_events_endpoint = "tcp://*:7412"\n')
    assert config_from_args(["--config", str(toml)]).kv_events_endpoint == "tcp://*:7412"
    for argv, match in [(["--kv-events-endpoint", "http://x:1"], "not a ZMQ endpoint"),
                        (["--kv-events-endpoint", "tcp://127.0.0.1"], "HOST:PORT"),
                        (["--kv-events-replay-endpoint", "tcp://127.0.0.1:5"], "only makes sense"),
                        (["--kv-events-endpoint", "tcp://127.0.0.1:5", "--kv-events-replay-endpoint",
                          "tcp://127.0.0.1:5"], "port of its own")]:
        with pytest.raises(ConfigError, match=match):
            config_from_args(argv)
    toml.write_text("kv_events_endpoint = 7412\n")
    with pytest.raises(ConfigError, match="kv_events_endpoint: expected a string"):
        config_from_args(["--config", str(toml)])
