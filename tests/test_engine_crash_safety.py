"""Crash safety of sequence numbers and of region reclaim:

* erased blocks (delete_all, a forced format) never come back after a crash in a
  region reused later, whatever their seqs (the superblock's seq floor);
* a crash -- a dropped or torn write -- at every device write of a reclaim loses no
  pinned block and no tombstone or pin record carried out of the reclaimed region;
* a device error while reading a pinned block aborts that reclaim (never a drop).
"""
from __future__ import annotations

import itertools

import pytest

from kvtier.daemon.engine import DeviceError, Engine, EngineConfig, NoSpaceError
from kvtier.daemon.engine.devices import FaultyDevice, MemoryDevice
from kvtier.daemon.engine.regions import RegionState
from kvtier.daemon.engine.store import read_superblocks, write_generation
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

from test_engine import PAYLOAD_5_PER_REGION, REGION, block, fill, key, mem_engine, present, same_block, seal

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
    seal(engine)
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
    engine, cfg, devs = mem_engine(regions=5, devices=1)
    engine = restart_n_times(engine, cfg, devs, 3)  # old seqs > the gap a fresh generation would start at
    engine, old_seq_max = erase_then_crash_in_the_reused_region(engine, cfg, devs, delete_all_and_close)
    floors = {sb.seq_floor for sb in read_superblocks(devs)}
    assert len(floors) == 1 and floors.pop() > old_seq_max
    engine.close()


def test_erased_seqs_past_31_bits_neither_resurface_nor_stop_recovery():
    engine, cfg, devs = mem_engine(regions=5, devices=1)
    engine._seqs.next = SEQS_PAST_31_BITS  # a store that has taken 3e9 seqs (too slow to reach with puts)
    engine, _ = erase_then_crash_in_the_reused_region(engine, cfg, devs, delete_all_and_close)
    engine.close()


def test_a_store_without_a_seq_floor_starts_above_every_region_header_it_finds():
    """Superblocks written before the floor existed read as floor 0: old region headers bound the seqs."""
    engine, cfg, devs = mem_engine(regions=5, devices=1)
    engine._seqs.next = SEQS_PAST_31_BITS

    def delete_all_without_floor(eng):
        eng.delete_all()
        eng.close()
        sbs = read_superblocks(devs)
        write_generation(devs, sbs, sbs[0].generation, 0)

    engine, _ = erase_then_crash_in_the_reused_region(engine, cfg, devs, delete_all_without_floor)
    engine.close()


def test_forced_format_carries_the_old_stores_seqs_over():
    engine, cfg, devs = mem_engine(regions=5, devices=1)
    engine._seqs.next = SEQS_PAST_31_BITS

    def format_over(eng):
        eng.close()
        Engine.format(cfg, force=True, devices=devs)

    engine, old_seq_max = erase_then_crash_in_the_reused_region(engine, cfg, devs, format_over)
    assert read_superblocks(devs)[0].seq_floor >= old_seq_max
    engine.close()


def test_a_crash_during_delete_all_is_finished_with_the_floor_at_open():
    engine, cfg, devs = mem_engine(regions=5, devices=2)
    engine.put_many([block(i, 1000) for i in range(10)])
    seal(engine)
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


def reclaim_scenario(pinned_in_victim, wrap=None):
    """LRU, four regions. Region 0 ends up holding blocks 20-24, a tombstone for 7 (region 1)
    and a pin record for 12 (region 2) -- both still needed when region 0 is reclaimed -- and,
    optionally, a pinned block of its own. Returns the engine just before the put that reclaims
    region 0 (the open region, 3, is full)."""
    cfg = EngineConfig(device_paths=("mem0",), stripe_size_bytes=REGION // 2, region_size_bytes=REGION,
                       eviction="lru")
    devs = [(wrap or CrashAt)(MemoryDevice(DATA_OFFSET_BYTES + 5 * REGION, "mem0"))]
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
    seal(engine)
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
                seal(engine)
            except (DeviceError, NoSpaceError):  # the worker's reclaim failed on the dead device
                pass
            check_after_crash(reopen(cfg, devs), pinned_in_victim)


# -- 3. read errors during reclaim -------------------------------------------------
class UnreadableBlocks(FaultyDevice):
    """Reads that touch the device ranges in ``bad`` fail (the blocks there cannot be read back)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.bad: list[tuple[int, int]] = []

    def _read(self, offset, buffers, total):
        if any(offset < end and offset + total > start for start, end in self.bad):
            raise self._fault("read")
        super()._read(offset, buffers, total)


def make_unreadable(engine, devs, ids) -> None:
    """The device ranges of these blocks fail every read from now on (``[]``: they read again)."""
    for d in devs:
        d.bad = []
    for i in ids:
        loc = engine.locate_many([key(i)])[0]
        for dev, dev_off, length in engine.geometry.map_range(loc.logical_offset, loc.length):
            devs[dev].bad.append((dev_off, dev_off + length))


def test_an_unreadable_pinned_block_aborts_its_reclaim_and_another_region_is_taken():
    _, cfg, mem = mem_engine(regions=5)
    devs = [UnreadableBlocks(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(20))
    engine.pin_many([key(2)])
    make_unreadable(engine, devs, [2])
    fill(engine, [20])  # region 0's pinned block cannot be read: region 1 is reclaimed instead
    make_unreadable(engine, devs, [])
    assert present(engine, range(21)) == list(range(5)) + list(range(10, 21))
    assert engine.block_info(key(2))["pinned"] and engine.statistics().device_errors >= 1
    assert engine.statistics().reclaim_errors == 1 and engine.statistics().regions_retired == 0
    assert same_block(engine.get(key(2)), block(2, PAYLOAD_5_PER_REGION))
    engine.close()


def test_no_space_error_names_unreadable_pinned_blocks_and_nothing_is_lost():
    _, cfg, mem = mem_engine(regions=5)
    devs = [UnreadableBlocks(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(20))
    pinned = (2, 7, 12, 17)  # one pinned block in every region
    engine.pin_many([key(i) for i in pinned])
    make_unreadable(engine, devs, pinned)
    with pytest.raises(NoSpaceError, match="unreadable"):
        fill(engine, [20])
    make_unreadable(engine, devs, [])
    assert present(engine, range(20)) == list(range(20))
    fill(engine, [20])  # the device is back: region 0 is reclaimed, its pinned block moved
    assert present(engine, range(21)) == [2] + list(range(5, 21))
    assert engine.block_info(key(2))["pinned"] and engine.block_info(key(2))["region"] == 4  # the reserve
    engine.close()


def test_a_region_whose_reclaim_keeps_failing_is_retired_visibly(caplog):
    _, cfg, mem = mem_engine(regions=5)
    devs = [UnreadableBlocks(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(20))
    engine.pin_many([key(2)])
    make_unreadable(engine, devs, [2])
    fill(engine, [20])  # the first failure: region 0 back in the policy (its newest), region 1 reclaimed
    i = 21
    while engine.statistics().regions_retired == 0 and i < 60:  # region 0 comes round again: retired
        engine.put(block(i, PAYLOAD_5_PER_REGION))
        i += 1
    st = engine.statistics()
    assert (st.reclaim_errors, st.regions_retired) == (2, 1)
    assert "event=region_retired region=0" in caplog.text
    make_unreadable(engine, devs, [])
    assert engine.block_info(key(2))["region"] == 0 and engine.block_info(key(2))["pinned"]  # still served
    for j in range(i, i + 30):
        engine.put(block(j, PAYLOAD_5_PER_REGION))
    assert engine.block_info(key(2))["region"] == 0, "a retired region was reused"
    engine.close()


def test_a_corrupt_pinned_block_is_dropped_at_reclaim():
    engine, cfg, mem = mem_engine(regions=5, devices=1)
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
    from kvtier.common.aligned import aligned_buffer
    from kvtier.daemon.engine.recovery import read_region_entries, write_summary

    engine, cfg, devs = mem_engine(regions=5, devices=1)
    engine.put_many([block(i, 1000) for i in range(5)])
    seal(engine)
    region, base_seq = 0, int(engine._table.base_seq[0])
    entries = read_region_entries(engine._array, region, REGION, base_seq)
    entries["seq"][2] = base_seq + (1 << 31) + 5  # a CRC-valid summary whose entry the index could not hold
    image = aligned_buffer(REGION)
    engine._array.read(0, image)
    write_summary(engine._array, image, region, engine._allocator.generation, entries, base_seq,
                  int(engine._table.data_end[0]))
    engine = reopen(cfg, devs)
    assert present(engine, range(5)) == [0, 1, 3, 4]
    assert all(same_block(engine.get(key(i)), block(i, 1000)) for i in (0, 1, 3, 4))
    engine.close()


def staging_scenario(wrap=None):
    """FIFO, four regions. Region 0 holds 0-4 with 0 pinned (its new place would overlap its old
    one: it is staged in region 1); region 1 holds a tombstone for 1 (in region 0), which must
    survive region 1's reset while region 0 is still readable by recovery."""
    cfg = EngineConfig(device_paths=("mem0",), stripe_size_bytes=REGION // 2, region_size_bytes=REGION,
                       eviction="fifo")
    devs = [(wrap or CrashAt)(MemoryDevice(DATA_OFFSET_BYTES + 5 * REGION, "mem0"))]
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


def test_a_crash_while_compacting_keeps_the_tombstones_for_the_victim():
    engine, cfg, devs = staging_scenario()
    writes_before = devs[0].statistics().writes
    fill(engine, [20])
    seal(engine)
    writes = devs[0].statistics().writes - writes_before
    assert present(engine, range(10)) == [0, 5, 6, 7, 8, 9]  # region 0 reclaimed: 0 moved into the reserve
    assert engine.block_info(key(0))["region"] == 4
    check_after_staging_crash(reopen(cfg, devs))
    for torn in (False, True):
        for n in range(writes):
            engine, cfg, devs = staging_scenario()
            devs[0].n, devs[0].torn = devs[0].statistics().writes + n, torn
            try:
                fill(engine, [20])
                seal(engine)
            except (DeviceError, NoSpaceError):  # the worker's reclaim failed on the dead device
                pass
            check_after_staging_crash(reopen(cfg, devs))


# -- 4. every crash state: any subset of the writes not yet synced -----------------
class WriteLog(FaultyDevice):
    """Records every write and sync, so that every state a crash can leave is rebuilt afterwards:
    what was synced, plus any subset of the writes issued since (a device may reorder them), one
    of them possibly torn (its first half landed)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.start = bytes(inner.data)
        self.events: list = []

    def _write(self, offset, buffers, total):
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        with self._lock:
            self.events.append((offset, data))
        super()._write(offset, buffers, total)

    def sync(self) -> None:
        with self._lock:
            self.events.append(None)
        super().sync()

    def crash_states(self):
        """(label, MemoryDevice) for a crash after each write: the synced writes, plus every subset
        of the unsynced ones (each also with one of them torn, while they are few)."""
        writes = [i for i, e in enumerate(self.events) if e is not None]
        for n in range(len(writes) + 1):
            cut = writes[n - 1] + 1 if n else 0
            synced = max([i for i in range(cut) if self.events[i] is None], default=-1)
            durable = [e for e in self.events[:synced + 1] if e is not None]
            pending = [e for e in self.events[synced + 1:cut] if e is not None]
            for landed in itertools.product((False, True), repeat=len(pending)):
                torn_choices = [None] + ([i for i, ok in enumerate(landed) if not ok] if len(pending) <= 4 else [])
                for torn in torn_choices:
                    mem = MemoryDevice(self.inner.size_bytes, self.inner.name)
                    mem.data[:] = self.start
                    for offset, data in durable + [p for p, ok in zip(pending, landed) if ok]:
                        mem.data[offset:offset + len(data)] = data
                    if torn is not None:
                        offset, data = pending[torn]
                        half = len(data) // 2 // 512 * 512
                        mem.data[offset:offset + half] = data[:half]
                    yield f"after write {n}, landed {landed}, torn {torn}", mem


def record_from_here(devs):
    """Start recording on the store's one WriteLog device (its current contents are the base)."""
    log = devs[0]
    log.start, log.events = bytes(log.inner.data), []
    return log


def check_every_crash_state(log, cfg, check):
    states = 0
    for label, mem in log.crash_states():
        engine = Engine.open(cfg, devices=[mem])
        try:
            check(engine, label)
        finally:
            engine.close()
        states += 1
    return states


def one_device_store(regions=5, eviction="fifo", region=REGION, **kw):
    cfg = EngineConfig(device_paths=("mem0",), stripe_size_bytes=region // 2, region_size_bytes=region,
                       eviction=eviction, **kw)
    devs = [WriteLog(MemoryDevice(DATA_OFFSET_BYTES + regions * region, "mem0"))]
    Engine.format(cfg, devices=devs)
    return Engine.open(cfg, devices=devs), cfg, devs


@pytest.mark.slow  # walks every crash state
def test_every_crash_state_of_an_in_place_reclaim_after_a_restart_keeps_its_pinned_block():
    """The victim's header and its summary pages must not be in flight together: a crash could
    land the summary (a zeroed trailer) alone, and recovery would scan the old header's region as
    open from its old base_seq, stop before the new copies (their seqs are past its span after a
    restart) and never find the pinned block."""
    engine, cfg, devs = one_device_store()
    fill(engine, range(15))
    assert engine.pin_many([key(7)]) == [True]
    fill(engine, range(15, 19))
    engine.close()
    engine = Engine.open(cfg, devices=devs)  # restarted: seqs jump by SEQ_RESTART_GAP
    fill(engine, range(19, 24))  # region 0 reclaimed (no pins)
    before = engine.block_info(key(7))
    assert before["region"] == 1
    log = record_from_here(devs)
    fill(engine, range(24, 30))  # region 1 reclaimed: 7 is moved
    seal(engine)
    after = engine.block_info(key(7))
    assert after["region"] != 1 and after["seq"] > before["seq"] and after["pinned"]

    def check(engine, label):
        info = engine.block_info(key(7))
        assert info is not None and info["pinned"], f"the pinned block was lost ({label})"
        assert same_block(engine.get(key(7)), block(7, PAYLOAD_5_PER_REGION)), label
        for i in range(25):
            got = engine.get(key(i))
            assert got is None or same_block(got, block(i, PAYLOAD_5_PER_REGION)), (i, label)

    assert check_every_crash_state(log, cfg, check) > len([e for e in log.events if e])


def test_every_crash_state_of_reusing_a_region_keeps_its_deleted_blocks_deleted():
    """A reclaimed region's new header alone must invalidate what it held: a zeroed last page
    written beside it could land without it, and the old header's region, scanned as open, served
    again the blocks deleted by tombstones that lived in that page."""
    engine, cfg, devs = one_device_store()
    fill(engine, range(4))
    assert engine.delete_many([key(1)]) == [True]  # a durable tombstone in region 0 itself
    fill(engine, range(4, 20))
    log = record_from_here(devs)
    fill(engine, range(20, 26))  # region 0 reclaimed (nothing carried), filled and sealed; region 1 next

    def check(engine, label):
        assert engine.lookup([key(1)]) == 0, f"a deleted block came back ({label})"
        for i in range(26):
            got = engine.get(key(i))
            assert got is None or same_block(got, block(i, PAYLOAD_5_PER_REGION)), (i, label)

    assert check_every_crash_state(log, cfg, check) > len([e for e in log.events if e])


@pytest.mark.parametrize("delete", [True, False], ids=["durable entries", "seal only"])
@pytest.mark.slow  # walks every crash state
def test_every_crash_state_of_a_reused_regions_first_writes_keeps_its_deleted_blocks_deleted(delete):
    """The new header of a reused region is not synced when written (buffered puts never sync):
    until it is, neither summary entries made durable (a delete) nor the seal's summary and trailer
    may leave recovery the old header above them -- scanned as open from the old base_seq, the
    old blocks would come back without the tombstones of the old summary."""
    small = 150_000  # 6 blocks leave a gap before the summary: the seal writes two ranges
    engine, cfg, devs = one_device_store()
    fill(engine, range(4))
    assert engine.delete_many([key(1)]) == [True]  # a durable tombstone in region 0 itself
    fill(engine, range(4, 20))
    log = record_from_here(devs)
    engine.put(block(100, small))  # region 0 reclaimed (nothing carried): its new header, not synced
    if delete:
        assert engine.delete_many([key(100)]) == [True]  # summary entries made durable in region 0
    for i in range(101, 108):
        engine.put(block(i, small))  # region 0 sealed (two ranges) while region 1's header is written

    def check(engine, label):
        assert engine.lookup([key(1)]) == 0, f"a deleted block came back ({label})"
        for i in list(range(20)) + list(range(100, 108)):
            got = engine.get(key(i))
            assert got is None or same_block(got, block(i, PAYLOAD_5_PER_REGION if i < 20 else small)), (i, label)

    assert check_every_crash_state(log, cfg, check) > len([e for e in log.events if e])


# -- 5. tombstones outlive every older copy; seq spans; bad summary entries ----------
def test_a_tombstone_outlives_an_older_copy_a_crash_left_in_another_region():
    """A kill between moving a pinned block out of its region (durable) and rewriting that region's
    header leaves both copies on flash; recovery serves the newer. Once deleted, its tombstone must
    stay while the region with the older copy lives -- not only while the newer copy's does."""
    payload = 100_000
    cfg = EngineConfig(device_paths=("mem0",), stripe_size_bytes=REGION // 2, region_size_bytes=REGION,
                       eviction="lru")
    mem = MemoryDevice(DATA_OFFSET_BYTES + 5 * REGION, "mem0")
    Engine.format(cfg, devices=[mem])
    engine = Engine.open(cfg, devices=[mem])
    put = lambda ids: engine.put_many([block(i, payload) for i in ids])  # noqa: E731
    put(range(10))
    assert engine.pin_many([key(3)]) == [True]
    put(range(10, 20))
    put(range(20, 30))
    put(range(30, 35))
    assert engine.block_info(key(3))["region"] == 0

    engine.put(block(99, 600_000))  # region 0 reclaimed: 3 moved to the open region, synced; region 0
    # is left as it was on flash until it is opened again -- a crash now leaves both copies there
    engine = Engine.open(cfg, devices=[mem])
    assert engine.block_info(key(3))["region"] != 0 and engine.block_info(key(3))["pinned"]  # the newer copy
    touch = lambda: [engine.get(key(i)) for i in (15, 25, 5)]  # noqa: E731 -- region 0 most recently used
    touch()
    assert engine.delete_many([key(3)]) == [True]
    n = 1000
    for _ in range(60):  # the newer copy's region, then the tombstone's, are reclaimed, twice
        touch()
        put([n])
        n += 1
    engine.close()
    engine = Engine.open(cfg, devices=[mem])
    assert engine.lookup([key(3)]) == 0, "a deleted block came back from an older copy"
    engine.close()


def test_carried_tombstones_stay_in_their_regions_seq_span_across_a_clean_close():
    """An in-place reclaim carrying many records: the open region's seq span must hold only its
    own entries (seqs taken for the victim's copies in between pushed its newest entries -- the
    carried tombstones -- past seq_span_max, where recovery drops them)."""
    region = 64 * 1024
    cfg = EngineConfig(device_paths=("mem0",), stripe_size_bytes=region // 2, region_size_bytes=region,
                       eviction="lru", reinsertion_hits_min=1)
    mem = MemoryDevice(DATA_OFFSET_BYTES + 5 * region, "mem0")
    Engine.format(cfg, devices=[mem])
    engine = Engine.open(cfg, devices=[mem])
    tiny = lambda i: block(i, 16)  # noqa: E731
    b, a_cold, a_hot, c, d = range(0, 400), range(1000, 1130), range(2000, 2070), range(3000, 3400), range(4000, 4400)
    engine.put_many([tiny(i) for i in b])
    seal(engine)
    engine.put_many([tiny(i) for i in a_cold])
    engine.put_many([tiny(i) for i in a_hot])
    deleted_b = list(range(20))
    assert all(engine.delete_many([key(i) for i in deleted_b]))  # tombstones in region 1 (A's)
    seal(engine)
    for ids in (c, d):
        engine.put_many([tiny(i) for i in ids])
        seal(engine)
    for i in a_hot:
        assert engine.get(key(i)) is not None
    for ids in (b, c, d):
        assert engine.get(key(ids[-1])) is not None
    doomed = [key(i) for i in list(c) + list(d) + list(b[20:])][:936]  # the open region: nearly all records
    engine.delete_many(doomed)  # each deleted, or evicted by the reclaim that made room for the tombstones
    engine.put(block(9999, 2000))  # does not fit: region 1 (A) reclaimed, its hot blocks and records kept
    engine.close()
    engine = Engine.open(cfg, devices=[mem])
    assert [i for i in deleted_b if engine.lookup([key(i)]) == 1] == [], "carried tombstones were dropped"
    assert [k for k in doomed if engine.lookup([k]) == 1] == []
    assert all(engine.get(key(i)) is not None for i in a_hot)
    engine.close()


@pytest.mark.parametrize("field,value", [
    ("length", 0), ("length", 0xFFFFFFFF), ("length", 63), ("offset", 0), ("offset", REGION - 1000),
    ("length", REGION), ("kind", 9),
], ids=["length 0", "length 2**32-1", "shorter than a header", "offset in the header page",
        "past the data area", "longer than the region", "unknown kind"])
def test_a_summary_entry_outside_the_regions_data_area_is_dropped_not_asserted(field, value):
    from kvtier.common.aligned import aligned_buffer
    from kvtier.daemon.engine.recovery import read_region_entries, scan_regions, write_summary

    engine, cfg, devs = mem_engine(regions=5, devices=1)
    engine.put_many([block(i, 1000) for i in range(5)])
    seal(engine)
    base_seq = int(engine._table.base_seq[0])
    entries = read_region_entries(engine._array, 0, REGION, base_seq)
    entries[field][2] = value  # a CRC-valid summary with an entry no block can have
    image = aligned_buffer(REGION)
    engine._array.read(0, image)
    write_summary(engine._array, image, 0, engine._allocator.generation, entries, base_seq, int(engine._table.data_end[0]))
    scan = scan_regions(engine._array, 1, REGION, engine._allocator.generation)[0]
    assert (scan.kind, scan.dropped_entries, len(scan.entries)) == (RegionState.SEALED, 1, 4)
    engine = reopen(cfg, devs)
    assert present(engine, range(5)) == [0, 1, 3, 4]
    assert all(same_block(engine.get(key(i)), block(i, 1000)) for i in (0, 1, 3, 4))
    engine.close()


# -- 6. failures that must leave the engine as it was ---------------------------------
def test_a_failed_delete_all_changes_nothing_in_memory():
    """The new generation and seq floor are taken only once the superblocks hold them: a failed
    write must not leave the engine writing regions of a generation the store does not have."""
    _, cfg, mem = mem_engine(regions=5, devices=1)
    devs = [FaultyDevice(mem[0])]
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(3))
    seal(engine)
    generation, floor = engine._allocator.generation, engine._seq_floor
    devs[0].fail_writes = True
    with pytest.raises(DeviceError):
        engine.delete_all()
    devs[0].fail_writes = False
    assert (engine._allocator.generation, engine._seq_floor) == (generation, floor)
    engine.put(block(50, 1000), durable=True)
    engine = reopen(cfg, devs)  # killed
    assert present(engine, list(range(3)) + [50]) == [0, 1, 2, 50]
    assert same_block(engine.get(key(50)), block(50, 1000))
    engine.close()


def test_a_delete_all_that_fails_on_one_device_puts_the_others_superblocks_back():
    _, cfg, mem = mem_engine(regions=5, devices=2)
    devs = [FaultyDevice(d) for d in mem]
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(3))
    seal(engine)
    before = read_superblocks(mem)
    devs[1].writes_until_failure = 0  # device 0's superblock is rewritten, device 1's write fails
    with pytest.raises(DeviceError):
        engine.delete_all()
    assert devs[0].statistics().writes >= 2, "device 0's superblock was written, then put back"
    assert read_superblocks(mem) == before
    devs[1].writes_until_failure, devs[1].fail_writes = None, False
    engine.put(block(50, 1000), durable=True)
    engine = reopen(cfg, devs)  # killed
    assert present(engine, list(range(3)) + [50]) == [0, 1, 2, 50]
    engine.close()


def test_a_batch_put_stores_a_key_whose_block_a_reclaim_in_the_same_batch_evicted():
    engine, _, _ = mem_engine(regions=5, devices=1)
    fill(engine, range(20))  # regions 0..3 full: the next region is region 0, reclaimed
    seqs = engine.put_many([block(20, PAYLOAD_5_PER_REGION), block(0, PAYLOAD_5_PER_REGION)])
    assert engine.lookup([key(0)]) == 1, "found before the reclaim that evicted it: never stored"
    assert engine.block_info(key(0))["seq"] == seqs[1]
    assert present(engine, range(21)) == [0] + list(range(5, 21))
    engine.close()


class FailingDataReads(FaultyDevice):
    """Reads of the data area fail; the superblock reads."""

    def _read(self, offset, buffers, total):
        if offset >= DATA_OFFSET_BYTES:
            raise self._fault("read")
        super()._read(offset, buffers, total)


def test_a_forced_format_over_an_unreadable_or_partial_old_store_starts_far_above_its_floor():
    from kvtier.daemon.engine.store import UNSCANNED_SEQ_MARGIN

    engine, cfg, mem = mem_engine(regions=5, devices=1)
    fill(engine, range(3))
    engine.close()
    floor = read_superblocks(mem)[0].seq_floor
    Engine.format(cfg, force=True, devices=[FailingDataReads(mem[0])])  # its regions cannot be scanned
    assert read_superblocks(mem)[0].seq_floor == floor + UNSCANNED_SEQ_MARGIN
    engine = Engine.open(cfg, devices=mem)
    assert present(engine, range(3)) == []
    engine.close()

    cfg2 = EngineConfig(device_paths=("mem0", "mem1"), stripe_size_bytes=REGION // 4, region_size_bytes=REGION,
                        eviction="fifo")
    pair = [mem[0], MemoryDevice(mem[0].size_bytes, "mem1")]  # one device of the old store, one new
    floor = read_superblocks(mem)[0].seq_floor
    Engine.format(cfg2, force=True, devices=pair)
    assert read_superblocks(pair)[0].seq_floor == floor + UNSCANNED_SEQ_MARGIN


@pytest.mark.parametrize("pinned_in_victim", [None, 22, 20], ids=["records into the open region", "in place",
                                                                  "staged"])
@pytest.mark.slow  # walks every crash state
def test_every_crash_state_of_a_reclaim_keeps_pinned_blocks_and_carried_records(pinned_in_victim):
    """As the test above, but a crash may land any subset of the writes not yet synced."""
    engine, cfg, devs = reclaim_scenario(pinned_in_victim, wrap=WriteLog)
    log = record_from_here(devs)
    fill(engine, [30])  # the reclaim of region 0
    seal(engine)
    check_every_crash_state(log, cfg, lambda engine, label: check_after_crash(engine, pinned_in_victim))


def test_every_crash_state_while_staging_keeps_the_staging_regions_tombstones_for_the_victim():
    engine, cfg, devs = staging_scenario(wrap=WriteLog)
    log = record_from_here(devs)
    fill(engine, [20])
    seal(engine)
    check_every_crash_state(log, cfg, lambda engine, label: check_after_staging_crash(engine))


def test_a_seal_writes_its_trailer_page_after_every_other_write_of_the_seal():
    """A process killed mid-seal must not leave a trailer that says sealed over blocks never written
    (recovery trusts a sealed region's summary): the seal's writes run as one parallel batch over the
    devices, so the trailer's page is a batch of its own, issued once the others are done."""
    engine, _, _ = mem_engine(regions=6)
    fill(engine, range(3))  # part of the open region, in its image
    array = engine._allocator._array
    batches, write_ranges = [], array.write_ranges

    def recording(ranges):
        ranges = list(ranges)
        batches.append([(offset, view.nbytes) for offset, view in ranges])
        return write_ranges(ranges)

    array.write_ranges = recording
    region = engine.block_info(key(0))["region"]
    seal(engine)
    array.write_ranges = write_ranges
    end = (region + 1) * engine.region_size_bytes
    batches = [b for b in ([(o, n) for o, n in batch if end - engine.region_size_bytes <= o < end] for batch in batches)
               if b]  # this region's writes, batch by batch
    assert batches[-1] == [(end - 4096, 4096)], batches
    assert all(offset + nbytes <= end - 4096 for batch in batches[:-1] for offset, nbytes in batch), batches
    engine.close()
