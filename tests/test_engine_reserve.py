"""The reclaim worker's reserve: the last clean region is room a reclaim can always compact into.

Only the worker takes it: a record (a PIN, a tombstone) waits for the worker as a block does. And
the region the worker opens takes no writer's blocks until the worker has reclaimed a region back
into the pool (it is *held*). Before, a PIN's record took the reserve while a writer waited for a
region, the writer filled it, the worker then had nowhere to move a victim's pinned blocks, and
every PUT answered NO_SPACE while evictable blocks filled the store, also after a restart."""
from __future__ import annotations

import threading

from kvtier.daemon.engine import Engine, NoSpaceError

from test_engine import PAYLOAD_5_PER_REGION, block, key, mem_engine, present

PIN_PAYLOAD = 100_000  # more than the room a region filled with WRITER_PAYLOAD blocks has left
WRITER_PAYLOAD = 20_000
WAIT_S = 30.0  # for a thread to reach the state the test needs (a loaded CI machine)


def _fill_with_a_pin_per_region(engine, regions: int) -> list[int]:
    """Four large unpinned blocks and one small pinned block per region, until every data region
    holds a pinned block and the pool is down to its reserve; the pinned ids."""
    pinned, i = [], 0
    for _ in range(regions):
        engine.put_many([block(10_000 + i, PIN_PAYLOAD)], durable=True)
        engine.pin_many([key(10_000 + i)])
        pinned.append(10_000 + i)
        engine.put_many([block(i * 4 + j, PAYLOAD_5_PER_REGION) for j in range(4)])
        i += 1
    return pinned


def _wait(engine, condition) -> None:
    with engine._lock:
        assert engine._regions._changed.wait_for(condition, WAIT_S), "the engine never reached the state"


def _pin_while_the_next_writer_waits(engine, pin_key: bytes, threads: list, pinned: list) -> None:
    """The next writer that asks for a clean region first lets a PIN start: its record finds the
    open region rolled from (not appendable) and asks for a clean region too."""
    allocator = engine._allocator
    take_clean = allocator.take_clean

    def waiting(*args, **kwargs):
        allocator.take_clean = take_clean
        def pin_and_say_so() -> None:
            try:
                pinned.extend(engine.pin_many([pin_key]))
            finally:
                with engine._lock:
                    engine._regions._changed.notify_all()

        pin = threading.Thread(target=pin_and_say_so, name="model-pin")
        threads.append(pin)
        pin.start()
        engine._regions._changed.wait_for(lambda: engine._regions._waiters or not pin.is_alive(), WAIT_S)
        return take_clean(*args, **kwargs)

    allocator.take_clean = waiting


def writer_behind_a_pin(engine, blocks: list[bytes], pin_key: bytes) -> tuple[list[Exception], bool]:
    """PUT ``blocks`` one by one on a thread while the reclaim worker is held back, and PIN
    ``pin_key`` the first time that writer waits for a clean region; every waiter is woken once (as
    other traffic would), the writer goes as far as it can, then the worker runs. The NoSpaceErrors
    the writer got, and whether the PIN found the key."""
    worker_paused = engine._regions.hold()
    with engine._lock:
        worker_paused.__enter__()
    threads: list[threading.Thread] = []
    pinned: list[bool] = []
    failures: list[Exception] = []
    _pin_while_the_next_writer_waits(engine, pin_key, threads, pinned)

    def writer() -> None:
        try:
            for blk in blocks:
                engine.put_many([blk])
        except NoSpaceError as exc:
            failures.append(exc)
        finally:
            with engine._lock:
                engine._regions._changed.notify_all()

    threads.append(threading.Thread(target=writer, name="model-writer"))
    threads[-1].start()

    def settled() -> bool:  # every thread still running waits for a clean region
        return len(engine._regions._waiters) == sum(t.is_alive() for t in threads)

    try:
        _wait(engine, settled)
        with engine._lock:
            engine._regions._changed.notify_all()  # every waiter looks again, as other traffic would make it
        # the writer went as far as it could: it waits, and the open region takes none of its blocks
        _wait(engine, lambda: settled() and (not any(t.is_alive() for t in threads) or
                                             not engine._allocator.appendable(len(blocks[0]))))
        with engine._lock:
            assert engine._table.free_count >= 1, "a record took the reserve"
    finally:
        with engine._lock:
            worker_paused.__exit__(None, None, None)
        for thread in threads:
            thread.join(WAIT_S)
            assert not thread.is_alive()
    if engine._allocator.take_clean.__name__ == "waiting":  # the writer never waited: the hook is still set
        engine._allocator.take_clean = engine._regions.take_clean
    return failures, bool(pinned and pinned[0])


def test_only_the_reclaim_takes_the_reserve_and_writers_never_wedge():
    engine, cfg, devs = mem_engine(regions=6)
    pinned = _fill_with_a_pin_per_region(engine, regions=8)
    with engine._lock:
        engine._regions.wait_idle(WAIT_S)
        assert engine._table.free_count == 1  # the reserve, and nothing else
    failures, found = writer_behind_a_pin(engine, [block(50_000 + i, WRITER_PAYLOAD) for i in range(200)], key(31))
    assert not failures, f"a PUT was refused while evictable blocks filled the store: {failures[0]}"
    assert found and engine.block_info(key(31))["pinned"]
    assert present(engine, pinned + [31]) == pinned + [31]
    with engine._lock:
        assert engine._allocator.held_region is None and engine._table.free_count >= 1
    restarted = Engine.open(cfg, devices=devs)  # a crash now: the old engine is abandoned, never closed
    for i in range(40):
        restarted.put_many([block(70_000 + i, PAYLOAD_5_PER_REGION)])
    assert present(restarted, pinned + [31]) == pinned + [31]
    restarted.close()


def test_the_region_the_worker_compacts_into_takes_no_writers_blocks_until_it_has_reclaimed():
    engine, _, _ = mem_engine(regions=6)
    _fill_with_a_pin_per_region(engine, regions=8)
    allocator = engine._allocator
    with engine._lock:
        engine._regions.wait_idle(WAIT_S)
        allocator.held_region = allocator.open.region  # as the worker leaves it mid-reclaim
        assert not allocator.appendable(1000) and allocator.appendable(0)  # records go there, blocks do not
        assert allocator.appendable(1000, compacting=True)
        allocator.held_region = None
        assert allocator.appendable(1000) == allocator.open.room_for(1000)
    engine.close()
