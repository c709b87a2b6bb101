"""Every mutating engine call is all or nothing: an error means nothing changed -- in memory,
after a clean restart, and after a crash (the devices' bytes as the error left them).

The failures: a store with no room (the wedge of issue 14: one pinned block in every region;
a store full of pins) and device faults (FaultyDevice) in the writes and syncs that make a
change durable."""
from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from kvtier.common.blockformat import encode_block
from kvtier.daemon.engine import DeviceError, Engine, EngineConfig, EngineError, NoSpaceError
from kvtier.daemon.engine.devices import FaultyDevice, MemoryDevice
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

MiB = 1 << 20
NS = bytes(range(16))
OTHER_NS = b"\x05" * 16


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def block(i: int, size: int = 4096 - 64, ns: bytes = NS) -> bytes:
    return encode_block(key(i), ns, 1, np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes())


def snapshot(engine: Engine, ids) -> dict:
    """What a client can see of these keys: present, pinned."""
    out = {}
    for i in ids:
        info = engine.block_info(key(i))
        out[i] = None if info is None else bool(info["pinned"])
    return out


def crash_copy(devs) -> list[MemoryDevice]:
    """The devices' bytes now, as a crash would leave them (memory devices have no volatile cache)."""
    copies = []
    for dev in devs:
        inner = dev.inner if isinstance(dev, FaultyDevice) else dev
        copy = MemoryDevice(inner.size_bytes, inner.name)
        copy.data[:] = inner.data
        copies.append(copy)
    return copies


def check_after_restarts(engine, cfg, devs, ids, expected) -> None:
    """The state ``expected`` after a crash (reopened from the devices' bytes now) and after a
    clean close and reopen."""
    crashed = Engine.open(cfg, devices=crash_copy(devs))
    assert snapshot(crashed, ids) == expected, "after a crash"
    crashed.close()
    for dev in devs:
        if isinstance(dev, FaultyDevice):
            dev.fail_writes = dev.fail_syncs = False
            dev.writes_until_failure = None
    engine.close()
    reopened = Engine.open(cfg, devices=devs)
    assert snapshot(reopened, ids) == expected, "after a clean restart"
    reopened.close()


def attempt(engine, op, ids):
    """Run ``op``; on an error the visible state must be what it was before. Returns the error or None."""
    before = snapshot(engine, ids)
    try:
        op()
    except EngineError as exc:
        assert snapshot(engine, ids) == before, f"{exc!r} changed the store"
        return exc
    return None


# -- the wedge of issue 14: one pinned block in every region --------------------------
def test_wedge_rounds_every_failed_request_changed_nothing():
    """2 x 256 MiB devices, 64 MiB regions, rounds of (durable 4 KiB put, pin, flush). On the old
    code this wedged at round 7, and then a DELETE that answered NO_SPACE had already deleted in
    memory (lookup said absent) while a restart served the block again."""
    cfg = EngineConfig(device_paths=("m0", "m1"), region_size_bytes=64 * MiB)
    devs = [MemoryDevice(256 * MiB, f"m{i}") for i in range(2)]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    rounds, errors = 12, []
    ids = list(range(rounds)) + [100, 101]
    for r in range(rounds):
        for op in (lambda: engine.put(block(r), durable=True), lambda: engine.pin_many([key(r)]), engine.flush):
            exc = attempt(engine, op, ids)
            if exc is not None:
                assert isinstance(exc, NoSpaceError), exc
                errors.append(exc)
    stored = [i for i in ids if engine.lookup([key(i)])]
    assert stored, "nothing stored"
    victim = stored[0]
    exc = attempt(engine, lambda: engine.delete_many([key(victim)]), ids)
    if exc is None:
        assert engine.lookup([key(victim)]) == 0
    exc_unpin = attempt(engine, lambda: engine.unpin_many([key(stored[-1])]), ids)
    exc_batch = attempt(engine, lambda: engine.put_many([block(100), block(101)], durable=True), ids)
    exc_ns = attempt(engine, lambda: engine.delete_namespace(OTHER_NS), ids)
    assert all(e is None or isinstance(e, NoSpaceError) for e in (exc, exc_unpin, exc_batch, exc_ns))
    for e in errors + [e for e in (exc, exc_unpin, exc_batch, exc_ns) if e is not None]:
        assert str(e).count("no room to stage") <= 1 and len(str(e)) < 1000  # said once, not once per region
    check_after_restarts(engine, cfg, devs, ids, snapshot(engine, ids))


def wedged_store():
    cfg = EngineConfig(device_paths=("m0", "m1"), region_size_bytes=64 * MiB)
    devs = [MemoryDevice(256 * MiB, f"m{i}") for i in range(2)]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    for r in range(7):  # one pinned block in every region
        engine.put(block(r), durable=True)
        engine.pin_many([key(r)])
        engine.flush()
    return engine, cfg, devs


@pytest.mark.parametrize("op", ["delete", "unpin"])
def test_delete_or_unpin_after_the_wedge_rounds_succeeds_and_lasts(op):
    """The issue's wedge (one pinned block in every region) no longer wedges: pinned blocks are
    compacted, a durable put still succeeds, and a delete or unpin after it lasts across restarts."""
    engine, cfg, devs = wedged_store()
    ids = list(range(7))
    engine.put(block(50), durable=True)
    assert engine.lookup([key(50)]) == 1
    ids.append(50)
    if op == "delete":
        assert engine.delete_many([key(3)]) == [True]
        assert engine.lookup([key(3)]) == 0
    else:
        assert engine.unpin_many([key(3)]) == [True]
        assert engine.block_info(key(3)) is None or not engine.block_info(key(3))["pinned"]
    expected = snapshot(engine, ids)
    check_after_restarts(engine, cfg, devs, ids, expected)


# -- a store full of pins: no room for a record -------------------------------------
PAYLOAD_5_PER_REGION = 200_000  # 5 blocks fill one 1 MiB region (with room left for summary entries)


PINNED_IDS = list(range(14))  # 4 regions: 2 full of pins, 4 pinned blocks in the open one, 1 kept in reserve


def full_of_pins(devices=None):
    """A store of 4 regions of 1 MiB. The region manager keeps one clean in reserve (where a
    reclaim compacts moved blocks), so 3 hold data: 2 sealed ones full of pinned blocks and the
    open one with 4 pinned blocks and a small unpinned one."""
    cfg = EngineConfig(device_paths=("m0", "m1"), stripe_size_bytes=MiB // 4, region_size_bytes=MiB,
                       pinned_fraction_max=1.0)
    devs = devices or [MemoryDevice(DATA_OFFSET_BYTES + 2 * MiB, f"m{i}") for i in range(2)]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    assert engine.statistics().regions_total == 4
    for i in PINNED_IDS:
        engine.put(block(i, PAYLOAD_5_PER_REGION))
    engine.put(block(50, 1000))  # a small unpinned block in the open region
    assert engine.pin_many([key(i) for i in PINNED_IDS]) == [True] * len(PINNED_IDS)
    st = engine.statistics()
    assert st.regions_sealed == 2 and st.regions_free == 1 and st.evicted_blocks == 0, st
    return engine, cfg, devs


def fill_open_region_with_records(engine) -> None:
    """Pin records until the open region has no room for one more."""
    for _ in range(100_000):
        try:
            engine.unpin_many([key(PINNED_IDS[-1])])
            engine.pin_many([key(PINNED_IDS[-1])])
        except NoSpaceError:
            break
    else:
        raise AssertionError("the open region never filled up")


def test_put_batch_that_fails_midway_is_taken_back():
    engine, cfg, devs = full_of_pins()
    ids = PINNED_IDS + [50, 60, 61]
    # 60 fits the open region, 61 does not and no region can be reclaimed
    exc = attempt(engine, lambda: engine.put_many([block(60, 500), block(61, 300_000)], durable=True), ids)
    assert isinstance(exc, NoSpaceError)
    assert engine.lookup([key(60)]) == 0 and engine.get(key(60)) is None
    assert engine.put(block(62, 500), durable=True) > 0  # the room 60 took is free again
    expected = snapshot(engine, ids)
    assert expected[60] is None and expected[50] is False
    check_after_restarts(engine, cfg, devs, ids, expected)


def test_full_store_delete_pin_unpin_put_refused_with_nothing_changed():
    engine, cfg, devs = full_of_pins()
    fill_open_region_with_records(engine)
    ids = PINNED_IDS + [50, 60, 61]
    for op in (lambda: engine.delete_many([key(3), key(50)]),  # the known bug: deleted in memory, served after
               lambda: engine.unpin_many([key(4)]),
               lambda: engine.pin_many([key(50)]),
               lambda: engine.delete_namespace(OTHER_NS),  # nothing of it stored: frees nothing
               lambda: engine.put_many([block(60, 500), block(61, PAYLOAD_5_PER_REGION)])):
        assert isinstance(attempt(engine, op, ids), NoSpaceError)
    expected = snapshot(engine, ids)
    assert expected[3] is True and expected[50] is False and expected[60] is None
    got = engine.get(key(3))  # put back where it was after the delete's second try failed too
    assert got is not None and got[64:] == block(3, PAYLOAD_5_PER_REGION)[64:]
    check_after_restarts(engine, cfg, devs, ids, expected)


def test_delete_namespace_on_a_full_store_frees_its_regions_and_lasts():
    engine, cfg, devs = full_of_pins()
    fill_open_region_with_records(engine)
    ids = PINNED_IDS + [50]
    assert engine.delete_namespace(NS) == len(PINNED_IDS) + 1  # applied first, which lets reclaim find room for its record
    assert all(v is None for v in snapshot(engine, ids).values())
    assert engine.put(block(70), durable=True) > 0
    check_after_restarts(engine, cfg, devs, ids + [70], snapshot(engine, ids + [70]))


# -- device faults while making a change durable -------------------------------------
def faulty_engine():
    cfg = EngineConfig(device_paths=("m0", "m1"), stripe_size_bytes=MiB // 4, region_size_bytes=MiB)
    devs = [FaultyDevice(MemoryDevice(DATA_OFFSET_BYTES + 4 * MiB, f"m{i}")) for i in range(2)]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    for i in range(8):
        engine.put(block(i, 20_000), durable=True)
    engine.pin_many([key(1)])
    return engine, cfg, devs


OPS = {
    "delete": lambda e: e.delete_many([key(2), key(3)]),
    "pin": lambda e: e.pin_many([key(4)]),
    "unpin": lambda e: e.unpin_many([key(1)]),
    "delete_namespace": lambda e: e.delete_namespace(NS),
    "durable_put": lambda e: e.put_many([block(20, 3000), block(21, 3000)], durable=True),
}


@pytest.mark.parametrize("fault", ["write", "sync"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_device_fault_changes_nothing_in_memory_or_after_restart(name, fault):
    """A durable put whose group commit fails (outside the lock) may have left its bytes on flash:
    its blocks leave the index and their tombstones are written at once, which a memory device
    keeps -- so a crash right after serves nothing of it. On real drives a failed fdatasync
    leaves that write's fate unknown: until a later commit succeeds, a crash may bring the
    blocks back (docs/operations.md; the next test covers the later commit)."""
    engine, cfg, devs = faulty_engine()
    ids = list(range(8)) + [20, 21]
    for dev in devs:
        setattr(dev, "fail_writes" if fault == "write" else "fail_syncs", True)
    exc = attempt(engine, lambda: OPS[name](engine), ids)
    assert isinstance(exc, DeviceError) and "injected" in str(exc)
    expected = snapshot(engine, ids)
    crashed = Engine.open(cfg, devices=crash_copy(devs))  # a crash right after the error
    assert snapshot(crashed, ids) == expected
    crashed.close()
    for dev in devs:
        dev.fail_writes = dev.fail_syncs = False
    OPS[name](engine)  # the store goes on: the same request now succeeds, and lasts
    done = snapshot(engine, ids)
    assert done != expected
    check_after_restarts(engine, cfg, devs, ids, done)


def test_device_fault_then_success_keeps_only_the_successful_request():
    engine, cfg, devs = faulty_engine()
    ids = list(range(8))
    for dev in devs:
        dev.fail_syncs = True
    assert isinstance(attempt(engine, lambda: engine.delete_many([key(5)]), ids), DeviceError)
    for dev in devs:
        dev.fail_syncs = False
    assert engine.delete_many([key(6)]) == [True]  # its records land where the failed one's were
    expected = snapshot(engine, ids)
    assert expected[5] is False and expected[6] is None
    check_after_restarts(engine, cfg, devs, ids, expected)


class SyncFaultThenWriteFaults(FaultyDevice):
    """A device whose failed fdatasync makes every write to the array fail from then on (the
    drives going away)."""

    def __init__(self, inner, array: list):
        super().__init__(inner)
        self.array = array

    def sync(self) -> None:
        if self.fail_syncs:
            for dev in self.array:
                dev.fail_writes = True
        super().sync()


def test_a_failed_durable_put_is_tombstoned_by_the_next_commit_that_succeeds():
    """The group commit runs without the lock, so a failed one cannot zero its blocks on flash
    (other writers' blocks may share their pages): they leave the index and get tombstones.
    Here the tombstones' immediate write fails too (the device keeps failing): a crash then may
    bring the blocks back -- the documented window -- and the next commit that succeeds, even
    one that only needs the data prefix (a durable put), writes them."""
    cfg = EngineConfig(device_paths=("m0", "m1"), stripe_size_bytes=MiB // 4, region_size_bytes=MiB)
    devs: list = []
    devs += [SyncFaultThenWriteFaults(MemoryDevice(DATA_OFFSET_BYTES + 4 * MiB, f"m{i}"), devs) for i in range(2)]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    engine.put_many([block(i, 20_000) for i in range(4)], durable=True)
    ids = list(range(4)) + [20, 21, 40]
    for dev in devs:
        dev.fail_syncs = True
    exc = attempt(engine, lambda: engine.put_many([block(20, 3000), block(21, 3000)], durable=True), ids)
    assert isinstance(exc, DeviceError)
    assert engine.lookup([key(20)]) == 0 and engine.get(key(21)) is None
    for dev in devs:
        dev.fail_syncs = dev.fail_writes = False
    engine.put(block(40, 3000), durable=True)
    expected = snapshot(engine, ids)
    assert expected[20] is None and expected[21] is None and expected[40] is False
    crashed = Engine.open(cfg, devices=crash_copy(devs))
    assert snapshot(crashed, ids) == expected
    crashed.close()
    check_after_restarts(engine, cfg, devs, ids, expected)


@pytest.mark.parametrize("fault", ["write", "sync"])
def test_put_received_in_place_whose_durable_commit_fails_is_taken_back(fault):
    """As a copied durable put: dropped from the index, tombstoned (same window as above)."""
    engine, cfg, devs = faulty_engine()
    ids = list(range(8)) + [30, 31]
    sent = [block(30, 3000), block(31, 5000)]
    reservation = engine.reserve_put([key(30), key(31)], [len(b) for b in sent])
    assert reservation is not None
    reservation.view[:] = b"".join(sent)
    for dev in devs:
        setattr(dev, "fail_writes" if fault == "write" else "fail_syncs", True)
    exc = attempt(engine, lambda: engine.commit_put(reservation, durable=True), ids)
    assert isinstance(exc, DeviceError)
    assert engine.lookup([key(30)]) == 0 and engine.get(key(31)) is None
    expected = snapshot(engine, ids)
    crashed = Engine.open(cfg, devices=crash_copy(devs))
    assert snapshot(crashed, ids) == expected
    crashed.close()
    for dev in devs:
        dev.fail_writes = dev.fail_syncs = False
    engine.put_many(sent, durable=True)  # the same blocks, stored now
    check_after_restarts(engine, cfg, devs, ids, snapshot(engine, ids))


class HeldFailingSyncs(FaultyDevice):
    """Syncs wait for ``release`` once ``held`` is set, then fail if ``fail_syncs`` is set by then
    (``waiting``: an event the devices of one array share, set by the first sync held)."""

    def __init__(self, inner, waiting: threading.Event):
        super().__init__(inner)
        self.held, self.release, self.waiting = False, threading.Event(), waiting

    def sync(self) -> None:
        if self.held:
            self.waiting.set()
            assert self.release.wait(30), "the test never released the sync"
        super().sync()


@pytest.mark.parametrize("name", ["delete", "pin", "unpin", "delete_namespace"])
def test_a_failed_commit_of_records_another_writer_appended_behind_changes_nothing(name):
    """The records' group commit runs without the lock: a buffered PUT appends behind them while
    it is in flight, so a failed one cannot zero them; they are rewritten as tombstones that name
    no block, and the request changed nothing, in memory, after a crash and after the next flush."""
    cfg = EngineConfig(device_paths=("m0", "m1"), stripe_size_bytes=MiB // 4, region_size_bytes=MiB)
    waiting = threading.Event()
    devs = [HeldFailingSyncs(MemoryDevice(DATA_OFFSET_BYTES + 4 * MiB, f"m{i}"), waiting) for i in range(2)]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    for i in range(8):
        engine.put(block(i, 20_000), durable=True)
    engine.pin_many([key(1)])
    ids = list(range(8)) + [40]
    before = snapshot(engine, ids)
    for dev in devs:
        dev.held = True
    errors = []

    def request() -> None:
        try:
            OPS[name](engine)
        except DeviceError as exc:
            errors.append(exc)
    blocked = threading.Thread(target=request)
    blocked.start()
    assert waiting.wait(5)
    engine.put(block(40, 3000))  # appended behind the records, while their commit is in flight
    for dev in devs:
        dev.fail_syncs = True
        dev.release.set()
    blocked.join(10)
    assert not blocked.is_alive() and len(errors) == 1 and "injected" in str(errors[0])
    expected = {**before, 40: False}
    assert snapshot(engine, ids) == expected
    crashed = Engine.open(cfg, devices=crash_copy(devs))
    assert snapshot(crashed, ids[:-1]) == snapshot(engine, ids[:-1])  # 40 was buffered: a crash may lose it
    crashed.close()
    for dev in devs:
        dev.held, dev.fail_syncs = False, False
    engine.flush()
    check_after_restarts(engine, cfg, devs, ids, expected)
