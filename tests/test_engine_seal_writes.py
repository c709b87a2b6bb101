"""A seal writes what no commit has: the prefix a durable commit in flight already wrote is not
written again (it was, once per region, under durable PUTs), and every crash state still serves
exact blocks."""
from __future__ import annotations

import threading

from kvtier.daemon.engine import regionfmt as fmt

from test_engine import REGION, block, key, present, same_block, seal
from test_engine_crash_safety import check_every_crash_state, one_device_store, record_from_here

WAIT_S = 10.0


def _writes_holding(log, chunk: bytes) -> int:
    return sum(1 for event in log.events if event is not None and chunk in event[1])


def test_a_seal_skips_the_prefix_a_commit_in_flight_wrote():
    engine, cfg, devs = one_device_store()
    log = record_from_here(devs)
    room = fmt.data_room_bytes(REGION)
    first, second = block(1, room // 2), block(2, room // 2 + 4096)  # the second does not fit after the first
    held, release = threading.Event(), threading.Event()
    sync = log.sync

    def gated_sync():  # the first commit's sync waits: its writes are done, it has not published yet
        if not release.is_set():
            held.set()
            release.wait(WAIT_S)
        sync()

    log.sync = gated_sync
    durable = threading.Thread(target=engine.put, args=(first,), kwargs={"durable": True})
    durable.start()
    try:
        assert held.wait(WAIT_S), "the durable put never reached its sync"
        engine.put(second)  # seals the region that holds the first block, while its commit is in flight
    finally:
        release.set()
        durable.join(WAIT_S)
    assert not durable.is_alive()
    seal(engine)
    chunk = first[len(first) // 2:len(first) // 2 + 256]
    assert _writes_holding(log, chunk) == 1, "the committed block was written again by the seal"

    def check(engine, label):
        got = engine.get(key(1))
        assert got is None or same_block(got, first), label

    assert check_every_crash_state(log, cfg, check) > 0
    engine.close()
    engine = type(engine).open(cfg, devices=devs)
    assert present(engine, [1, 2]) == [1, 2] and same_block(engine.get(key(1)), first)
    engine.close()
