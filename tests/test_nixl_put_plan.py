"""Where a NIXL_PUT has the daemon read each block (pure: addresses are numbers, no NIXL)."""
import numpy as np
import pytest

from kvtier.client.nixl_put_plan import (STAGED_ALIGN_BYTES, RegisteredMemory, joined_ranges, plan_put)
from kvtier.wire import events as m

LIMITS = dict(payload_bytes_max=64 << 20, batch_count_max=1024, meta_bytes_max=1 << 20)


def _views(*sizes):
    return [memoryview(np.zeros(n, np.uint8)) for n in sizes]


def test_pieces_in_registered_memory_are_read_in_place_and_the_rest_staged():
    head, row0, row1 = _views(80, 4096, 4096)
    registered = RegisteredMemory([(0x100000, 1 << 20)])
    frames = plan_put([[head, row0, row1]], [[0x5000, 0x100000, 0x101000]], registered, **LIMITS)
    assert len(frames) == 1
    frame = frames[0]
    # the head is staged at offset 0; the two rows are adjacent in the lent memory: one extent
    assert frame.extents == [[(0, 80, True), (0x100000, 8192, False)]]
    assert [(at, piece.nbytes) for at, piece in frame.staged] == [(0, 80)]
    assert frame.staged_bytes == STAGED_ALIGN_BYTES * 2 and frame.nbytes == 80 + 8192
    assert frame.resolved(0x900000) == (((0x900000, 80), (0x100000, 8192)),)


def test_a_piece_that_runs_past_the_registered_memory_is_staged():
    (row,) = _views(4096)
    frames = plan_put([[row]], [[0x100000 + 4096]], RegisteredMemory([(0x100000, 4096 + 100)]), **LIMITS)
    assert frames[0].extents == [[(0, 4096, True)]]


def test_staged_pieces_of_later_blocks_follow_in_the_same_buffer():
    blocks = [_views(80, 1000), _views(80, 1000)]
    addresses = [[0x10, 0x200000], [0x20, 0x200000 + 1000]]
    frames = plan_put(blocks, addresses, RegisteredMemory([(0x200000, 4096)]), **LIMITS)
    (frame,) = frames
    assert frame.extents == [[(0, 80, True), (0x200000, 1000, False)],
                             [(STAGED_ALIGN_BYTES * 2, 80, True), (0x200000 + 1000, 1000, False)]]
    assert [at for at, _ in frame.staged] == [0, STAGED_ALIGN_BYTES * 2]


def test_frames_are_cut_by_bytes_then_each_starts_its_own_staging():
    blocks = [_views(80, 12 << 20) for _ in range(3)]
    addresses = [[0x10 + i, 0x1000000 + i * (12 << 20)] for i in range(3)]
    frames = plan_put(blocks, addresses, RegisteredMemory([(0x1000000, 36 << 20)]), **LIMITS)
    assert [f.indexes for f in frames] == [[0, 1], [2]]  # 32 MiB a frame
    assert frames[1].extents[0][0] == (0, 80, True) and frames[1].staged[0][0] == 0
    assert frames[1].staged_bytes == STAGED_ALIGN_BYTES * 2


def test_frames_are_cut_by_items_and_extents():
    blocks = [_views(100) for _ in range(5)]
    addresses = [[0x1000 * (i + 1)] for i in range(5)]
    frames = plan_put(blocks, addresses, RegisteredMemory([(0x1000, 0x10000)]), **{**LIMITS, "batch_count_max": 2})
    assert [f.indexes for f in frames] == [[0, 1], [2, 3], [4]]
    meta_for_two_extents = 16 + 2 + m.NIXL_AGENT_NAME_BYTES_MAX + 2 * 20 + 2 * 12
    frames = plan_put(blocks, addresses, RegisteredMemory([(0x1000, 0x10000)]),
                      **{**LIMITS, "meta_bytes_max": meta_for_two_extents})
    assert [f.indexes for f in frames] == [[0, 1], [2, 3], [4]]


def test_a_block_over_the_payload_limit_is_refused():
    with pytest.raises(ValueError, match="over the frame payload limit"):
        plan_put([_views(100, 200)], [[0x10, 0x1000]], RegisteredMemory([]), **{**LIMITS, "payload_bytes_max": 250})


def test_empty_pieces_name_no_extent():
    head, empty, row = _views(80, 0, 100)
    (frame,) = plan_put([[head, empty, row]], [[0x10, 0, 0x1000]], RegisteredMemory([(0x1000, 100)]), **LIMITS)
    assert frame.extents == [[(0, 80, True), (0x1000, 100, False)]]


def test_joined_ranges_join_what_overlaps_or_touches():
    assert joined_ranges([(0x3000, 0x1000), (0x1000, 0x1000), (0x2000, 0x1000), (0x2400, 0x100), (0x9000, 0)]) == [
        (0x1000, 0x3000)]
    assert joined_ranges([(0x1000, 0x10), (0x2000, 0x10)]) == [(0x1000, 0x10), (0x2000, 0x10)]


def test_registered_memory_knows_what_it_holds_and_what_it_touches():
    memory = RegisteredMemory([(0x1000, 0x1000), (0x4000, 0x100)])
    assert memory.holds(0x1000, 0x1000) and not memory.holds(0x1800, 0x1000)
    assert memory.touches(0x1800, 0x1000) and memory.touches(0x0800, 0x900) and memory.touches(0x3000, 0x1001)
    assert not memory.touches(0x2000, 0x2000) and not memory.touches(0x0, 0x1000) and not memory.touches(0x4100, 8)
