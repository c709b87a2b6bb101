"""Crash safety of sequence numbers and of region reclaim:

* erased blocks (delete_all, a forced format) never come back after a crash in a
  region reused later, whatever their seqs (the superblock's seq floor);
* a crash -- a dropped or torn write -- at every device write of a reclaim loses no
  pinned block and no tombstone or pin record carried out of the reclaimed region;
* a device error while reading a pinned block aborts that reclaim (never a drop).
"""
from __future__ import annotations

import pytest

from kvtier.daemon.engine import DeviceError, Engine, EngineConfig, NoSpaceError
from kvtier.daemon.engine.devices import FaultyDevice, MemoryDevice
from kvtier.daemon.engine.store import read_superblocks, write_generation
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

from test_engine import PAYLOAD_5_PER_REGION, REGION, block, fill, key, mem_engine, present, same_block

ALIGNED_PAYLOAD = 102_400 - 64  # header + payload = 25 pages: blocks of two uses of a region line up
SEQS_PAST_31_BITS = 3_000_000_000


def reopen(cfg, devs):
    """Open the store on the same devices, as a restarted process would (the old engine is abandoned)."""
    return Engine.open(cfg, devices=[d.inner if isinstance(d, FaultyDevice) else d for d in devs])


def restart_n_times(engine, cfg, devs, n):
    """Each restart skips SEQ_RESTART_GAP seqs: a store that has run a while has large seqs."""
    for i in range(n):
        engine.put(block(10_000 + i, 100))
        engine.close()
        engine = reopen(cfg, devs)
    return engine


def erase_then_crash_in_the_reused_region(engine, cfg, devs, erase):
    """Old aligned blocks, erased; then a few durable puts into the same region and a crash."""
    old = range(9)
    for i in old:
        engine.put(block(i, ALIGNED_PAYLOAD))
    engine.flush()
    old_seq_max = max(engine.block_info(key(i))["seq"] for i in old)
    erase(engine)
    engine = reopen(cfg, devs)
    assert present(engine, old) == []
    for i in range(100, 103):
        engine.put(block(i, ALIGNED_PAYLOAD), durable=True)
    engine = reopen(cfg, devs)  # crashed: never closed
    assert present(engine, old) == [], "erased blocks were served again"
    assert present(engine, range(100, 103)) == [100, 101, 102]
    assert engine.put(block(200, 100)) > old_seq_max
    return engine, old_seq_max


def delete_all_and_close(engine):
    engine.delete_all()
    engine.close()


# -- 1. seq floor --------------------------------------------------------------
def test_delete_all_then_a_crash_in_a_reused_region_never_serves_erased_blocks():
    engine, cfg, devs = mem_engine(regions=4, devices=1)
    engine = restart_n_times(engine, cfg, devs, 3)  # old seqs > the gap a fresh generation would start at
    engine, old_seq_max = erase_then_crash_in_the_reused_region(engine, cfg, devs, delete_all_and_close)
    floors = {sb.seq_floor for sb in read_superblocks(devs)}
    assert len(floors) == 1 and floors.pop() > old_seq_max
    engine.close()


def test_erased_seqs_past_31_bits_neither_resurface_nor_stop_recovery():
    engine, cfg, devs = mem_engine(regions=4, devices=1)
    engine._next_seq = SEQS_PAST_31_BITS  # a store that has taken 3e9 seqs (too slow to reach with puts)
    engine, _ = erase_then_crash_in_the_reused_region(engine, cfg, devs, delete_all_and_close)
    engine.close()


def test_a_store_without_a_seq_floor_starts_above_every_region_header_it_finds():
    """Superblocks written before the floor existed read as floor 0: old region headers bound the seqs."""
    engine, cfg, devs = mem_engine(regions=4, devices=1)
    engine._next_seq = SEQS_PAST_31_BITS

    def delete_all_without_floor(eng):
        eng.delete_all()
        eng.close()
        sbs = read_superblocks(devs)
        write_generation(devs, sbs, sbs[0].generation, 0)

    engine, _ = erase_then_crash_in_the_reused_region(engine, cfg, devs, delete_all_without_floor)
    engine.close()


def test_forced_format_carries_the_old_stores_seqs_over():
    engine, cfg, devs = mem_engine(regions=4, devices=1)
    engine._next_seq = SEQS_PAST_31_BITS

    def format_over(eng):
        eng.close()
        Engine.format(cfg, force=True, devices=devs)

    engine, old_seq_max = erase_then_crash_in_the_reused_region(engine, cfg, devs, format_over)
    assert read_superblocks(devs)[0].seq_floor >= old_seq_max
    engine.close()


def test_a_crash_during_delete_all_is_finished_with_the_floor_at_open():
    engine, cfg, devs = mem_engine(regions=4, devices=2)
    engine.put_many([block(i, 1000) for i in range(10)])
    engine.flush()
    before = read_superblocks(devs)
    engine.delete_all()
    after = read_superblocks(devs)
    write_generation(devs[1:], before[1:], before[1].generation, before[1].seq_floor)  # device 1 never got it
    engine = reopen(cfg, devs)
    assert engine.statistics().blocks == 0
    assert [(sb.generation, sb.seq_floor) for sb in read_superblocks(devs)] == \
        [(after[0].generation, after[0].seq_floor)] * 2
    engine.close()


# -- 2. a crash at every write of a reclaim --------------------------------------
class CrashAt(FaultyDevice):
    """Writes pass until write number ``n`` (0-based): that one is dropped, or torn (its first
    half lands), and every later write fails -- the process died there."""

    def __init__(self, inner, n: int | None = None, torn: bool = False):
        super().__init__(inner)
        self.n, self.torn = n, torn

    def _write(self, offset, buffers, total):
        if self.n is not None:
            done = self.statistics().writes
            if done == self.n and self.torn:
                self.arm_torn_write(total // 2)
            elif done >= self.n:
                self.fail_writes = True
        try:
            super()._write(offset, buffers, total)
        finally:
            if self.n is not None and self.statistics().writes > self.n:
                self.fail_writes = True


def reclaim_scenario(pinned_in_victim):
    """LRU, four regions. Region 0 ends up holding blocks 20-24, a tombstone for 7 (region 1)
    and a pin record for 12 (region 2) -- both still needed when region 0 is reclaimed -- and,
    optionally, a pinned block of its own. Returns the engine just before the put that reclaims
    region 0 (the open region, 3, is full)."""
    cfg = EngineConfig(device_paths=("mem0",), stripe_size_bytes=REGION // 2, region_size_bytes=REGION,
                       eviction="lru")
    devs = [CrashAt(MemoryDevice(DATA_OFFSET_BYTES + 4 * REGION, "mem0"))]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(20))  # regions 0..3
    fill(engine, [20])  # region 0 reclaimed: it holds 20
    assert engine.delete_many([key(7)]) == [True]
    assert engine.pin_many([key(12)]) == [True]
    fill(engine, range(21, 25))
    if pinned_in_victim is not None:
        assert engine.pin_many([key(pinned_in_victim)]) == [True]
    touch_regions_1_and_2(engine)
    fill(engine, range(25, 30))  # region 3 reclaimed: it holds 25-29
    touch_regions_1_and_2(engine)  # LRU order now: 0, 1, 2 -- region 0 is the next victim
    assert present(engine, range(30)) == [i for i in range(5, 15) if i != 7] + list(range(20, 30))
    return engine, cfg, devs


def touch_regions_1_and_2(engine):
    assert all(engine.get(key(i)) for i in (5, 12))


def check_after_crash(engine, pinned_in_victim):
    assert engine.lookup([key(7)]) == 0, "a carried tombstone was lost: a deleted block came back"
    assert engine.block_info(key(12))["pinned"], "a carried pin record was lost"
    if pinned_in_victim is not None:
        info = engine.block_info(key(pinned_in_victim))
        assert info is not None and info["pinned"], "a pinned block was lost by a reclaim"
        assert same_block(engine.get(key(pinned_in_victim)), block(pinned_in_victim, PAYLOAD_5_PER_REGION))
    for i in range(31):
        got = engine.get(key(i))
        assert got is None or same_block(got, block(i, PAYLOAD_5_PER_REGION)), i


@pytest.mark.parametrize("pinned_in_victim,path", [
    (None, "records into the open region"),
    (22, "in place: its new place misses its old one"),
    (20, "staged in another region: its new place overlaps its old one"),
])
def test_a_crash_at_any_write_of_a_reclaim_keeps_pinned_blocks_and_carried_records(pinned_in_victim, path):
    engine, cfg, devs = reclaim_scenario(pinned_in_victim)
    writes_before = devs[0].statistics().writes
    fill(engine, [30])  # the reclaim of region 0
    engine.flush()
    writes = devs[0].statistics().writes - writes_before
    assert present(engine, range(20, 25)) == ([] if pinned_in_victim is None else [pinned_in_victim])
    check_after_crash(engine, pinned_in_victim)
    assert engine.block_info(key(30)) is not None
    check_after_crash(reopen(cfg, devs), pinned_in_victim)
    for torn in (False, True):
        for n in range(writes):
            engine, cfg, devs = reclaim_scenario(pinned_in_victim)
            devs[0].n, devs[0].torn = devs[0].statistics().writes + n, torn
            try:
                fill(engine, [30])
                engine.flush()
            except DeviceError:
                pass
            check_after_crash(reopen(cfg, devs), pinned_in_victim)


# -- 3. read errors during reclaim -------------------------------------------------
def test_an_unreadable_pinned_block_aborts_its_reclaim_and_another_region_is_taken():
    _, cfg, mem = mem_engine(regions=4)
    devs = [FaultyDevice(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(20))
    engine.pin_many([key(2)])
    for d in devs:
        d.fail_reads = True
    fill(engine, [20])  # region 0's pinned block cannot be read: region 1 is reclaimed instead
    for d in devs:
        d.fail_reads = False
    assert present(engine, range(21)) == list(range(5)) + list(range(10, 21))
    assert engine.block_info(key(2))["pinned"] and engine.statistics().device_errors >= 1
    assert same_block(engine.get(key(2)), block(2, PAYLOAD_5_PER_REGION))
    engine.close()


def test_no_space_error_names_unreadable_pinned_blocks_and_nothing_is_lost():
    _, cfg, mem = mem_engine(regions=4)
    devs = [FaultyDevice(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(20))
    engine.pin_many([key(i) for i in (2, 7, 12, 17)])  # one pinned block in every region
    for d in devs:
        d.fail_reads = True
    with pytest.raises(NoSpaceError, match="unreadable"):
        fill(engine, [20])
    for d in devs:
        d.fail_reads = False
    assert present(engine, range(20)) == list(range(20))
    fill(engine, [20])  # the device is back: region 0 is reclaimed, its pinned block moved
    assert present(engine, range(21)) == [2] + list(range(5, 21))
    assert engine.block_info(key(2))["pinned"] and engine.block_info(key(2))["region"] == 0
    engine.close()


def test_a_corrupt_pinned_block_is_dropped_at_reclaim():
    engine, cfg, mem = mem_engine(regions=4, devices=1)
    fill(engine, range(20))
    engine.pin_many([key(1), key(2)])
    loc = engine.locate_many([key(2)])[0]
    dev, off, _ = engine.geometry.map_range(loc.logical_offset + 5000, 1)[0]
    mem[dev].data[off] ^= 0x5A  # a flipped payload byte
    fill(engine, [20])
    assert present(engine, range(5)) == [1]
    assert engine.block_info(key(1))["pinned"] and engine.statistics().corrupt_reads == 1
    engine.close()


def test_a_summary_entry_outside_its_regions_seq_span_is_dropped_not_asserted():
    from kvtier.daemon.engine.devices import aligned_buffer
    from kvtier.daemon.engine.recovery import read_region_entries, write_summary

    engine, cfg, devs = mem_engine(regions=4, devices=1)
    engine.put_many([block(i, 1000) for i in range(5)])
    engine.flush()
    region, base_seq = 0, int(engine._table.base_seq[0])
    entries = read_region_entries(engine._array, region, REGION, base_seq)
    entries["seq"][2] = base_seq + (1 << 31) + 5  # a CRC-valid summary whose entry the index could not hold
    image = aligned_buffer(REGION)
    engine._array.read(0, image)
    write_summary(engine._array, image, region, engine._generation, entries, base_seq,
                  int(engine._table.data_end[0]))
    engine = reopen(cfg, devs)
    assert present(engine, range(5)) == [0, 1, 3, 4]
    assert all(same_block(engine.get(key(i)), block(i, 1000)) for i in (0, 1, 3, 4))
    engine.close()


def staging_scenario():
    """FIFO, four regions. Region 0 holds 0-4 with 0 pinned (its new place would overlap its old
    one: it is staged in region 1); region 1 holds a tombstone for 1 (in region 0), which must
    survive region 1's reset while region 0 is still readable by recovery."""
    cfg = EngineConfig(device_paths=("mem0",), stripe_size_bytes=REGION // 2, region_size_bytes=REGION,
                       eviction="fifo")
    devs = [CrashAt(MemoryDevice(DATA_OFFSET_BYTES + 4 * REGION, "mem0"))]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(5))
    assert engine.pin_many([key(0)]) == [True]
    fill(engine, range(5, 10))
    assert engine.delete_many([key(1)]) == [True]
    fill(engine, range(10, 20))
    return engine, cfg, devs


def check_after_staging_crash(engine):
    assert engine.lookup([key(1)]) == 0, "a deleted block came back"
    info = engine.block_info(key(0))
    assert info is not None and info["pinned"], "a pinned block was lost by a reclaim"
    for i in range(21):
        got = engine.get(key(i))
        assert got is None or same_block(got, block(i, PAYLOAD_5_PER_REGION)), i


def test_a_crash_while_staging_keeps_the_staging_regions_tombstones_for_the_victim():
    engine, cfg, devs = staging_scenario()
    writes_before = devs[0].statistics().writes
    fill(engine, [20])
    engine.flush()
    writes = devs[0].statistics().writes - writes_before
    assert present(engine, range(10)) == [0]  # regions 0 and 1 reclaimed: 0 moved, staged in region 1
    assert engine.block_info(key(0))["region"] == 0
    check_after_staging_crash(reopen(cfg, devs))
    for torn in (False, True):
        for n in range(writes):
            engine, cfg, devs = staging_scenario()
            devs[0].n, devs[0].torn = devs[0].statistics().writes + n, torn
            try:
                fill(engine, [20])
                engine.flush()
            except DeviceError:
                pass
            check_after_staging_crash(reopen(cfg, devs))
