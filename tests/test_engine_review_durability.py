"""Second review of durability and recovery: requests that fail while the lock is let go, and
what a commit made durable meanwhile.
"""
from __future__ import annotations

import threading
import time

import pytest

from kvtier.daemon.engine import DeviceError, Engine, EngineConfig, NoSpaceError
from kvtier.daemon.engine.devices import FaultyDevice, MemoryDevice
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

from test_engine import PAYLOAD_5_PER_REGION, REGION, block, fill, key, mem_engine, present, same_block

WAIT_S = 10  # the longest a test waits for another thread to reach a point
POLL_S = 0.001  # how often it looks


def while_waiting_for_a_clean_region(engine, call) -> None:
    """The next writer that waits for a clean region lets go of the lock, as the pool's wait does,
    while ``call`` runs in another thread (a FLUSH, a durable PUT arriving then)."""
    allocator, take_clean = engine._allocator, engine._allocator.take_clean
    ran = threading.Condition(engine._lock)
    done = []

    def other() -> None:
        call()
        with engine._lock:
            done.append(True)
            ran.notify_all()

    def waiting(*args):
        allocator.take_clean = take_clean
        threading.Thread(target=other).start()
        ran.wait_for(lambda: done, 10)
        return take_clean(*args)

    allocator.take_clean = waiting


def full_of_pins():
    """Three regions of pinned blocks, the open one with room for one more block: a PUT
    that needs another region gets NoSpaceError."""
    engine, cfg, devs = mem_engine(regions=4, pinned_fraction_max=1.0)
    fill(engine, range(14))
    assert engine.pin_many([key(i) for i in range(14)]) == [True] * 14
    return engine, cfg, devs


@pytest.mark.parametrize("other", ["flush", "durable put of a key of the batch"])
def test_a_batch_refused_for_room_after_a_commit_covered_its_first_blocks_fails_cleanly(other):
    """A batch spanning regions appends to the open region, then waits for a clean one with the
    lock let go; a commit meanwhile (a FLUSH, or a durable PUT of a key the batch already
    appended, answered at once) writes and syncs those blocks. The batch then fails (no
    space): its take-back must not zero blocks that are on flash and synced."""
    engine, cfg, devs = full_of_pins()
    call = engine.flush if other == "flush" else lambda: engine.put(block(14, PAYLOAD_5_PER_REGION), durable=True)
    while_waiting_for_a_clean_region(engine, call)
    with pytest.raises(NoSpaceError):
        engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(14, 20)])
    assert engine.failure is None
    assert present(engine, range(14)) == list(range(14))
    engine.unpin_many([key(i) for i in range(5)])
    fill(engine, range(40, 45))
    restarted = Engine.open(cfg, devices=devs)  # killed: never closed
    for i in list(range(20)) + list(range(40, 45)):
        got = restarted.get(key(i))
        assert got is None or same_block(got, block(i, PAYLOAD_5_PER_REGION)), i
    assert present(restarted, range(5, 14)) == list(range(5, 14))
    restarted.close()


class GatedDevice(FaultyDevice):
    """Holds the next write once ``gate`` is armed (until ``release``); ``syncs_to_fail`` syncs fail."""

    def __init__(self, inner):
        super().__init__(inner)
        self.armed = False
        self.held = threading.Event()
        self.released = threading.Event()
        self.syncs_to_fail = 0

    def _write(self, offset, buffers, total):
        if self.armed:
            self.armed = False
            self.held.set()
            assert self.released.wait(10), "the gated write was never released"
        super()._write(offset, buffers, total)

    def sync(self) -> None:
        with self._lock:
            fail, self.syncs_to_fail = self.syncs_to_fail > 0, max(0, self.syncs_to_fail - 1)
        if fail:
            raise self._fault("sync")
        super().sync()


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(POLL_S)


def test_a_delete_acknowledged_by_the_commit_after_a_failed_one_is_durable():
    """A DELETE appends its tombstone while a commit (a FLUSH's) waits for a seal write, and waits
    for the next commit; the one in flight takes the tombstone into its snapshot, then fails
    (a sync error). The next commit succeeds and the DELETE is acknowledged: the tombstone must be
    on flash, or a restart serves the deleted block again."""
    cfg = EngineConfig(device_paths=("mem0",), stripe_size_bytes=REGION // 2, region_size_bytes=REGION)
    devs = [GatedDevice(MemoryDevice(DATA_OFFSET_BYTES + 4 * REGION, "mem0"))]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    fill(engine, range(5))  # region 0 full
    devs[0].armed = True
    fill(engine, [5])  # region 0's seal write is held
    assert devs[0].held.wait(WAIT_S)
    outcome = {}

    def run(name, call):
        try:
            outcome[name] = call()
        except DeviceError as exc:
            outcome[name] = exc

    flush = threading.Thread(target=run, args=("flush", engine.flush))
    flush.start()
    until(lambda: engine._durability._in_flight, "the FLUSH's commit did not start")
    delete = threading.Thread(target=run, args=("delete", lambda: engine.delete_many([key(1)])))
    delete.start()
    until(lambda: engine._durability._entries_wanted, "the DELETE did not wait for a commit")
    devs[0].syncs_to_fail = 1
    devs[0].released.set()
    flush.join(WAIT_S)
    delete.join(WAIT_S)
    assert isinstance(outcome["flush"], DeviceError)
    assert outcome["delete"] == [True]
    restarted = Engine.open(cfg, devices=[devs[0].inner])  # killed: never closed
    assert restarted.lookup([key(1)]) == 0, "an acknowledged DELETE was lost: the deleted block came back"
    assert present(restarted, range(5)) == [0, 2, 3, 4]
    restarted.close()


def test_a_durable_put_answered_while_a_spanning_batch_waits_survives_that_batch_failing():
    """A batch spanning regions indexes what it placed before the crossing, then lets go of the
    lock; a durable PUT of one of those keys is answered from it then. The batch failing later
    (no space) must not take that block out of the index: the other client was told it is durable.
    What the batch placed after a crossing it made goes, as a failed request's blocks do."""
    engine, cfg, devs = full_of_pins()
    answered = []
    while_waiting_for_a_clean_region(
        engine, lambda: answered.append(engine.put(block(14, PAYLOAD_5_PER_REGION), durable=True)))
    with pytest.raises(NoSpaceError):
        engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in range(14, 20)])
    assert answered and engine.failure is None
    assert same_block(engine.get(key(14)), block(14, PAYLOAD_5_PER_REGION))
    assert present(engine, range(15, 20)) == []
    restarted = Engine.open(cfg, devices=devs)  # killed: never closed
    assert same_block(restarted.get(key(14)), block(14, PAYLOAD_5_PER_REGION))
    restarted.close()


def test_a_batch_that_fails_after_crossing_into_a_new_region_leaves_nothing_of_it_there():
    """A batch larger than a region filled one region and went on in the next, and fails there
    (a device error): what it placed in the new region is neither indexed nor found by a restart,
    and what it committed before the crossing (seen by others while the lock was let go) stays."""
    engine, cfg, devs = mem_engine(regions=6)
    fill(engine, range(4))  # the open region has room for one more block
    take, taken = engine._seqs.take, []

    def take_or_fail():
        taken.append(True)
        if len(taken) == 3:  # block 12, the second in the new region
            raise DeviceError("injected: a write failed")
        return take()

    engine._seqs.take = take_or_fail
    with pytest.raises(DeviceError):  # block 3 is present; 10 fills the open region, 11-15 the next, 16 a third
        engine.put_many([block(i, PAYLOAD_5_PER_REGION) for i in (3, *range(10, 17))])
    engine._seqs.take = take
    assert engine.failure is None
    assert present(engine, range(10, 17)) == [10]
    engine.flush()
    restarted = Engine.open(cfg, devices=devs)
    assert present(restarted, range(10, 17)) == [10]
    restarted.close()
