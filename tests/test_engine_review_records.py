"""Review of the room a DELETE, PIN or UNPIN takes for its summary records: every record it
appends goes to the open image it reserved room in, so a failed commit takes all of them back.

A request takes room for one record per key it changes, and taking room may let go of the
lock (waiting for a clean region); another request may then store, pin or unpin keys of this
one, so the request chooses its keys again. These tests let exactly that happen, with the open
region left with room for the records first counted and no more.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.common.blockformat import HEADER_SIZE
from kvtier.daemon.engine import DeviceError, Engine, EngineConfig, NoSpaceError
from kvtier.daemon.engine import regionfmt as fmt
from kvtier.daemon.engine.devices import FaultyDevice, MemoryDevice
from kvtier.daemon.engine.index import PINNED_BIT
from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES

from test_engine import NS, PAYLOAD_5_PER_REGION, REGION, block, key, mem_engine, present
from test_engine_review_durability import while_waiting_for_a_clean_region

A, B, FILLER, OTHER_FILLER = 100, 101, 900, 901  # block ids


def faulty_engine(regions: int = 8):
    cfg = EngineConfig(device_paths=("mem0", "mem1"), stripe_size_bytes=REGION // 4, region_size_bytes=REGION,
                       pinned_fraction_max=1.0)
    devs = [FaultyDevice(MemoryDevice(DATA_OFFSET_BYTES + regions * REGION // 2, f"mem{i}")) for i in range(2)]
    Engine.format(cfg, devices=devs)
    return Engine.open(cfg, devices=devs), cfg, devs


def leave_room_for_records(engine, records: int, i: int) -> None:
    """PUT a block (key ``i`` salted: not one a test looks up) sized so that the open region then
    has room for exactly ``records`` more metadata records."""
    while True:
        with engine._lock:
            image = engine._allocator.open
            assert engine._allocator.active
            length = image.size_bytes - image.data_end - fmt.summary_bytes(image.entry_count + 1 + records)
            region = image.region
        if length > HEADER_SIZE:
            break
        engine.put(block(i, PAYLOAD_5_PER_REGION, salt=b"next region"))  # too full: fill the next one
    engine.put(block(i, length - HEADER_SIZE, salt=b"room"))
    with engine._lock:
        image = engine._allocator.open
        assert image.region == region and image.room_for(0, records) and not image.room_for(0, records + 1)


def hard_pinned(engine, ids) -> list[int]:
    index = engine._index
    slots = index.find_many(*fmt.keys_to_halves([key(i) for i in ids]))
    return [i for i, slot in zip(ids, slots.tolist()) if slot >= 0 and index.meta[slot] & np.uint32(PINNED_BIT)]


# request: (what is stored and hard-pinned first, what another client does while the request
# waits for room, the request, what a restart must find present and pinned after it failed)
CASES = {
    "delete, another client storing a key of it meanwhile": (
        [A], [], lambda e: e.put(block(B)), lambda e: e.delete_many([key(A), key(B)]), [A, B], []),
    "pin, another client unpinning a key of it meanwhile": (
        [A, B], [B], lambda e: e.unpin_many([key(B)]), lambda e: e.pin_many([key(A), key(B)]), [A, B], []),
    "unpin, another client pinning a key of it meanwhile": (
        [A, B], [A], lambda e: e.pin_many([key(B)]), lambda e: e.unpin_many([key(A), key(B)]), [A, B], [A, B]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_request_whose_keys_changed_while_it_waited_for_room_appends_to_one_image(case):
    """The request counts one record, waits for a clean region (the lock let go) while another
    client makes a second key of it one to change, and finds the open region with room for one
    record: it must not append the second into a region it opens then (sealing the first with
    a record in it). Its commit fails: a restart must find nothing of it."""
    stored, pinned, other, request, after_present, after_pinned = CASES[case]
    engine, cfg, devs = faulty_engine()
    for i in stored:
        engine.put(block(i))
    if pinned:
        assert engine.pin_many([key(i) for i in pinned]) == [True] * len(pinned)
    leave_room_for_records(engine, 0, FILLER)  # the request's room needs a new region

    def meanwhile() -> None:
        other(engine)  # rolls into a new region (the request waits to roll from the full one)
        leave_room_for_records(engine, 1, OTHER_FILLER)  # room for the one record first counted
        for dev in devs:
            dev.fail_syncs = True  # the request's commit fails

    while_waiting_for_a_clean_region(engine, meanwhile)
    appended, record, mine = [], engine._durability.record, threading.get_ident()

    def recorded(*args) -> None:
        record(*args)
        if threading.get_ident() == mine:  # not the other client's
            appended.append((engine._allocator.open.region, engine._allocator.open.base_seq))

    engine._durability.record = recorded
    with pytest.raises(DeviceError):
        request(engine)
    engine._durability.record = record
    assert len(appended) == 2 and appended[0] == appended[1], f"the request's records went to two regions: {appended}"
    assert present(engine, after_present) == after_present and hard_pinned(engine, after_present) == after_pinned
    restarted = Engine.open(cfg, devices=[dev.inner for dev in devs])  # killed: never closed
    assert present(restarted, after_present) == after_present, "a failed request's record lasted"
    assert hard_pinned(restarted, after_present) == after_pinned, "a failed request's record lasted"
    restarted.close()


def records_of_this_thread(engine) -> list[tuple[int, int, int]]:
    """Wraps ``Durability.record``: (kind, region, base_seq) of each record this thread appends."""
    appended, record, mine = [], engine._durability.record, threading.get_ident()

    def recorded(kind, *args) -> None:
        record(kind, *args)
        if threading.get_ident() == mine:
            appended.append((kind, engine._allocator.open.region, engine._allocator.open.base_seq))

    engine._durability.record = recorded
    return appended


def test_requests_append_one_record_per_distinct_key_changed_into_the_image_open_when_they_start():
    """Repeated keys, keys of several namespaces and regions, absent keys, keys already pinned:
    one record per distinct key changed, a namespace delete one in all, each request's into the
    open region it found, which has room for exactly those (no seal in the middle of one)."""
    other_ns = bytes(range(16, 32))
    engine, cfg, devs = mem_engine(regions=8, pinned_fraction_max=1.0)
    for i in range(12):  # regions 0 and 1 sealed, the last two blocks in region 2
        engine.put(block(i, PAYLOAD_5_PER_REGION, ns=NS if i % 2 else other_ns))
    appended = records_of_this_thread(engine)
    requests = [
        (lambda: engine.pin_many([key(i) for i in (0, 0, 6, 11, 500, 6)]), 3),
        (lambda: engine.pin_many([key(i) for i in (0, 1, 6, 1)]), 1),  # 0 and 6 pinned already
        (lambda: engine.unpin_many([key(i) for i in (0, 1, 2, 0)]), 2),
        (lambda: engine.delete_many([key(i) for i in (1, 1, 2, 7, 10, 500, 501, 7)]), 4),
        (lambda: engine.delete_namespace(other_ns), 1),
    ]
    for n, (request, records) in enumerate(requests):
        leave_room_for_records(engine, records, 1000 + n)
        with engine._lock:
            opened = (engine._allocator.open.region, engine._allocator.open.base_seq)
        del appended[:]
        request()
        assert [where for _, *where in appended] == [list(opened)] * records, n
    del appended[:]
    assert engine.delete_many([]) == [] and engine.pin_many([key(i) for i in (11, 11)]) == [True, True]
    assert appended == []  # nothing to change: no record
    assert present(engine, range(12)) == [3, 5, 9, 11]
    assert hard_pinned(engine, range(12)) == [11]
    restarted = Engine.open(cfg, devices=devs)  # killed: never closed
    assert present(restarted, range(12)) == [3, 5, 9, 11] and hard_pinned(restarted, range(12)) == [11]
    restarted.close()


def test_a_namespace_delete_scans_its_blocks_again_after_a_wait_for_room_let_go_of_the_lock():
    """A namespace delete on a store with no room scans the namespace's blocks, then waits for room
    again (the lock let go) and, finding none, drops its blocks in memory first and tries once more.
    A block of the namespace deleted by another client during that wait is no longer in the slot the
    scan found: it must not be dropped twice, and the delete must count what it deleted."""
    engine, _, _ = mem_engine(regions=6)
    other = b"o" * 16
    for i in range(8):
        engine.put(block(i, 1000, ns=NS if i < 3 else other))
    pins = engine._pins_and_deletes
    reserve, calls = pins._reserve_records, []

    def no_room_at_first(count):  # a store with no room until the namespace's blocks are dropped
        calls.append(count)
        if len(calls) == 1:
            raise NoSpaceError("injected: no room")
        if len(calls) == 2:  # the wait for room let go of the lock: another client deletes a block of it
            assert engine.delete_many([key(0)]) == [True]
            raise NoSpaceError("injected: no room")
        return reserve(count)

    pins._reserve_records = no_room_at_first
    before = engine.statistics()
    assert engine.delete_namespace(NS) == 2
    pins._reserve_records = reserve
    after = engine.statistics()
    assert engine.failure is None and present(engine, range(8)) == list(range(3, 8))
    assert [engine._blocks.deleted.contains(*fmt.key_to_halves(key(i))) for i in range(4)] == [True] * 3 + [False]
    assert after.blocks == before.blocks - 3
    assert after.bytes_stored == int(engine._table.live_bytes.sum()) == sum(len(block(i, 1000, ns=other))
                                                                              for i in range(3, 8))
