"""Restart, crash (abandoned engine), torn writes, corruption, geometry
mismatches and fsck."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.common.blockformat import HEADER_SIZE
from kvtier.daemon.engine import DeviceError, Engine, EngineConfig, GeometryError
from kvtier.daemon.engine.devices import FaultyDevice, MemoryDevice
from kvtier.daemon.engine.fsck import check_store
from kvtier.daemon.engine.regions import RegionState
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

from test_engine import NS as NS_DEFAULT
from test_engine import PAYLOAD_5_PER_REGION, block, key, mem_engine, present, same_block, seal

MiB = 1 << 20


def reopen(cfg, devs):
    """Open the store on the same devices, as a restarted process would (the old engine is abandoned)."""
    return Engine.open(cfg, devices=[d.inner if isinstance(d, FaultyDevice) else d for d in devs])


def file_cfg(tmp_path, devices=2, size=8 * MiB, region=MiB, **kw):
    return EngineConfig(device_paths=tuple(str(tmp_path / f"d{i}.img") for i in range(devices)),
                        device_size_bytes=size, stripe_size_bytes=region // devices // 2, region_size_bytes=region, **kw)


def device_file_offset(engine, k: bytes, within: int) -> tuple[int, int]:
    """(device index, byte offset in its file) of byte ``within`` of a stored block."""
    loc = engine.locate_many([k])[0]
    dev, off, _ = engine.geometry.map_range(loc.logical_offset + within, 1)[0]
    return dev, off


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


# -- restart -----------------------------------------------------------------
def test_clean_restart_recovers_every_block():
    engine, cfg, devs = mem_engine(regions=6)
    sent = {i: block(i, 30_000 + i) for i in range(80)}
    seqs = engine.put_many(sent.values())
    engine.close()
    engine = reopen(cfg, devs)
    st = engine.statistics()
    assert st.recovered_blocks == st.blocks == 80 and st.recovery_seconds > 0
    assert all(same_block(engine.get(key(i)), b) for i, b in sent.items())
    assert [engine.block_info(key(i))["seq"] for i in range(80)] == seqs
    assert engine.put(block(1000)) > max(seqs)  # seqs keep increasing across restarts


def test_crash_keeps_durable_and_sealed_blocks_and_loses_only_unacknowledged_buffered_ones():
    engine, cfg, devs = mem_engine(regions=6)
    fill = [block(i, PAYLOAD_5_PER_REGION) for i in range(7)]  # region 0 sealed, 2 blocks in region 1
    engine.put_many(fill)
    engine.put(block(100, 500), durable=True)
    engine.put(block(101, 500))  # buffered only
    engine = reopen(cfg, devs)  # the first engine "crashed": never closed
    assert present(engine, list(range(7)) + [100, 101]) == [0, 1, 2, 3, 4, 5, 6, 100]
    assert same_block(engine.get(key(100)), block(100, 500))
    engine.close()
    assert present(reopen(cfg, devs), [100]) == [100]  # the open region found at recovery was sealed


def test_newest_seq_wins_and_deletes_pins_namespaces_last_after_flush():
    engine, cfg, devs = mem_engine(regions=6)
    engine.put_many([block(i, 1000) for i in range(10)])
    engine.put(block(20, 1000, ns=b"z" * 16))
    seal(engine)
    engine.delete_many([key(1), key(2)])
    engine.pin_many([key(3), key(4)])
    engine.unpin_many([key(4)])
    engine.delete_namespace(b"z" * 16)
    seal(engine)
    engine.put(block(2, 1000))  # re-put after delete: newer than the tombstone
    engine.put(block(20, 1000, ns=b"z" * 16))  # newer than the namespace tombstone
    seal(engine)
    engine = reopen(cfg, devs)
    assert present(engine, range(10)) == [0, 2, 3, 4, 5, 6, 7, 8, 9] and present(engine, [20]) == [20]
    assert engine.block_info(key(3))["pinned"] and not engine.block_info(key(4))["pinned"]


def test_pins_and_tombstones_are_carried_across_reclaims():
    engine, cfg, devs = mem_engine(regions=5)
    engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(5)])  # region 0
    engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(5, 8)])
    engine.pin_many([key(6)])
    engine.delete_many([key(7)])  # records land in region 1
    engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(8, 40)])  # cycles every region
    engine.close()
    engine = reopen(cfg, devs)
    assert engine.block_info(key(6))["pinned"] and engine.lookup([key(7)]) == 0


def test_delete_all_lasts_without_flush():
    engine, cfg, devs = mem_engine()
    engine.put_many([block(i) for i in range(10)])
    seal(engine)
    assert engine.delete_all() == 10
    engine = reopen(cfg, devs)
    assert engine.statistics().blocks == 0


# -- torn writes -------------------------------------------------------------
@pytest.mark.parametrize("keep_bytes", [0, 512, 4096, 70_000])
def test_torn_durable_write_never_serves_a_corrupt_block(keep_bytes):
    _, cfg, mem = mem_engine(regions=6)
    devs = [FaultyDevice(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    acked = {}
    for i in range(12):
        acked[i] = block(i, 40_000 + i)
        engine.put(acked[i], durable=True)
    for d in devs:
        d.arm_torn_write(keep_bytes)
    with pytest.raises(DeviceError, match="torn write"):
        engine.put(block(50, 90_000), durable=True)
    engine = reopen(cfg, devs)
    assert all(same_block(engine.get(key(i)), b) for i, b in acked.items())
    got = engine.get(key(50))
    assert got is None or same_block(got, block(50, 90_000))
    assert engine.statistics().corrupt_reads == 0


def test_torn_seal_keeps_durable_blocks():
    _, cfg, mem = mem_engine(regions=6)
    devs = [FaultyDevice(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(3)], durable=True)
    engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(3, 5)])
    devs[1].arm_torn_write(1000)  # the seal's write tears ...
    devs[1].writes_until_failure = 1  # ... and its retry fails: the process "dies" mid-seal
    with pytest.raises(DeviceError):
        seal(engine)
    engine = reopen(cfg, devs)
    assert present(engine, range(3)) == [0, 1, 2]
    assert all(engine.get(key(i)) is None or same_block(engine.get(key(i)), block(i, PAYLOAD_5_PER_REGION))
               for i in range(5))


def test_a_failed_background_seal_is_retried():
    _, cfg, mem = mem_engine(regions=6)
    devs = [FaultyDevice(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(5)])
    devs[0].arm_torn_write(4096)
    engine.put(block(5, PAYLOAD_5_PER_REGION))  # region 0 full: sealed in the background, tears, retried
    seal(engine)
    assert engine.statistics().device_errors == 1
    engine = reopen(cfg, devs)
    assert all(same_block(engine.get(key(i)), block(i, PAYLOAD_5_PER_REGION)) for i in range(6))


def test_device_read_errors_are_misses_counted_as_device_errors():
    _, cfg, mem = mem_engine(regions=4)
    devs = [FaultyDevice(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    engine.put(block(1, 5000))
    seal(engine)
    for d in devs:
        d.fail_reads = True
    assert engine.get(key(1)) is None
    assert engine.statistics().device_errors >= 1
    for d in devs:
        d.fail_reads = False
    assert same_block(engine.get(key(1)), block(1, 5000))


# -- corruption on real files -------------------------------------------------
def test_flipped_payload_byte_in_a_device_file_is_a_miss_never_data(tmp_path):
    cfg = file_cfg(tmp_path)
    engine = Engine.open(cfg, create_if_missing=True)
    engine.put_many([block(i, 50_000) for i in range(10)])
    seal(engine)
    dev, off = device_file_offset(engine, key(4), HEADER_SIZE + 1000)
    engine.close()
    flip_byte(cfg.device_paths[dev], off)
    engine = Engine.open(cfg)
    assert engine.lookup([key(4)]) == 1  # summaries are trusted; the block is checked when read
    assert engine.get(key(4)) is None
    st = engine.statistics()
    assert st.corrupt_reads == 1 and engine.lookup([key(4)]) == 0  # dropped
    assert all(same_block(engine.get(key(i)), block(i, 50_000)) for i in range(10) if i != 4)
    engine.close()


def test_flipped_summary_byte_falls_back_to_scanning_the_region(tmp_path):
    cfg = file_cfg(tmp_path)
    engine = Engine.open(cfg, create_if_missing=True)
    engine.put_many([block(i, 50_000) for i in range(10)])
    seal(engine)
    loc = engine.locate_many([key(0)])[0]
    region_end = (loc.logical_offset // cfg.region_size_bytes + 1) * cfg.region_size_bytes
    dev, off, _ = engine.geometry.map_range(region_end - 100, 1)[0]
    engine.close()
    flip_byte(cfg.device_paths[dev], off)
    engine = Engine.open(cfg)
    assert all(same_block(engine.get(key(i)), block(i, 50_000)) for i in range(10))
    engine.close()


def test_fsck_finds_and_repairs_a_corrupt_block(tmp_path):
    cfg = file_cfg(tmp_path)
    engine = Engine.open(cfg, create_if_missing=True)
    engine.put_many([block(i, 50_000) for i in range(10)])
    seal(engine)
    engine.put(block(10, 1000), durable=True)  # left in an open region
    dev, off = device_file_offset(engine, key(2), HEADER_SIZE + 10)
    region = engine.block_info(key(2))["region"]
    for device in engine._devices:  # crash: the process's fds (and device locks) go, nothing is sealed
        device.close()
    del engine
    flip_byte(cfg.device_paths[dev], off)
    report = check_store(cfg)
    assert not report.clean and report.blocks_bad == 1 and report.blocks_ok == 10
    assert [r.region for r in report.regions if r.entries_bad] == [region]
    assert any(r.state == RegionState.OPEN for r in report.regions)
    repaired = check_store(cfg, repair=True)
    assert region in repaired.repaired_regions
    after = check_store(cfg)
    assert after.clean and after.blocks_ok == 10
    engine = Engine.open(cfg)
    assert present(engine, range(11)) == [0, 1, 3, 4, 5, 6, 7, 8, 9, 10]
    engine.close()


# -- geometry ------------------------------------------------------------------
def test_format_refuses_an_existing_store_without_force(tmp_path):
    cfg = file_cfg(tmp_path)
    Engine.open(cfg, create_if_missing=True).close()
    with pytest.raises(GeometryError, match=r"d0.img already holds kvtier store .* force=True"):
        Engine.format(cfg)
    Engine.format(cfg, force=True)
    Engine.open(cfg).close()


def test_forced_format_forgets_the_old_store(tmp_path):
    cfg = file_cfg(tmp_path)
    with Engine.open(cfg, create_if_missing=True) as engine:
        engine.put(block(1))
    Engine.format(cfg, force=True)
    with Engine.open(cfg) as engine:
        assert engine.statistics().blocks == 0


def test_open_without_format_names_the_problem(tmp_path):
    cfg = file_cfg(tmp_path)
    with pytest.raises(GeometryError, match=r"d0.img is missing"):
        Engine.open(cfg)
    for p in cfg.device_paths:
        with open(p, "wb") as f:
            f.truncate(8 * MiB)
    with pytest.raises(GeometryError, match="no device holds a kvtier store"):
        Engine.open(cfg)


def test_missing_extra_reordered_resized_and_foreign_devices(tmp_path):
    cfg = file_cfg(tmp_path, devices=3, region=3 * 256 * 1024)
    Engine.open(cfg, create_if_missing=True).close()
    paths = cfg.device_paths

    missing = EngineConfig(device_paths=paths[:2], stripe_size_bytes=cfg.stripe_size_bytes,
                           region_size_bytes=2 * cfg.stripe_size_bytes)
    with pytest.raises(GeometryError, match=r"has 3 devices but 2 are configured.*missing device #2"):
        Engine.open(missing)
    with pytest.raises(GeometryError, match=r"d1.img is device #1 of the store but is configured as #0"):
        Engine.open(EngineConfig(device_paths=(paths[1], paths[0], paths[2]), stripe_size_bytes=cfg.stripe_size_bytes,
                                 region_size_bytes=cfg.region_size_bytes))
    extra = str(tmp_path / "extra.img")
    with open(extra, "wb") as f:
        f.truncate(8 * MiB)
    with pytest.raises(GeometryError, match=r"extra.img holds no superblock"):
        Engine.open(EngineConfig(device_paths=paths + (extra,), stripe_size_bytes=cfg.stripe_size_bytes,
                                 region_size_bytes=4 * cfg.stripe_size_bytes))
    (tmp_path / "other").mkdir()
    other = file_cfg(tmp_path / "other", devices=1, region=2 * cfg.stripe_size_bytes)
    Engine.open(other, create_if_missing=True).close()
    with pytest.raises(GeometryError, match=r"other/d0.img belongs to another store"):
        Engine.open(EngineConfig(device_paths=(paths[0], paths[1], other.device_paths[0]),
                                 stripe_size_bytes=cfg.stripe_size_bytes, region_size_bytes=cfg.region_size_bytes))
    with pytest.raises(GeometryError, match=r"d0.img was formatted with stripe_size_bytes"):
        Engine.open(EngineConfig(device_paths=paths, stripe_size_bytes=cfg.stripe_size_bytes // 2,
                                 region_size_bytes=cfg.region_size_bytes))
    os.truncate(paths[2], 9 * MiB)
    with pytest.raises(GeometryError, match=r"d2.img is 9437184 bytes but was formatted at 8388608 bytes"):
        Engine.open(cfg)
    os.truncate(paths[2], 8 * MiB)
    Engine.open(cfg).close()


def test_devices_too_small_for_two_regions(tmp_path):
    cfg = file_cfg(tmp_path, size=DATA_OFFSET_BYTES + MiB // 2)
    with pytest.raises(GeometryError, match=r"too small: the store needs 2 regions"):
        Engine.open(cfg, create_if_missing=True)


def test_memory_device_restart_with_faulty_wrapper_unwraps():
    _, cfg, mem = mem_engine()
    assert isinstance(reopen(cfg, [FaultyDevice(m) for m in mem]), Engine)
    assert all(isinstance(m, MemoryDevice) for m in mem)


def test_create_if_missing_never_formats_over_a_partly_present_store(tmp_path):
    cfg = file_cfg(tmp_path)
    with Engine.open(cfg, create_if_missing=True) as engine:
        engine.put(block(1), durable=True)
    os.remove(cfg.device_paths[1])  # a device went missing; a fresh file is created in its place
    with pytest.raises(GeometryError, match=r"d1.img holds no superblock"):
        Engine.open(cfg, create_if_missing=True)
    with pytest.raises(GeometryError, match="d0.img already holds"):
        Engine.format(cfg)


def test_recovery_keeps_the_newest_copy_of_a_reinserted_pinned_block():
    engine, cfg, devs = mem_engine(regions=4)
    engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(15)])  # regions 0-2, 3 the clean reserve
    engine.pin_many([key(2)])
    engine.put(block(15, PAYLOAD_5_PER_REGION))  # region 0 reclaimed, block 2 moved
    seq = engine.block_info(key(2))["seq"]
    engine.close()
    engine = reopen(cfg, devs)
    info = engine.block_info(key(2))
    assert info["seq"] == seq and info["pinned"]
    assert same_block(engine.get(key(2)), block(2, PAYLOAD_5_PER_REGION))


def test_a_key_put_deleted_and_put_again_in_one_region_recovers_the_last_copy():
    engine, cfg, devs = mem_engine(regions=4)
    engine.put(block(1, 100))
    engine.delete_many([key(1)])
    seq = engine.put(block(1, 100))
    engine.put(block(2, 100))
    engine.delete_many([key(2)])
    engine.close()
    engine = reopen(cfg, devs)
    assert engine.block_info(key(1))["seq"] == seq and engine.lookup([key(2)]) == 0
    assert same_block(engine.get(key(1)), block(1, 100))


def test_pins_and_deletes_outlive_a_crash_before_the_next_seal():
    engine, cfg, devs = mem_engine(regions=6)
    engine.put_many([block(i, 1000, ns=(b"q" * 16 if i >= 8 else NS_DEFAULT)) for i in range(10)])
    seal(engine)
    engine.pin_many([key(1), key(2)])
    engine.unpin_many([key(2)])
    engine.delete_many([key(3)])
    engine.delete_namespace(b"q" * 16)
    engine = reopen(cfg, devs)  # crashed: no flush, no close
    assert present(engine, range(10)) == [0, 1, 2, 4, 5, 6, 7]
    assert engine.block_info(key(1))["pinned"] and not engine.block_info(key(2))["pinned"]


def test_a_reinserted_pinned_block_stays_pinned_after_a_crash():
    engine, cfg, devs = mem_engine(regions=4)
    engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(15)])  # regions 0-2, 3 the clean reserve
    engine.pin_many([key(2)])
    engine.put(block(15, PAYLOAD_5_PER_REGION))  # region 0 reclaimed: block 2 moved into the open region
    seq = engine.block_info(key(2))["seq"]
    engine = reopen(cfg, devs)  # crashed before that region was sealed
    info = engine.block_info(key(2))
    assert info["seq"] == seq and info["pinned"]


def _apply_meta_reference(cols, ns, keep, pinned, meta):
    """The record rules one record at a time, oldest first (what recovery did before it was vectorized)."""
    from kvtier.daemon.engine import regionfmt as fmt

    keep, pinned = keep.copy(), pinned.copy()
    live = np.nonzero(keep)[0]
    key_pos = {(a, b): int(i) for a, b, i in zip(cols["k0"][live].tolist(), cols["k1"][live].tolist(), live)}
    seen: dict[int, int] = {}
    for rec in meta[np.argsort(meta["seq"], kind="stable")]:
        kind = int(rec["kind"])
        pos = key_pos.get((int(rec["k0"]), int(rec["k1"])))
        if pos is None:
            continue
        if kind == fmt.KIND_TOMBSTONE and int(cols["seq"][pos]) <= int(rec["target_seq"]):
            keep[pos] = False
        elif kind in (fmt.KIND_PIN, fmt.KIND_UNPIN) and int(cols["seq"][pos]) == int(rec["target_seq"]) \
                and int(rec["seq"]) >= seen.get(pos, -1):
            seen[pos] = int(rec["seq"])
            pinned[pos] = kind == fmt.KIND_PIN
    return keep, pinned


@pytest.mark.parametrize("seed", range(5))
def test_records_apply_as_they_would_one_at_a_time(seed):
    """Tombstones and pin/unpin records, vectorized, against the one-at-a-time rules: random blocks
    (some keys stored twice, some sharing k0), random records naming live, older and absent blocks."""
    from kvtier.daemon.engine import regionfmt as fmt
    from kvtier.daemon.engine.recovery import _apply_meta, _newest_per_key

    rng = np.random.default_rng(seed)
    n = 3000
    k0 = rng.integers(0, 400, n).astype(np.uint64)  # small range: many keys share k0
    k1 = rng.integers(0, 8, n).astype(np.uint64)
    seq = rng.permutation(n).astype(np.uint64) + 1
    cols = {"k0": k0, "k1": k1, "seq": seq}
    keep = _newest_per_key(k0, k1, seq)
    pinned = rng.random(n) < 0.2
    m = 4000
    meta = np.zeros(m, fmt.SUMMARY_DTYPE)
    pick = rng.integers(0, n, m)
    meta["k0"], meta["k1"] = k0[pick], k1[pick]
    meta["k1"][rng.random(m) < 0.1] += np.uint64(100)  # records for keys never stored
    meta["seq"] = rng.permutation(m).astype(np.uint64) + n + 1
    meta["target_seq"] = np.where(rng.random(m) < 0.7, seq[pick], rng.integers(1, n + 1, m)).astype(np.uint64)
    meta["kind"] = rng.choice([fmt.KIND_TOMBSTONE, fmt.KIND_PIN, fmt.KIND_UNPIN], m, p=[0.2, 0.5, 0.3])
    want_keep, want_pinned = _apply_meta_reference(cols, None, keep, pinned, meta)
    got_keep, got_pinned = _apply_meta(cols, None, keep.copy(), pinned.copy(), meta)
    assert np.array_equal(got_keep, want_keep)
    assert np.array_equal(got_pinned, want_pinned)
    assert want_keep.sum() < keep.sum() and (want_pinned != pinned).any()  # the records did something
