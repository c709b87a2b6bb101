"""PUTs received straight into the open region (Engine.reserve_put / commit_put / abort_put):
blocks land where they are stored, are checked there, and a reservation that is not committed
is never stored, served, or brought back by recovery -- in every crash state."""
from __future__ import annotations

import struct
import threading

import crc32c
import pytest

from kvtier.common.aligned import align_down
from kvtier.common.blockformat import BlockFormatError, decode_header
from kvtier.daemon.engine import DeviceError, Engine, EngineFailedError
from kvtier.daemon.engine import puts as put_reservations
from kvtier.daemon.engine import regionfmt as fmt
from kvtier.daemon.engine.devices import FaultyDevice, MemoryDevice

from test_engine import block, key, mem_engine, present, same_block, seal
from test_engine_crash_safety import check_every_crash_state, one_device_store, record_from_here


def fill_into(reservation, blocks) -> None:
    pos = 0
    for b in blocks:
        reservation.view[pos:pos + len(b)] = b
        pos += len(b)


def reserve(engine, blocks, new_region=True):
    return engine.reserve_put([decode_header(b).key for b in blocks], [len(b) for b in blocks], new_region)


def put_in_place(engine, blocks, durable=False) -> list[int]:
    reservation = reserve(engine, blocks)
    assert reservation is not None
    fill_into(reservation, blocks)
    return engine.commit_put(reservation, durable=durable)


def with_seq(b: bytes, seq: int) -> bytes:
    """The block with ``seq`` in its header and the header CRC made valid: a forged daemon stamp."""
    head = bytearray(b[:64])
    struct.pack_into("<Q", head, 48, seq)
    struct.pack_into("<I", head, 60, crc32c.crc32c(bytes(head[:60])))
    return bytes(head) + b[64:]


def reopen(cfg, devs) -> Engine:
    """A restart after a crash: the old engine is abandoned, never closed."""
    return Engine.open(cfg, devices=[d.inner if isinstance(d, FaultyDevice) else d for d in devs])


def test_blocks_received_in_place_are_stored_served_and_recovered():
    engine, cfg, devs = mem_engine()
    blocks = [block(i, 3000 + i) for i in range(4)]
    seqs = put_in_place(engine, blocks, durable=True)
    assert seqs == sorted(seqs) and len(set(seqs)) == 4
    assert engine.statistics().puts_received_in_place == 4 and engine.statistics().puts == 4
    assert all(same_block(engine.get(key(i)), blocks[i]) for i in range(4))
    engine = reopen(cfg, devs)
    assert present(engine, range(4)) == [0, 1, 2, 3]
    assert [engine.block_info(key(i))["seq"] for i in range(4)] == seqs
    engine.close()


@pytest.mark.parametrize("damage", ["payload crc", "wrong key", "wrong length"])
def test_a_block_that_fails_its_check_where_it_landed_stores_nothing_of_the_frame(damage):
    engine, cfg, devs = mem_engine()
    blocks = [block(i, 2000) for i in range(3)]
    landed = list(blocks)
    if damage == "payload crc":
        landed[1] = landed[1][:-1] + bytes([landed[1][-1] ^ 1])
    elif damage == "wrong key":
        landed[1] = block(9, 2000)
    if damage == "wrong length":  # the item says one size, the block's header another
        reservation = engine.reserve_put([key(i) for i in range(3)], [len(b) for b in blocks[:2]] + [2100])
        landed[2] = landed[2] + bytes(36)
    else:
        reservation = reserve(engine, blocks)
    fill_into(reservation, landed)
    with pytest.raises(BlockFormatError, match="PUT item (1|2)"):
        engine.commit_put(reservation, durable=True)
    assert present(engine, range(3)) == [] and engine.statistics().puts == 0
    assert put_in_place(engine, blocks[:1], durable=True)  # the room was given back: no reservation in flight
    engine = reopen(cfg, devs)
    assert present(engine, range(3)) == [0]
    engine.close()


def test_an_aborted_reservation_never_comes_back_after_a_crash_even_as_valid_blocks():
    """An aborted frame's bytes stay in the image past data_end, and the next durable put writes
    its last page whole: were they not zeroed, the walk of the open region after a crash would find
    a complete, CRC-valid block the client forged with a plausible seq, never committed."""
    engine, cfg, devs = mem_engine()
    first = engine.put(block(0, 1000), durable=True)
    small, forged = block(1, 1000), with_seq(block(2, 500), first + 2)  # the put below gets first + 1
    reservation = reserve(engine, [small, forged])
    fill_into(reservation, [small, forged])
    engine.abort_put(reservation)
    assert present(engine, [1, 2]) == []
    assert engine.put(block(3, 1000), durable=True) == first + 1  # lands where the aborted frame did
    engine = reopen(cfg, devs)
    assert present(engine, range(4)) == [0, 3], "an aborted reservation came back as a block"
    engine.close()


def test_writers_wait_for_the_reservation_in_flight_and_the_region_is_sealed_after_it():
    engine, _, _ = mem_engine()
    blocks = [block(i, 4000) for i in range(2)]
    reservation = reserve(engine, blocks)
    done = []
    writers = [threading.Thread(target=lambda: done.append(engine.put(block(5, 1000)))),
               threading.Thread(target=lambda: done.append(seal(engine)))]
    for t in writers:
        t.start()
    writers[0].join(0.3)
    assert writers[0].is_alive() and engine.statistics().regions_sealed == 0 and not done
    assert engine.get(key(0)) is None  # reserved, not data: never served half-written
    fill_into(reservation, blocks)
    engine.commit_put(reservation)
    for t in writers:
        t.join(10)
    assert not any(t.is_alive() for t in writers) and len(done) == 2
    assert present(engine, [0, 1, 5]) == [0, 1, 5]
    assert engine.block_info(key(0))["seq"] < engine.block_info(key(5))["seq"]  # in place order
    engine.close()


def test_a_second_reservation_waits_then_declines(monkeypatch):
    monkeypatch.setattr(put_reservations, "RESERVATION_WAIT_S", 0.05)
    engine, _, _ = mem_engine()
    first = reserve(engine, [block(0)])
    assert reserve(engine, [block(1)]) is None  # the caller takes the copying path
    engine.abort_put(first)
    second = reserve(engine, [block(1)])
    assert second is not None
    engine.abort_put(second)
    engine.close()


def test_a_reservation_is_declined_for_present_or_repeated_keys_and_when_it_does_not_fit():
    engine, _, _ = mem_engine()
    engine.put(block(0, 200_000))
    assert reserve(engine, [block(0)]) is None
    assert reserve(engine, [block(1), block(1)]) is None
    assert reserve(engine, [block(i, 300_000) for i in range(1, 5)]) is None  # more than a region
    assert reserve(engine, [block(1, 900_000)], new_region=False) is None  # not in the open region's room
    reservation = reserve(engine, [block(1, 900_000)], new_region=True)
    assert reservation is not None and reservation.region != engine.block_info(key(0))["region"]
    engine.abort_put(reservation)
    engine.close()


def test_a_device_error_at_the_seal_a_commit_waits_for_is_raised_and_nothing_stays_reserved():
    engine, cfg, devs = mem_engine()
    faulty = [FaultyDevice(d) for d in devs]
    engine.close()
    engine = Engine.open(cfg, devices=faulty)
    engine.put(block(0, 500_000))
    big = [block(1, 700_000)]
    reservation = reserve(engine, big)  # seals the first region: its write is in flight or done
    fill_into(reservation, big)
    for d in faulty:
        d.fail_writes = True
    with pytest.raises(DeviceError):
        engine.commit_put(reservation, durable=True)
    for d in faulty:
        d.fail_writes = False
    seal(engine)  # does not wait forever: the reservation was resolved
    assert engine.statistics().device_errors >= 1
    assert put_in_place(engine, [block(2, 1000)], durable=True)
    engine.close()


def test_every_crash_state_of_a_durable_put_in_place_serves_exact_blocks():
    engine, cfg, devs = one_device_store()
    engine.put(block(0, 3000), durable=True)
    log = record_from_here(devs)
    sent = [block(1, 5000), block(2, 7000)]
    put_in_place(engine, sent, durable=True)

    def check(engine, label):
        assert present(engine, [0]) == [0], label
        for i, b in ((1, sent[0]), (2, sent[1])):
            got = engine.get(key(i))
            assert got is None or same_block(got, b), (i, label)

    assert check_every_crash_state(log, cfg, check) > len([e for e in log.events if e])
    engine = reopen(cfg, devs)  # every write landed: both acknowledged blocks are there
    assert present(engine, [0, 1, 2]) == [0, 1, 2]


def test_every_crash_state_after_an_abort_keeps_acknowledged_blocks_and_no_aborted_one():
    engine, cfg, devs = one_device_store()
    acked = [block(1, 5000), block(2, 7000)]
    put_in_place(engine, acked, durable=True)
    log = record_from_here(devs)
    aborted = [block(3, 2000), with_seq(block(4, 300), engine.block_info(key(2))["seq"] + 2)]
    reservation = reserve(engine, aborted)
    fill_into(reservation, aborted)
    engine.abort_put(reservation)
    put_in_place(engine, [block(5, 2000)], durable=True)  # lands where the aborted frame did
    seal(engine)

    def check(engine, label):
        assert present(engine, [1, 2]) == [1, 2], f"an acknowledged block was lost ({label})"
        assert present(engine, [3, 4]) == [], f"an aborted reservation came back ({label})"
        for i, b in ((1, acked[0]), (2, acked[1]), (5, block(5, 2000))):
            got = engine.get(key(i))
            assert got is None or same_block(got, b), (i, label)

    assert check_every_crash_state(log, cfg, check) > len([e for e in log.events if e])


@pytest.mark.parametrize("outcome", ["aborted", "in flight"])
def test_a_durable_commit_never_carries_the_next_reservation_to_flash(outcome):
    """A durable commit writes, outside the lock, the page its last block ends in; the next PUT
    may already be reserved and received there (here a whole small block the client forged the
    next seq for). In no crash state does that block come back: the write carries zeros past
    data_end."""
    engine, cfg, devs = one_device_store()
    log = record_from_here(devs)
    acked = [block(1, 1000)]
    put_in_place(engine, acked)  # its group commit has not run yet: it runs below, as if late
    later = [with_seq(block(2, 300), engine._seqs.next)]  # the seq the next block would get
    reservation = reserve(engine, later)
    fill_into(reservation, later)
    engine._durability.commit()  # the durable commit of the first PUT, after its lock was let go
    if outcome == "aborted":
        engine.abort_put(reservation)
        engine.put(block(3, 200), durable=True)

    def check(engine, label):
        assert present(engine, [2]) == [], f"a block never committed came back ({label})"
        got = engine.get(key(1))
        assert got is None or same_block(got, acked[0]), label

    assert check_every_crash_state(log, cfg, check) > 0
    engine = reopen(cfg, devs)
    assert present(engine, [1, 2]) == [1]
    engine.close()


def _nearly_full(engine, region_bytes: int) -> bytes:
    """Fill the open region until data_end lies in the page the summary entries begin in, the last
    block's prefix durable and its entry not; returns that block."""
    for i in range(10, 20):
        engine.put(block(i, 100_000))
    engine.flush()
    image = engine._allocator.open
    target = align_down(fmt.entry_position(region_bytes, image.entry_count)) + 64
    last = block(1, target - image.data_end - 64)
    engine.put(last, durable=True)  # a commit without entries
    assert image.data_end == target and align_down(image.data_end) == align_down(image.summary_start)
    return last


def test_a_commit_with_entries_never_carries_a_reservation_in_their_first_page_to_flash():
    """A FLUSH (or a DELETE, a PIN, a reclaim) writes the summary entries, and doesn't wait for a
    reservation; in a nearly full region the first entry page is the one data_end falls in, where
    the next PUT is being received. Aborted, that PUT must not come back in any crash state."""
    engine, cfg, devs = one_device_store(regions=5)
    acked = _nearly_full(engine, cfg.region_size_bytes)
    log = record_from_here(devs)
    forged = [with_seq(block(2, 300), engine._seqs.next)]
    reservation = reserve(engine, forged, new_region=False)
    assert reservation is not None
    fill_into(reservation, forged)
    engine.flush()
    engine.abort_put(reservation)
    engine.put(block(3, 200), durable=True)

    def check(engine, label):
        assert present(engine, [2]) == [], f"an aborted block came back ({label})"
        got = engine.get(key(1))
        assert got is None or same_block(got, acked), label

    assert check_every_crash_state(log, cfg, check) > 0
    engine = reopen(cfg, devs)
    assert present(engine, [1, 2, 3]) == [1, 3]
    engine.close()


def test_a_commit_that_fails_after_placing_is_taken_back_and_fails_the_engine_closed(monkeypatch):
    engine, _, _ = mem_engine()
    blocks = [block(1, 1000), block(3, 2000)]
    reservation = reserve(engine, blocks)
    fill_into(reservation, blocks)

    def fails(pending):
        raise RuntimeError("the index insert failed")
    monkeypatch.setattr(engine._blocks, "insert_appended", fails)
    with pytest.raises(EngineFailedError, match="RuntimeError in Engine.commit_put: the index insert failed"):
        engine.commit_put(reservation)
    monkeypatch.undo()
    engine.abort_put(reservation)  # what the handler's finally does: a no-op now
    image = engine._allocator.open
    assert image.data_end == reservation.offset and engine._allocator.reservation is None
    assert bytes(reservation.view) == bytes(reservation.view.nbytes), "client bytes left past data_end"
    with pytest.raises(EngineFailedError):  # a bug in engine state: nothing more is served
        engine.put(block(2, 500))
    engine.close()


def test_a_writer_waits_for_a_reservation_a_bounded_time_and_is_told_what_it_waited_for(monkeypatch):
    from kvtier.daemon.engine import WaitTimeoutError
    from kvtier.daemon.engine import allocator as allocator_module

    monkeypatch.setattr(allocator_module, "RESERVATION_WAIT_S_MAX", 0.2)
    engine, _, _ = mem_engine()
    held = reserve(engine, [block(1, 3000)])  # a client that never sends the rest of its PUT
    assert held is not None
    with pytest.raises(WaitTimeoutError, match=r"waited 0.2 s for the PUT being received in place \(3064 bytes into region"):
        engine.put(block(2, 500))
    with pytest.raises(WaitTimeoutError):
        engine.delete_many([key(5)])
    engine.abort_put(held)  # the connection closes: the others go on
    engine.put(block(2, 500))
    assert present(engine, [1, 2]) == [2] and engine.failure is None
    engine.close()
