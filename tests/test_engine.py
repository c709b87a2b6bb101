"""Engine behaviour on memory devices (fast) and real O_DIRECT files:
put/get/lookup, batch forms, exact-order eviction, pinning, bad input."""
from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from kvtier.common.blockformat import BlockFormatError, decode_header, encode_block
from kvtier.daemon.engine import (BlockLocation, Engine, EngineConfig, EngineError, EngineStatistics,
                                  NoSpaceError)
from kvtier.daemon.engine.devices import MemoryDevice
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

MiB = 1 << 20
NS = bytes(range(16))
REGION = MiB
# 200_000-byte payloads: 5 blocks fill one 1 MiB region exactly (6 would not fit with their summary entries)
PAYLOAD_5_PER_REGION = 200_000


def key(i: int, salt: bytes = b"") -> bytes:
    return hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=16).digest()


def block(i: int, size: int = 1000, ns: bytes = NS, salt: bytes = b"") -> bytes:
    payload = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
    return encode_block(key(i, salt), ns, 1, payload)


def same_block(got: bytes | None, sent: bytes) -> bool:
    """Equal except the seq the engine stamped (and the header CRC that covers it)."""
    return got is not None and got[:48] == sent[:48] and got[64:] == sent[64:] and decode_header(got).seq > 0


def mem_engine(regions: int = 4, devices: int = 2, eviction: str = "fifo", region: int = REGION, **extra):
    cfg = EngineConfig(device_paths=tuple(f"mem{i}" for i in range(devices)), stripe_size_bytes=region // devices // 2,
                       region_size_bytes=region, eviction=eviction, **extra)
    devs = [MemoryDevice(DATA_OFFSET_BYTES + regions * region // devices, f"mem{i}") for i in range(devices)]
    Engine.format(cfg, devices=devs)
    return Engine.open(cfg, devices=devs), cfg, devs


@pytest.fixture
def eng():
    engine, _, _ = mem_engine()
    yield engine
    engine.close()


def seal(engine) -> None:
    """Seal the open region now and sync (a FLUSH writes it in place instead): for tests of
    sealed regions, reclaim and recovery that need one."""
    with engine._lock:
        engine._seal_and_sync()


def present(engine, ids) -> list[int]:
    return [i for i in ids if engine.lookup([key(i)]) == 1]


# -- basics ----------------------------------------------------------------
def test_put_get_roundtrip_from_open_buffer_and_flash(eng):
    sent = {i: block(i, 5000 + i) for i in range(30)}
    seqs = [eng.put(b) for b in sent.values()]
    assert seqs == sorted(seqs) and len(set(seqs)) == 30
    assert all(same_block(eng.get(key(i)), b) for i, b in sent.items())  # from the open buffer
    eng.flush()
    assert all(same_block(eng.get(key(i)), b) for i, b in sent.items())  # from flash
    got = eng.get_many([key(i) for i in range(30)] + [key(999)])
    assert got[-1] is None and all(same_block(g, sent[i]) for i, g in enumerate(got[:-1]))
    assert decode_header(eng.get(key(3))).seq == seqs[3]


def test_reput_of_a_present_key_is_a_noop(eng):
    first = eng.put(block(1))
    assert eng.put(block(1)) == first
    assert eng.put_many([block(1), block(2)])[0] == first
    st = eng.statistics()
    assert (st.puts, st.blocks) == (2, 2)


def test_lookup_counts_leading_present_keys(eng):
    eng.put_many([block(i) for i in (0, 1, 2, 4)])
    chain = [key(i) for i in range(6)]
    assert eng.lookup(chain) == 3
    assert eng.lookup(chain[:2]) == 2
    assert eng.lookup([key(9)] + chain) == 0
    assert eng.lookup([]) == 0


def test_locate_many_and_get_many_placed(eng):
    b = block(7, 3000)
    seq = eng.put(b)
    loc = eng.locate_many([key(7), key(8)])
    assert loc[1] is None
    assert loc[0] == BlockLocation(loc[0].logical_offset, len(b), seq, sealed=False)
    eng.flush()
    assert eng.locate_many([key(7)])[0].sealed
    buf = bytearray(len(b) + 10)
    assert eng.get_many_placed([key(7)], [buf]) == [(0, len(b))]
    assert same_block(bytes(buf[:len(b)]), b)
    assert eng.get_many_placed([key(8)], [buf]) == [None]
    with pytest.raises(EngineError, match="too small"):
        eng.get_many_placed([key(7)], [bytearray(10)])


def test_block_info(eng):
    b = block(5, 1234, ns=b"\x07" * 16)
    seq = eng.put(b)
    info = eng.block_info(key(5))
    assert info["present"] and info["size_bytes"] == len(b) and info["seq"] == seq
    assert info["ns_id"] == "07" * 16 and info["codec_id"] == 1 and info["pinned"] is False
    eng.flush()
    assert eng.block_info(key(5))["sealed"] is True
    assert eng.block_info(key(6)) is None


def test_statistics_is_a_frozen_snapshot(eng):
    eng.put(block(1, 100))
    eng.get(key(1))
    eng.get(key(2))
    st = eng.statistics()
    assert isinstance(st, EngineStatistics)
    assert (st.blocks, st.hits, st.misses, st.puts) == (1, 1, 1, 1)
    assert st.bytes_stored == st.put_bytes == len(block(1, 100))
    with pytest.raises(Exception):
        st.blocks = 5
    eng.put(block(2, 100))
    assert st.blocks == 1


# -- bad input -------------------------------------------------------------
def test_bad_blocks_are_refused_with_a_clear_error_and_the_engine_keeps_working(eng):
    with pytest.raises(BlockFormatError, match="magic"):
        eng.put(b"x" * 100)
    with pytest.raises(BlockFormatError, match="shorter"):
        eng.put(b"KV")
    bad = bytearray(block(1))
    bad[-1] ^= 0xFF
    with pytest.raises(BlockFormatError, match="CRC"):
        eng.put(bytes(bad))
    with pytest.raises(BlockFormatError):  # a bad block in a batch stores none of it
        eng.put_many([block(2), bytes(bad)])
    assert eng.lookup([key(2)]) == 0
    with pytest.raises(ValueError, match="16 bytes"):
        eng.get(b"short")
    eng.put(block(3))
    assert same_block(eng.get(key(3)), block(3))


def test_a_block_larger_than_a_region_names_both_sizes(eng):
    huge = block(1, REGION)
    with pytest.raises(EngineError, match=rf"{len(huge)} bytes.*{eng.block_size_max_bytes} bytes"):
        eng.put(huge)
    biggest = block(2, eng.block_size_max_bytes - 64)
    eng.put(biggest)
    assert same_block(eng.get(key(2)), biggest)


def test_closed_engine_refuses_calls(eng):
    eng.close()
    eng.close()
    with pytest.raises(EngineError, match="closed"):
        eng.put(block(1))


# -- eviction order ----------------------------------------------------------
def fill(engine, ids):
    for i in ids:
        engine.put(block(i, PAYLOAD_5_PER_REGION))


def test_fifo_evicts_whole_regions_oldest_first():
    engine, _, _ = mem_engine(regions=4, eviction="fifo")
    fill(engine, range(15))  # regions 0..2 hold 0-4, 5-9, 10-14; region 3 is the clean reserve
    assert present(engine, range(15)) == list(range(15))
    fill(engine, [15])  # region 0 reclaimed into the pool, the writer takes region 3
    assert present(engine, range(16)) == list(range(5, 16))
    engine.get(key(5))  # reads do not matter to FIFO
    fill(engine, range(16, 21))
    assert present(engine, range(21)) == list(range(10, 21))
    st = engine.statistics()
    assert (st.evicted_regions, st.evicted_blocks) == (2, 10)
    engine.close()


def test_lru_evicts_the_least_recently_read_region():
    engine, _, _ = mem_engine(regions=4, eviction="lru")
    fill(engine, range(16))  # nothing read: region 0 (sealed first) reclaimed for block 15
    assert present(engine, range(16)) == list(range(5, 16))
    engine.get(key(7))  # region 1 becomes the most recently used sealed region
    fill(engine, range(16, 21))  # block 20 needs a region: region 2 reclaimed, not 1
    assert present(engine, range(21)) == list(range(5, 10)) + list(range(15, 21))
    fill(engine, range(21, 26))  # region 3 sealed after region 1 was read: region 1 goes now
    assert present(engine, range(26)) == list(range(15, 26))
    engine.close()


def test_pinned_blocks_survive_eviction_by_reinsertion():
    engine, _, _ = mem_engine(regions=4)
    fill(engine, range(15))
    assert engine.pin_many([key(1), key(3), key(99)]) == [True, True, False]
    old_seq = engine.block_info(key(1))["seq"]
    fill(engine, [15])  # region 0 reclaimed: 1 and 3 compacted into the reserve, which the writer then fills
    assert present(engine, range(5)) == [1, 3]
    assert engine.statistics().reinsertions == 2
    info = engine.block_info(key(1))
    assert info["pinned"] and info["seq"] > old_seq and info["region"] == 3
    assert engine.block_info(key(15))["region"] == 3
    assert same_block(engine.get(key(1)), block(1, PAYLOAD_5_PER_REGION))
    fill(engine, range(21, 60))  # many more cycles: the pins stay
    assert engine.lookup([key(1)]) == 1 and engine.lookup([key(3)]) == 1
    assert engine.unpin_many([key(1), key(3)]) == [True, True]
    fill(engine, range(60, 100))
    assert present(engine, [1, 3]) == []
    engine.close()


def test_no_space_error_when_every_region_is_pinned():
    engine, _, _ = mem_engine(regions=4, pinned_fraction_max=1.0)  # the default limit refuses these pins
    fill(engine, range(15))
    engine.pin_many([key(i) for i in range(15)])
    with pytest.raises(NoSpaceError, match="pinned"):
        fill(engine, [15])
    assert engine.statistics().alloc_failures == 1
    assert present(engine, range(15)) == list(range(15))  # nothing lost
    engine.unpin_many([key(i) for i in range(5, 10)])
    fill(engine, range(15, 20))  # region 1 (unpinned now) is reclaimed: 15-19 go to the region it frees
    assert present(engine, range(20)) == [0, 1, 2, 3, 4] + list(range(10, 20))
    engine.close()


def test_full_store_under_pressure_serves_exact_blocks_or_misses():
    engine, _, _ = mem_engine(regions=5)
    rng = np.random.default_rng(0)
    sizes = {}
    for i in range(400):
        sizes[i] = int(rng.integers(1, 120_000))
        engine.put(block(i, sizes[i]), durable=bool(i % 37 == 0))
        if i % 5 == 0:
            j = int(rng.integers(0, i + 1))
            got = engine.get(key(j))
            assert got is None or same_block(got, block(j, sizes[j]))
    live = present(engine, range(400))
    assert 0 < len(live) < 400
    assert all(same_block(engine.get(key(i)), block(i, sizes[i])) for i in live)
    st = engine.statistics()
    assert st.blocks == len(live) and st.bytes_stored == sum(len(block(i, sizes[i])) for i in live)
    assert st.puts == 400 and st.evicted_blocks == 400 - len(live) and st.corrupt_reads == 0
    engine.close()


# -- delete ----------------------------------------------------------------
def test_delete_namespace_and_delete_all(eng):
    ns_a, ns_b = b"a" * 16, b"b" * 16
    eng.put_many([block(i, 300, ns=ns_a) for i in range(10)])
    eng.flush()
    eng.put_many([block(i, 300, ns=ns_b) for i in range(10, 15)] + [block(i, 300, ns=ns_a) for i in range(15, 18)])
    assert eng.delete_many([key(0), key(0), key(50)]) == [True, True, False]
    assert eng.delete_namespace(ns_a) == 12
    assert present(eng, range(18)) == list(range(10, 15))
    with pytest.raises(EngineError, match="16 bytes"):
        eng.delete_namespace(b"x")
    assert eng.delete_all() == 5
    assert eng.statistics().blocks == 0 and eng.lookup([key(10)]) == 0
    eng.put(block(1))
    assert same_block(eng.get(key(1)), block(1))


# -- real files ------------------------------------------------------------
def test_files_striped_over_four_devices(tmp_path):
    cfg = EngineConfig(device_paths=tuple(str(tmp_path / f"d{i}.img") for i in range(4)),
                       device_size_bytes=8 * MiB, stripe_size_bytes=256 * 1024, region_size_bytes=2 * MiB)
    with pytest.raises(EngineError, match="missing"):
        Engine.open(cfg)
    with Engine.open(cfg, create_if_missing=True) as engine:
        assert [p.stat().st_size for p in sorted(tmp_path.iterdir())] == [8 * MiB] * 4
        assert engine.geometry.device_ids and len(engine.geometry.device_ids) == 4
        sent = [block(i, 300_000 + i) for i in range(20)]
        engine.put_many(sent)
        got = engine.get_many([key(i) for i in range(20)])
        assert all(same_block(g, s) for g, s in zip(got, sent))


def test_concurrent_puts_and_gets_from_threads(tmp_path):
    cfg = EngineConfig(device_paths=(str(tmp_path / "a"), str(tmp_path / "b")), device_size_bytes=10 * MiB,
                       stripe_size_bytes=256 * 1024, region_size_bytes=MiB)
    engine = Engine.open(cfg, create_if_missing=True)
    errors = []

    def worker(t: int) -> None:
        try:
            for i in range(t * 1000, t * 1000 + 60):
                b = block(i, 20_000)
                engine.put(b)
                got = engine.get(key(i))
                if got is not None and not same_block(got, b):
                    errors.append(i)
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = engine.statistics()
    assert st.puts == 240 and st.corrupt_reads == 0
    engine.close()


def test_the_same_key_twice_in_one_batch_is_stored_once(eng):
    seqs = eng.put_many([block(1), block(2), block(1)])
    assert seqs[0] == seqs[2] != seqs[1]
    assert eng.statistics().blocks == 2


def test_blocks_being_sealed_are_served_from_memory_and_then_from_flash():
    engine, _, devs = mem_engine(regions=4)
    fill(engine, range(6))  # region 0 full and handed to the sealer; block 5 opened region 1
    got = engine.get_many([key(i) for i in range(6)])
    assert all(same_block(g, block(i, PAYLOAD_5_PER_REGION)) for i, g in enumerate(got))
    engine.flush()  # region 1 is written in place, not sealed: its blocks are on flash all the same
    assert engine.statistics().regions_sealed == 1
    assert all(engine.locate_many([key(i)])[0].sealed for i in range(6))
    engine.close()


def test_reads_racing_reclaims_return_exact_blocks_or_misses():
    engine, _, _ = mem_engine(regions=4)
    stop = threading.Event()
    bad: list = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            ids = rng.integers(0, 300, 4).tolist()
            try:
                for i, got in zip(ids, engine.get_many([key(i) for i in ids])):
                    if got is not None and not same_block(got, block(i, 90_000)):
                        bad.append(i)
            except Exception as exc:  # reported by the assertion below
                bad.append(exc)

    readers = [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    for t in readers:
        t.start()
    try:
        for i in range(300):
            engine.put(block(i, 90_000))
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert bad == []
    st = engine.statistics()
    assert st.evicted_regions > 10 and st.corrupt_reads == 0
    engine.close()


@pytest.mark.root
def test_engine_on_loop_block_devices(tmp_path):
    import subprocess
    loops = []
    try:
        for i in range(2):
            backing = tmp_path / f"loop{i}.img"
            with open(backing, "wb") as f:
                f.truncate(4 * MiB)
            out = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True,
                                 timeout=10)
            if out.returncode != 0:
                pytest.skip(f"losetup failed (needs root): {out.stderr.strip()}")
            loops.append(out.stdout.strip())
        cfg = EngineConfig(device_paths=tuple(loops), stripe_size_bytes=256 * 1024, region_size_bytes=MiB)
        with pytest.raises(EngineError, match="no device holds a kvtier store"):
            Engine.open(cfg, create_if_missing=False)
        Engine.format(cfg)
        with Engine.open(cfg) as engine:
            engine.put_many([block(i, 100_000) for i in range(12)], durable=True)
        with Engine.open(cfg) as engine:
            assert all(same_block(engine.get(key(i)), block(i, 100_000)) for i in range(12))
    finally:
        for loop in loops:
            subprocess.run(["losetup", "-d", loop], timeout=10)


def test_only_durability_promises_fdatasync():
    engine, _, devs = mem_engine(regions=6)
    base = [d.syncs for d in devs]
    fill(engine, range(16))  # three regions sealed, buffered puts only
    assert [d.syncs for d in devs] == base
    engine.put(block(100, 500), durable=True)  # seals and headers written before: every device synced
    after_durable = [d.syncs for d in devs]
    assert all(a > b for a, b in zip(after_durable, base))
    engine.put(block(101, 500), durable=True)  # nothing else pending: only the device written
    assert sum(d.syncs for d in devs) == sum(after_durable) + 1
    engine.flush()
    assert all(a > b for a, b in zip([d.syncs for d in devs], after_durable))
    engine.close()


# -- concurrency ---------------------------------------------------------------
class GatedWrites(MemoryDevice):
    """Writes wait for ``gate`` once ``armed``: a seal stuck on a slow device."""

    def __init__(self, size_bytes: int, name: str):
        super().__init__(size_bytes, name)
        self.armed, self.gate, self.waiting = False, threading.Event(), threading.Event()

    def _write(self, offset, buffers, total):
        if self.armed:
            self.waiting.set()
            assert self.gate.wait(30), "the test never opened the gate"
        super()._write(offset, buffers, total)


def test_a_put_waiting_for_a_slow_seal_does_not_hold_up_reads_and_lookups():
    """The spare image is free only once the seal in flight is written; a put that needs it
    waits for that write without the engine lock, so readers of other blocks go on."""
    cfg = EngineConfig(device_paths=("g0",), stripe_size_bytes=REGION // 2, region_size_bytes=REGION)
    dev = GatedWrites(DATA_OFFSET_BYTES + 8 * REGION, "g0")
    Engine.format(cfg, devices=[dev])
    engine = Engine.open(cfg, devices=[dev])
    try:
        for i in range(5):  # region 0 fills (its header written)
            engine.put(block(i, PAYLOAD_5_PER_REGION))
        dev.armed = True
        for i in range(5, 10):  # region 0 goes to the sealer, which gets stuck; region 1 fills
            engine.put(block(i, PAYLOAD_5_PER_REGION))
        assert dev.waiting.wait(5)
        blocked = threading.Thread(target=engine.put, args=(block(10, PAYLOAD_5_PER_REGION),))
        blocked.start()
        blocked.join(0.3)
        assert blocked.is_alive(), "the put needing a new region should wait for the seal"
        answers = []
        reader = threading.Thread(target=lambda: answers.extend([engine.lookup([key(i) for i in range(10)]),
                                                                 engine.get(key(7))]))
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "a LOOKUP and a GET waited behind a put waiting for flash"
        assert answers[0] == 10 and same_block(answers[1], block(7, PAYLOAD_5_PER_REGION))
        dev.gate.set()
        blocked.join(10)
        assert not blocked.is_alive() and same_block(engine.get(key(10)), block(10, PAYLOAD_5_PER_REGION))
    finally:
        dev.gate.set()
        engine.close()
