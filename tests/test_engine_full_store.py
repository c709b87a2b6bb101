"""A full store: the clean-region pool and its background reclaim, pins that cannot wedge it,
FLUSH without sealing, group commit, and readers that never wait for a writer's sync.

The findings of issue 14 are reproduced here as they were found (each failed before):
rounds of (durable 4 KiB put, pin, flush) on 2 x 256 MiB devices reached NO_SPACE at round 7;
seven flushes with one 4 KiB put between them evicted every durable block stored.
"""
from __future__ import annotations

import itertools
import threading

import pytest

from kvtier.daemon.engine import Engine, EngineConfig, EngineFailedError, NoSpaceError
from kvtier.daemon.engine.devices import MemoryDevice
from kvtier.daemon.engine.index import BlockIndex
from kvtier.daemon.engine.regionfmt import KIND_TOMBSTONE, keys_to_halves
from kvtier.daemon.engine.region_manager import RegionManager
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

from test_engine import MiB, block, key, present, same_block, seal
from test_engine_crash_safety import WriteLog

KiB = 1 << 10
SMALL_REGION = 64 * KiB
PAYLOAD_4K = 4096 - 64  # a 4 KiB block (header + payload)


def memory_store(regions: int, region: int = SMALL_REGION, devices: int = 1, wrap=None, **kw):
    cfg = EngineConfig(device_paths=tuple(f"mem{i}" for i in range(devices)),
                       stripe_size_bytes=region // devices // 2, region_size_bytes=region, **kw)
    devs = [MemoryDevice(DATA_OFFSET_BYTES + regions * region // devices, f"mem{i}") for i in range(devices)]
    if wrap is not None:
        devs = [wrap(d) for d in devs]
    Engine.format(cfg, devices=devs)
    return Engine.open(cfg, devices=devs), cfg, devs


def idle(engine) -> None:
    with engine._lock:
        assert engine._regions.wait_idle(10), "the reclaim worker did not settle"


# -- the findings --------------------------------------------------------------------
def test_durable_put_pin_flush_rounds_on_two_256_mib_devices_never_run_out_of_space(tmp_path):
    cfg = EngineConfig(device_paths=(str(tmp_path / "a.img"), str(tmp_path / "b.img")),
                       device_size_bytes=256 * MiB, region_size_bytes=64 * MiB)
    engine = Engine.open(cfg, create_if_missing=True)
    try:
        for i in range(40):
            engine.put(block(i, PAYLOAD_4K), durable=True)
            assert engine.pin_many([key(i)]) == [True]
            engine.flush()
        st = engine.statistics()
        assert (st.blocks, st.evicted_blocks, st.alloc_failures) == (40, 0, 0)
    finally:
        engine.close()
    with Engine.open(cfg) as engine:
        assert all(engine.block_info(key(i))["pinned"] for i in range(40))


def test_a_pinned_block_in_every_region_never_wedges_the_store():
    """Each round seals a region holding one pinned block: a reclaim must move the pins out
    (compaction into the open region, or the reserve) instead of refusing every PUT."""
    engine, cfg, devs = memory_store(regions=8, region=MiB, devices=2)
    for i in range(60):
        engine.put(block(i, PAYLOAD_4K), durable=True)
        assert engine.pin_many([key(i)]) == [True]
        seal(engine)
    st = engine.statistics()
    assert st.alloc_failures == 0 and st.blocks == 60 and st.evicted_regions > 8
    assert all(engine.block_info(key(i))["pinned"] for i in range(60))
    assert all(same_block(engine.get(key(i)), block(i, PAYLOAD_4K)) for i in range(60))
    engine = Engine.open(cfg, devices=devs)  # killed: never closed
    assert all(engine.block_info(key(i))["pinned"] for i in range(60))
    engine.close()


def test_flushes_seal_nothing_and_evict_nothing():
    engine, cfg, devs = memory_store(regions=8, region=MiB, devices=2)
    for i in range(50):
        engine.put(block(i, PAYLOAD_4K), durable=True)
        engine.flush()
    st = engine.statistics()
    assert (st.evicted_blocks, st.regions_sealed, st.blocks) == (0, 0, 50)
    assert all(loc.sealed for loc in engine.locate_many([key(i) for i in range(50)]))  # on flash all the same
    engine = Engine.open(cfg, devices=devs)  # killed: the walk of the open region finds them all
    assert present(engine, range(50)) == list(range(50))
    assert all(same_block(engine.get(key(i)), block(i, PAYLOAD_4K)) for i in range(50))
    engine.close()


# -- the pool --------------------------------------------------------------------
def test_puts_never_wait_while_the_worker_keeps_the_pool_filled():
    engine, _, _ = memory_store(regions=32, clean_regions_target=3)  # 32 regions: a pool of 3
    assert engine.statistics().clean_regions_target == 3
    reclaim_threads = set()
    reclaim = RegionManager._reclaim

    def spy(self, victim):
        reclaim_threads.add(threading.current_thread().name)
        return reclaim(self, victim)

    RegionManager._reclaim = spy
    try:
        n = 0
        for _ in range(100):  # 100 regions' worth: the store is filled three times over
            for _ in range(5):
                engine.put(block(n, 12_000))
                n += 1
            idle(engine)
    finally:
        RegionManager._reclaim = reclaim
    st = engine.statistics()
    assert st.evicted_regions > 60 and st.reclaims == st.evicted_regions
    assert st.clean_region_waits == 0, "a PUT waited while the pool was not empty"
    assert reclaim_threads == {"kvtier-reclaim"}, "a reclaim ran in a writer's thread"
    assert st.regions_free >= 3
    engine.close()


def test_a_put_waits_only_when_the_pool_is_empty_and_the_wait_is_counted():
    engine, _, _ = memory_store(regions=4)  # a small store: the pool is the reserve alone
    for i in range(40):
        engine.put(block(i, 12_000))
    st = engine.statistics()
    assert st.clean_region_waits > 0 and st.clean_region_wait_seconds > 0 and st.alloc_failures == 0
    engine.close()


def test_a_reclaim_reads_its_victims_summary_not_the_whole_index(monkeypatch):
    def no_scan(self, lo, hi):
        raise AssertionError("a reclaim scanned the whole index")

    engine, _, _ = memory_store(regions=8)
    monkeypatch.setattr(BlockIndex, "slots_in_range", no_scan)
    for i in range(200):
        engine.put(block(i, 12_000))
        if i % 17 == 0:
            engine.pin_many([key(i)])
    st = engine.statistics()
    assert st.evicted_regions > 10 and st.reinsertions > 0 and st.alloc_failures == 0
    engine.close()


# -- no reader waits for a writer's sync ---------------------------------------------
class HeldSyncs(MemoryDevice):
    """Syncs wait for ``release`` once ``held`` is set."""

    def __init__(self, size_bytes: int, name: str):
        super().__init__(size_bytes, name)
        self.held, self.release, self.waiting = False, threading.Event(), threading.Event()

    def sync(self) -> None:
        if self.held:
            self.waiting.set()
            assert self.release.wait(30), "the test never released the sync"
        super().sync()


@pytest.mark.parametrize("writer", ["durable put", "flush"])
def test_gets_and_lookups_do_not_wait_for_a_writers_sync(writer):
    cfg = EngineConfig(device_paths=("h0",), stripe_size_bytes=MiB // 2, region_size_bytes=MiB)
    dev = HeldSyncs(DATA_OFFSET_BYTES + 8 * MiB, "h0")
    Engine.format(cfg, devices=[dev])
    engine = Engine.open(cfg, devices=[dev])
    try:
        engine.put_many([block(i, 200_000) for i in range(6)])
        seal(engine)  # 0-4 sealed on flash, 5 in the open region
        dev.held = True
        act = (lambda: engine.put(block(99, 5000), durable=True)) if writer == "durable put" else engine.flush
        engine.put(block(98, 5000))
        blocked = threading.Thread(target=act)
        blocked.start()
        assert dev.waiting.wait(5)
        blocked.join(0.2)
        assert blocked.is_alive(), f"the {writer} should be waiting for its sync"
        answers = []
        reader = threading.Thread(target=lambda: answers.extend(
            [engine.lookup([key(i) for i in range(6)]), engine.get(key(2)), engine.get(key(5)),
             engine.put(block(97, 5000))]))
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), f"a GET, LOOKUP or buffered PUT waited behind a {writer}'s sync"
        assert answers[0] == 6 and same_block(answers[1], block(2, 200_000)) and same_block(answers[2], block(5, 200_000))
        dev.release.set()
        blocked.join(10)
        assert not blocked.is_alive()
    finally:
        dev.release.set()
        engine.close()


@pytest.mark.parametrize("writer", ["delete", "pin", "unpin", "delete_namespace"])
def test_gets_and_lookups_do_not_wait_for_a_deletes_or_pins_sync(writer):
    cfg = EngineConfig(device_paths=("h0",), stripe_size_bytes=MiB // 2, region_size_bytes=MiB,
                       pinned_fraction_max=1.0)
    dev = HeldSyncs(DATA_OFFSET_BYTES + 8 * MiB, "h0")
    Engine.format(cfg, devices=[dev])
    engine = Engine.open(cfg, devices=[dev])
    try:
        engine.put_many([block(i, 200_000) for i in range(6)])
        engine.pin_many([key(4)])
        seal(engine)  # 0-4 sealed on flash, 5 in the open region
        dev.held = True
        act = {"delete": lambda: engine.delete_many([key(1)]), "pin": lambda: engine.pin_many([key(3)]),
               "unpin": lambda: engine.unpin_many([key(4)]),
               "delete_namespace": lambda: engine.delete_namespace(bytes([0xEE] * 16))}[writer]
        results = []
        blocked = threading.Thread(target=lambda: results.append(act()))
        blocked.start()
        assert dev.waiting.wait(5)
        blocked.join(0.2)
        assert blocked.is_alive(), f"the {writer} should be waiting for its sync"
        answers = []
        reader = threading.Thread(target=lambda: answers.extend(
            [engine.lookup([key(i) for i in (0, 2, 3, 4, 5)]), engine.get(key(2)), engine.get(key(5)),
             engine.put(block(97, 5000))]))
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), f"a GET, LOOKUP or buffered PUT waited behind a {writer}'s sync"
        assert answers[0] == 5 and same_block(answers[1], block(2, 200_000)) and same_block(answers[2], block(5, 200_000))
        again = threading.Thread(target=lambda: results.append(act()))  # its change is there: it waits for it to last
        again.start()
        again.join(0.2)
        assert again.is_alive(), f"a second {writer} answered before the first one's records were durable"
        dev.release.set()
        blocked.join(10)
        again.join(10)
        assert not blocked.is_alive() and not again.is_alive() and len(results) == 2
        pinned = {i: (engine.block_info(key(i)) or {}).get("pinned") for i in (1, 3, 4)}
        assert pinned == {"delete": {1: None, 3: False, 4: True}, "pin": {1: False, 3: True, 4: True},
                          "unpin": {1: False, 3: False, 4: False},
                          "delete_namespace": {1: False, 3: False, 4: True}}[writer]
    finally:
        dev.release.set()
        engine.close()


# -- group commit ------------------------------------------------------------------
class SlowSyncs(MemoryDevice):
    def sync(self) -> None:
        threading.Event().wait(0.005)
        super().sync()


def test_one_sync_acknowledges_every_durable_put_waiting_on_it():
    cfg = EngineConfig(device_paths=("s0",), stripe_size_bytes=MiB // 2, region_size_bytes=MiB)
    dev = SlowSyncs(DATA_OFFSET_BYTES + 16 * MiB, "s0")
    Engine.format(cfg, devices=[dev])
    engine = Engine.open(cfg, devices=[dev])
    threads = [threading.Thread(target=lambda t=t: [engine.put(block(t * 100 + i, 3000), durable=True)
                                                     for i in range(25)]) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = engine.statistics()
    assert st.durable_commit_waiters == 200
    assert st.group_commits < 150, f"{st.group_commits} commits for 200 durable puts: no grouping"
    engine = Engine.open(cfg, devices=[dev])  # killed
    assert present(engine, [t * 100 + i for t in range(8) for i in range(25)]) == \
        [t * 100 + i for t in range(8) for i in range(25)]
    engine.close()


class AckLog(WriteLog):
    """A WriteLog that also records, in the same event stream, when each durable put returned."""

    def ack(self, i: int) -> None:
        with self._lock:
            self.events.append(("ack", i))

    def crash_states_with_acks(self):
        """(acked ids, MemoryDevice) after each write: what was synced, plus every subset of the
        writes issued since (a device may reorder them); the puts acknowledged by then."""
        writes = [i for i, e in enumerate(self.events) if e is not None and e[0] != "ack"]
        for n in range(len(writes) + 1):
            cut = writes[n - 1] + 1 if n else 0
            synced = max([i for i in range(cut) if self.events[i] is None], default=-1)
            durable = [e for e in self.events[:synced + 1] if e is not None and e[0] != "ack"]
            pending = [e for e in self.events[synced + 1:cut] if e is not None and e[0] != "ack"]
            acked = {e[1] for e in self.events[:cut] if e is not None and e[0] == "ack"}
            for landed in itertools.product((False, True), repeat=len(pending)):
                mem = MemoryDevice(self.inner.size_bytes, self.inner.name)
                mem.data[:] = self.start
                for offset, data in durable + [p for p, ok in zip(pending, landed) if ok]:
                    mem.data[offset:offset + len(data)] = data
                yield acked, mem


def test_every_crash_state_of_concurrent_durable_puts_keeps_every_acknowledged_one():
    engine, cfg, devs = memory_store(regions=6, wrap=AckLog)
    log = devs[0]
    log.start, log.events = bytes(log.inner.data), []

    def writer(t: int) -> None:
        for i in range(3):
            engine.put(block(t * 10 + i, 9000), durable=True)
            log.ack(t * 10 + i)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [t * 10 + i for t in range(3) for i in range(3)]
    states = 0
    for acked, mem in log.crash_states_with_acks():
        reopened = Engine.open(cfg, devices=[mem])
        try:
            assert acked <= set(present(reopened, ids)), f"acknowledged puts lost: {acked - set(present(reopened, ids))}"
            for i in ids:
                got = reopened.get(key(i))
                assert got is None or same_block(got, block(i, 9000)), i
        finally:
            reopened.close()
        states += 1
    assert states > 9


def test_every_crash_state_of_background_reclaims_keeps_pins_and_deletes():
    """16 regions (a pool of 2): the worker reclaims ahead of the writer, moving a pinned block
    out of every victim and carrying the tombstones that must outlive it."""
    engine, cfg, devs = memory_store(regions=16, wrap=WriteLog)
    n = 0
    for _ in range(14):  # every region: 4 blocks, one of them pinned, one deleted
        engine.put_many([block(n + j, 12_000) for j in range(4)])
        engine.pin_many([key(n)])
        engine.delete_many([key(n + 1)])
        n += 4
    idle(engine)
    log = devs[0]
    log.start, log.events = bytes(log.inner.data), []
    for _ in range(5):
        engine.put_many([block(n + j, 12_000) for j in range(4)])
        n += 4
    idle(engine)
    assert engine.statistics().reclaims >= 2
    pinned = list(range(0, 56, 4))
    deleted = list(range(1, 56, 4))
    assert all(engine.block_info(key(i))["pinned"] for i in pinned)

    def check(reopened, label):
        for i in pinned:
            info = reopened.block_info(key(i))
            assert info is not None and info["pinned"], f"pinned block {i} lost ({label})"
        assert present(reopened, deleted) == [], f"a deleted block came back ({label})"
        for i in range(n):
            got = reopened.get(key(i))
            assert got is None or same_block(got, block(i, 12_000)), (i, label)

    states = 0
    for label, mem in log.crash_states():
        reopened = Engine.open(cfg, devices=[mem])
        try:
            check(reopened, label)
        finally:
            reopened.close()
        states += 1
    assert states > 10


def test_a_failed_pin_limit_never_stops_puts():
    engine, _, _ = memory_store(regions=8, region=MiB, devices=2)
    for i in range(200):
        engine.put(block(i, PAYLOAD_4K * 8))
        try:
            engine.pin_many([key(i)])
        except NoSpaceError:
            pass  # the pinned-bytes limit: PINs are refused, PUTs never
    assert engine.statistics().alloc_failures == 0
    engine.close()


def test_a_freed_region_still_on_flash_keeps_the_tombstones_for_what_it_held():
    """A region the worker freed keeps its old contents on flash until it is opened again; a
    tombstone for a block it held must be carried while it is so, even when the block's newest
    copy and the tombstone's own region are reclaimed first."""
    engine, cfg, devs = memory_store(regions=8, region=MiB, devices=2)
    manager, table = engine._regions, engine._table
    engine.put_many([block(i, 200_000) for i in range(5)])  # region 0
    seal(engine)
    assert engine.delete_many([key(2)]) == [True]  # its tombstone in region 1
    seal(engine)
    with engine._lock:
        tombstones = [r for r in table.meta_records[1] if r[0] == KIND_TOMBSTONE]
        assert tombstones
        table.begin_reclaim(0)
        engine._blocks.forget(engine._index.find_many(*keys_to_halves([key(i) for i in (0, 1, 3, 4)])))
        table.release(0)  # freed: its contents still on flash
        assert table.stale_on_flash[0]
        assert manager._needed_records(1, {1}), "a tombstone for a block of a freed region was dropped"
        table.stale_on_flash[0] = False  # once rewritten, nothing on flash needs it
        assert manager._needed_records(1, {1}) == []
    engine.close()


def test_a_commit_never_writes_a_moved_pinned_block_before_the_entry_that_pins_it():
    """A block a reclaim moved into the open region, flagged pinned by its summary entry: any later
    commit -- even a durable PUT's, which asks for no entries -- writes the entries first. Else a
    crash could leave the moved copy on flash, newer than its old one, and not pinned."""
    from kvtier.common.blockformat import decode_header
    from test_engine import block, mem_engine

    engine, _, _ = mem_engine(regions=5, pinned_fraction_max=1.0)
    try:
        engine.put(block(2))  # an open region
        moved = block(1)
        with engine._lock:  # what RegionManager._move does for a pinned block
            engine._allocator.append_moved(memoryview(moved), decode_header(moved), pinned=True)
        image = engine._allocator.open
        assert image.flagged_entries > image.durable_entries
        engine._durability.commit()  # a durable PUT's commit: no entries asked for
        assert image.durable_entries >= image.flagged_entries
    finally:
        engine.close()


def test_a_bug_in_the_reclaim_worker_fails_the_engine_closed_and_no_writer_waits_for_it(monkeypatch):
    import kvtier.daemon.engine.region_manager as region_manager

    engine, _, _ = memory_store(regions=6)
    told = []
    engine.on_failure = told.append
    read_entries, crashed = region_manager.read_region_entries, []

    def crash_once(*args):
        if not crashed:
            crashed.append(args[1])
            raise RuntimeError("a bug in the reclaim")
        return read_entries(*args)
    monkeypatch.setattr(region_manager, "read_region_entries", crash_once)
    refused = None
    for i in range(120):
        try:
            engine.put(block(i, 12_000))
        except EngineFailedError as exc:  # the writer that waited on the crashed reclaim hears of it
            refused = i
            assert "RuntimeError in the reclaim worker: a bug in the reclaim" in str(exc)
            break
    assert crashed and refused is not None
    assert told == [engine.failure] and "a bug in the reclaim" in engine.failure
    with pytest.raises(EngineFailedError):  # every call from now on
        engine.put(block(500, 12_000))
    with pytest.raises(EngineFailedError):
        engine.get(key(0))
    engine.close()  # seals nothing: a restart recovers from flash
