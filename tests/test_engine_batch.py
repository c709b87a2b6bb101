"""The engine's batch paths: vectorized lookup / locate (list and buffer forms) against a
per-key oracle, get_many_placed into the caller's buffers (zero-copy where aligned), exact LRU touch order of batch reads,
vectorized pin / unpin / delete bookkeeping."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.common.blockformat import HEADER_SIZE, BlockFormatError, encode_block, verify_block
from kvtier.daemon.engine import BlockLocation, EngineError
from kvtier.daemon.engine.locations import LOCATION_DTYPE
from kvtier.common.aligned import aligned_buffer
from kvtier.daemon.engine.index import PINNED_BIT

from test_engine import NS, PAYLOAD_5_PER_REGION, block, fill, key, mem_engine, present, same_block, seal

PAGE = 4096


def page_block(i: int, pages: int) -> bytes:
    """A block of exactly ``pages`` x 4 KiB, so blocks appended back to back stay page-aligned."""
    payload = np.random.default_rng(i).integers(0, 256, pages * PAGE - HEADER_SIZE, dtype=np.uint8).tobytes()
    return encode_block(key(i), NS, 1, payload)


def oracle_locate(engine, keys) -> list[BlockLocation | None]:
    """One key at a time through the index (the engine's former per-slot loop)."""
    out = []
    for k in keys:
        slot = engine._index.find(int.from_bytes(k[:8], "little"), int.from_bytes(k[8:], "little"))
        if slot < 0:
            out.append(None)
            continue
        addr = int(engine._index.addr[slot])
        region = addr // engine.region_size_bytes
        image = engine._allocator.image_of(region)  # in a DRAM image: on flash only up to its durable end
        sealed = image is None or addr - region * engine.region_size_bytes + int(engine._index.length[slot]) \
            <= image.durable_end
        out.append(BlockLocation(addr, int(engine._index.length[slot]), engine._blocks.seq_of(slot), sealed))
    return out


def keys_buffer(ids) -> bytes:
    return b"".join(key(i) for i in ids)


@pytest.fixture
def busy():
    """5 regions: sealed ones, one with deletions, pins, and the open region partly filled."""
    engine, _, _ = mem_engine(regions=5)
    fill(engine, range(17))  # regions 0..2 sealed, 15, 16 in the open region
    engine.delete_many([key(3), key(11)])
    engine.pin_many([key(6)])
    yield engine
    engine.close()


# -- lookup / locate ----------------------------------------------------------
def test_locate_many_matches_the_per_key_oracle_in_every_state(busy):
    ids = [16, 0, 99, 3, 6, 15, 6, 11, 14, 5, 1000]
    keys = [key(i) for i in ids]
    got = busy.locate_many(keys)
    assert got == oracle_locate(busy, keys)
    assert [g is None for g in got] == [False, False, True, True, False, False, False, True, False, False, True]
    # the open region's blocks are on flash too: the delete and pin records' commit wrote it in place
    assert [g.sealed for g in got if g] == [True] * 7


def test_locate_buffer_rows_are_the_locations(busy):
    ids = list(range(20)) + [3, 3, 16]
    rows = busy.locate_buffer(keys_buffer(ids))
    assert rows.dtype == LOCATION_DTYPE and len(rows) == len(ids)
    for row, loc in zip(rows, oracle_locate(busy, [key(i) for i in ids])):
        if loc is None:
            assert not row["found"] and row["logical_offset"] == row["length"] == row["seq"] == 0
        else:
            assert row["found"]
            assert BlockLocation(int(row["logical_offset"]), int(row["length"]), int(row["seq"]),
                                 bool(row["sealed"])) == loc


def test_key_buffers_of_every_kind_give_the_same_answer(busy):
    ids = [0, 1, 2, 4, 5, 3, 7]
    joined = keys_buffer(ids)
    expected = busy.lookup([key(i) for i in ids])
    assert expected == 5
    as_u8 = np.frombuffer(joined, np.uint8).reshape(-1, 16)
    for form in (joined, bytearray(joined), memoryview(joined), as_u8, as_u8.view("V16").ravel(),
                 np.frombuffer(joined, "S16")):
        assert busy.lookup_buffer(form) == expected
        assert busy.locate_buffer(form).tobytes() == busy.locate_buffer(joined).tobytes()
    assert busy.lookup_buffer(b"") == 0 and len(busy.locate_buffer(b"")) == 0
    assert busy.lookup_buffer(keys_buffer(range(20))) == 3  # key 3 was deleted


def test_bad_key_buffers_raise_value_error(busy):
    with pytest.raises(ValueError, match="16-byte"):
        busy.lookup_buffer(bytes(17))
    with pytest.raises(ValueError, match="contiguous"):
        busy.locate_buffer(np.zeros((4, 32), np.uint8)[:, :16])
    with pytest.raises(ValueError, match="16 bytes"):
        busy.locate_many([key(1), b"short"])


def test_randomized_locate_and_lookup_agree_with_the_oracle():
    engine, _, _ = mem_engine(regions=6)
    rng = np.random.default_rng(7)
    for step in range(6):
        fill(engine, range(step * 7, step * 7 + 7))
        engine.delete_many([key(int(i)) for i in rng.integers(0, 50, 4)])
        ids = rng.integers(0, 60, 64).tolist()
        keys = [key(i) for i in ids]
        assert engine.locate_many(keys) == oracle_locate(engine, keys)
        chain_len = next((n for n, loc in enumerate(oracle_locate(engine, keys)) if loc is None), len(keys))
        assert engine.lookup(keys) == engine.lookup_buffer(b"".join(keys)) == chain_len
    engine.close()


# -- get_many_placed: into the caller's buffers -------------------------------------
def test_get_many_placed_into_aligned_buffers_reads_straight_into_them():
    engine, _, _ = mem_engine(regions=4)
    sent = {i: page_block(i, 16) for i in range(6)}  # 64 KiB blocks at page-aligned offsets
    engine.put_many(list(sent.values()))
    seal(engine)

    def no_pool(nbytes):
        raise AssertionError("the direct path must not take a pooled buffer")

    pool_take = engine._reader._buffers.take
    engine._reader._buffers.take = no_pool
    buf = aligned_buffer(16 * PAGE)
    for i, b in sent.items():
        assert engine.get_many_placed([key(i)], [buf]) == [(0, len(b))]
        assert same_block(bytes(buf[:len(b)]), b)
    bufs = [aligned_buffer(16 * PAGE) for _ in range(4)]
    assert engine.get_many_placed([key(i) for i in (5, 0, 3, 2)], bufs) == [(0, len(sent[i])) for i in (5, 0, 3, 2)]
    assert all(same_block(bytes(m), sent[i]) for m, i in zip(bufs, (5, 0, 3, 2)))
    engine._reader._buffers.take = pool_take
    # unaligned or short-of-a-page buffers: the pooled path, one copy, same bytes
    odd = bytearray(16 * PAGE + 1)
    assert engine.get_many_placed([key(4)], [memoryview(odd)[1:]]) == [(0, len(sent[4]))]
    assert same_block(bytes(odd[1:1 + len(sent[4])]), sent[4])
    st = engine.statistics()
    assert (st.hits, st.misses, st.get_bytes) == (11, 0, 11 * 16 * PAGE)
    engine.close()


def test_get_many_placed_mixes_open_region_flash_and_misses(busy):
    ids = [16, 0, 99, 6, 15, 3]
    bufs = [bytearray(PAYLOAD_5_PER_REGION + HEADER_SIZE) for _ in ids]
    placed = busy.get_many_placed([key(i) for i in ids], bufs)
    full = PAYLOAD_5_PER_REGION + HEADER_SIZE
    assert placed == [(0, full), (0, full), None, (0, full), (0, full), None]
    for i, b, where in zip(ids, bufs, placed):
        if where is not None:
            assert same_block(bytes(b[:full]), block(i, PAYLOAD_5_PER_REGION))


def test_get_many_placed_checks_every_buffer_before_reading(busy):
    small = bytearray(100)
    before = busy.statistics()
    with pytest.raises(EngineError, match="too small"):
        busy.get_many_placed([key(0), key(1)], [bytearray(300_000), small])
    with pytest.raises(ValueError, match="buffers"):
        busy.get_many_placed([key(0)], [])
    with pytest.raises(ValueError, match="read-only"):
        busy.get_many_placed([key(0)], [bytes(300_000)])
    assert busy.get_many_placed([key(99)], [small]) == [None]  # a miss needs no room
    after = busy.statistics()
    assert (after.hits, after.misses) == (before.hits, before.misses + 1)


def odd_block(i: int, nbytes: int) -> bytes:
    """A block of ``nbytes`` (not a page multiple): blocks after it start unaligned."""
    payload = np.random.default_rng(1000 + i).integers(0, 256, nbytes - HEADER_SIZE, dtype=np.uint8).tobytes()
    return encode_block(key(i), NS, 1, payload)


def aligned_range(loc) -> int:
    first = loc.logical_offset // PAGE * PAGE
    return -(-(loc.logical_offset + loc.length) // PAGE) * PAGE - first


def test_get_many_placed_reads_unaligned_blocks_straight_into_the_buffer():
    engine, _, _ = mem_engine(regions=4)
    sent = {i: odd_block(i, 3 * PAGE + 1000 + 77 * i) for i in range(6)}
    engine.put_many(list(sent.values()))
    seal(engine)
    sent[6] = odd_block(6, 5000)
    engine.put(sent[6])  # in the open region: copied, at offset 0
    ids = [5, 0, 6, 3, 99, 1]
    locs = engine.locate_many([key(i) for i in ids])
    assert sum(1 for loc in locs if loc is not None and loc.logical_offset % PAGE) == 3  # 5, 3, 1

    def no_pool(nbytes):
        raise AssertionError("a buffer holding the aligned range must be read into directly")

    engine._reader._buffers.take = no_pool
    bufs = [aligned_buffer(aligned_range(loc) if loc else PAGE) for loc in locs]
    placed = engine.get_many_placed([key(i) for i in ids], bufs)
    assert placed[4] is None
    for i, loc, buf, where in zip(ids, locs, bufs, placed):
        if loc is None:
            continue
        offset, size = where
        assert size == len(sent[i]) and same_block(bytes(buf[offset:offset + size]), sent[i])
        assert offset == (loc.logical_offset % PAGE if loc.sealed else 0)
    st = engine.statistics()
    assert (st.hits, st.misses) == (5, 1)
    engine.close()


def test_get_many_placed_copies_to_offset_zero_when_the_buffer_is_small_or_unaligned():
    engine, _, _ = mem_engine(regions=4)
    first, second = odd_block(1, 2 * PAGE + 100), odd_block(2, 2 * PAGE + 300)
    engine.put_many([first, second])
    seal(engine)
    exact = bytearray(len(second))  # holds the block, not its aligned range
    odd = memoryview(bytearray(4 * PAGE + 1))[1:]  # room enough, not page-aligned
    assert engine.get_many_placed([key(2), key(2)], [exact, odd]) == [(0, len(second))] * 2
    assert same_block(bytes(exact), second) and same_block(bytes(odd[:len(second)]), second)
    with pytest.raises(EngineError, match="too small"):
        engine.get_many_placed([key(1)], [bytearray(len(first) - 1)])
    engine.close()


@pytest.mark.parametrize("verify_payload", [True, False])
def test_placed_reads_leave_the_payload_crc_to_the_reader_unless_asked(verify_payload):
    """Without ``verify_payload`` a flipped payload byte passes the engine (the reader's CRC
    check catches it; the daemon's GET works that way), with it the block is a miss and is
    dropped. A flipped header byte is caught either way."""
    engine, _, devs = mem_engine(regions=4, devices=1)
    blocks = [odd_block(i, 2 * PAGE + 500) for i in range(3)]
    engine.put_many(blocks)
    seal(engine)
    payload_loc, header_loc = engine.locate_many([key(1), key(2)])
    for loc, at in ((payload_loc, HEADER_SIZE + 10), (header_loc, 20)):
        devs[0].data[engine.geometry.map_range(loc.logical_offset + at, 1)[0][1]] ^= 0xFF
    bufs = [aligned_buffer(4 * PAGE) for _ in range(3)]
    placed = engine.get_many_placed([key(i) for i in range(3)], bufs, verify_payload=verify_payload)
    offset, size = placed[0]
    assert same_block(bytes(bufs[0][offset:offset + size]), blocks[0])
    assert placed[2] is None and engine.lookup([key(2)]) == 0
    if verify_payload:
        assert placed[1] is None and engine.lookup([key(1)]) == 0
        assert engine.statistics().corrupt_reads == 2
    else:
        offset, size = placed[1]
        with pytest.raises(BlockFormatError, match="payload CRC"):
            verify_block(bufs[1][offset:offset + size], key(1))
        assert engine.lookup([key(1)]) == 1 and engine.statistics().corrupt_reads == 1
    engine.close()


def test_a_corrupt_block_read_into_a_callers_buffer_is_a_miss():
    engine, _, devs = mem_engine(regions=4, devices=1)
    engine.put(page_block(1, 4))
    engine.put(page_block(2, 4))
    seal(engine)
    loc = engine.locate_many([key(1)])[0]
    dev_off = engine.geometry.map_range(loc.logical_offset + HEADER_SIZE + 10, 1)[0][1]
    from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES
    assert dev_off >= DATA_OFFSET_BYTES
    devs[0].data[dev_off] ^= 0xFF
    buf = aligned_buffer(4 * PAGE)
    assert engine.get_many_placed([key(1)], [buf]) == [None]
    assert engine.get_many_placed([key(2)], [buf]) == [(0, 4 * PAGE)]
    st = engine.statistics()
    assert st.corrupt_reads == 1 and engine.lookup([key(1)]) == 0
    engine.close()


# -- exact order and bookkeeping of the vectorized paths -------------------------
def test_a_batch_read_touches_regions_in_the_order_of_their_last_block():
    engine, _, _ = mem_engine(regions=5, eviction="lru")
    fill(engine, range(20))  # regions 0..3 hold 0-4, 5-9, 10-14, 15-19 (3 is open, 4 the clean reserve)
    seal(engine)
    engine.get_many([key(1), key(6), key(2), key(11)])  # last touches: 0 (key 2), then 2 (key 11)
    assert list(engine._table.policy.candidates())[-3:] == [1, 0, 2]
    fill(engine, [20])  # reclaims the LRU region: 3 (sealed by the flush, never read)
    assert present(engine, range(21)) == list(range(15)) + [20]
    fill(engine, range(21, 26))  # then region 1
    assert present(engine, range(26)) == [0, 1, 2, 3, 4] + list(range(10, 15)) + list(range(20, 26))
    engine.close()


def test_vectorized_pin_and_unpin_keep_the_accounting(busy):
    table = busy._table
    pinned_before = int(table.pinned_bytes.sum())
    full = PAYLOAD_5_PER_REGION + HEADER_SIZE
    assert busy.pin_many([key(1), key(1), key(6), key(99), key(16)]) == [True, True, True, False, True]
    assert int(table.pinned_bytes.sum()) == pinned_before + 2 * full  # 6 was pinned already
    slots = busy._index.find_many(*np.array([[int.from_bytes(key(i)[:8], "little"),
                                              int.from_bytes(key(i)[8:], "little")] for i in (1, 6, 16)],
                                            np.uint64).T)
    assert np.all(busy._index.meta[slots] & np.uint32(PINNED_BIT))
    seqs = [busy.block_info(key(i))["seq"] for i in (1, 6, 16)]
    assert busy.unpin_many([key(6), key(1), key(2)]) == [True, True, True]
    assert int(table.pinned_bytes.sum()) == pinned_before + full - full  # 16 stays, 6 unpinned
    assert [busy.block_info(key(i))["pinned"] for i in (1, 6, 16)] == [False, False, True]
    assert [busy.block_info(key(i))["seq"] for i in (1, 6, 16)] == seqs  # pins never move a block
    assert busy.delete_many([key(16), key(16), key(5)]) == [True, True, True]
    assert int(table.pinned_bytes.sum()) == pinned_before - full


def test_a_get_of_located_blocks_reads_them_where_they_were_found():
    """get_many_placed with ``located`` (a GET's one resolve): blocks on flash are read at the located
    place, and the GET answers as of its locate: a block deleted or stored again since is served as
    located (those bytes are still its own, key and seq checked). One that fails its check there is
    located anew (here it is still indexed there: dropped as corrupt, a miss); one still in the open
    image is copied from it."""
    from kvtier.daemon.engine.superblock import DATA_OFFSET_BYTES
    engine, _, devs = mem_engine(regions=6, devices=1)
    sent = {i: page_block(i, 4) for i in range(4)}
    engine.put_many(list(sent.values()))
    seal(engine)
    engine.put(page_block(9, 4))  # in the open image
    ids = [0, 1, 2, 3, 9]
    rows = engine.locate_buffer(keys_buffer(ids), for_read=True)
    assert rows["found"].all() and rows["sealed"].tolist() == [True, True, True, True, False]
    assert engine.delete_many([key(1), key(2)]) == [True, True]
    engine.put(page_block(2, 5))  # key 2 again, another block
    dev_off = engine.geometry.map_range(int(rows["logical_offset"][3]) + HEADER_SIZE + 10, 1)[0][1]
    assert dev_off >= DATA_OFFSET_BYTES
    devs[0].data[dev_off] ^= 0xFF  # key 3's payload, where it was located
    bufs = [aligned_buffer(8 * PAGE) for _ in ids]
    placed = engine.get_many_placed([key(i) for i in ids], bufs, located=rows)
    assert placed[3] is None and engine.statistics().corrupt_reads == 1 and engine.lookup([key(3)]) == 0
    for i, b, where in zip(ids, bufs, placed):
        if i != 3:
            assert where is not None and same_block(bytes(b[where[0]:where[0] + where[1]]),
                                                    sent.get(i, page_block(9, 4)))
    assert engine.get_many_placed([key(1), key(2)], bufs[:2]) == [None, (0, 5 * PAGE)]  # located now
    with pytest.raises(ValueError, match="located rows"):
        engine.get_many_placed([key(0)], [bufs[0]], located=rows[:2])
    engine.close()
