"""A NIXL_GET's WRITE cut into notified parts (daemon/nixl/parts.py), and the client's check of
blocks as their parts arrive (client/nixl_arrivals.py): pure, no NIXL."""
from __future__ import annotations

import os

import pytest

from kvtier.client.nixl_arrivals import ArrivingBlocks
from kvtier.client.scatter_plan import LandedBlock
from kvtier.common.blockformat import BlockFormatError, encode_block
from kvtier.daemon.nixl.parts import plan_parts

KEY, NS = b"\x01" * 16, b"\x02" * 16


def test_parts_cover_every_byte_in_order_and_cut_pieces_at_the_part_size():
    items = [(0, [(1000, 10), (5000, 25)], [(90_000, 35)]), (2, [(7000, 3)], [(95_000, 3)]),
             (1, [(9000, 40)], [(99_000, 40)])]
    parts = plan_parts(items, part_bytes=16)
    assert [p.nbytes for p in parts] == [16, 16, 16, 16, 14]
    local = [piece for p in parts for piece in p.local]
    remote = [piece for p in parts for piece in p.remote]
    assert sum(n for _, n in local) == 78 and [n for _, n in local] == [n for _, n in remote]
    # the bytes of each item land back to back from its remote address, from its pieces in order
    flat_local = [a + k for a, n in local for k in range(n)]
    flat_remote = [a + k for a, n in remote for k in range(n)]
    expected = {}
    for item, pieces, ((at, _),) in items:
        for address, n in pieces:
            for k in range(n):
                expected[at] = address + k
                at += 1
    assert dict(zip(flat_remote, flat_local)) == expected
    # the notified ranges say which bytes of which item each part carried, merged where contiguous
    assert parts[0].ranges == [(0, 0, 16)]
    assert parts[1].ranges == [(0, 16, 16)]
    assert parts[2].ranges == [(0, 32, 3), (2, 0, 3), (1, 0, 10)]
    ranges = sorted(r for p in parts for r in p.ranges)
    assert sum(n for _, _, n in ranges) == 78


def test_pieces_are_cut_where_the_remote_extents_end():
    parts = plan_parts([(3, [(1000, 10), (2000, 6)], [(50, 4), (80, 8), (200, 4)])], part_bytes=1 << 20)
    (part,) = parts
    assert part.local == [(1000, 4), (1004, 6), (2000, 2), (2002, 4)]
    assert part.remote == [(50, 4), (80, 6), (86, 2), (200, 4)]
    assert part.ranges == [(3, 0, 16)]


def test_a_part_names_at_most_ranges_max_ranges():
    parts = plan_parts([(i, [(100 * i + 4096, 1)], [(1 << 20 | i * 8, 1)]) for i in range(10)], part_bytes=1 << 20,
                       ranges_max=4)
    assert [len(p.ranges) for p in parts] == [4, 4, 2]


def test_a_part_size_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        plan_parts([], part_bytes=0)


def _landed(payload_bytes: int = 100_000, seq: int = 9, slot: int = 1 << 17):
    block = encode_block(KEY, NS, 0, os.urandom(payload_bytes), seq)
    buffer = bytearray(2 * slot)
    buffer[slot:slot + len(block)] = block
    view = memoryview(buffer)
    return block, ArrivingBlocks([[view[:slot]], [view[slot:]]]), buffer


def test_a_block_arriving_in_any_order_is_verified_as_it_comes():
    block, arriving, _ = _landed()
    n = len(block)
    arriving.arrived(1, 60_000, n - 60_000)  # past the checked prefix: waits for the gap
    assert not arriving.covered(1, n)
    arriving.arrived(1, 0, 30)  # inside the header
    arriving.arrived(1, 30, 59_970)
    assert arriving.covered(1, n)
    assert bytes(arriving.finish(1, n, KEY, 9)) == block


def test_bytes_no_notification_covered_are_checked_at_finish():
    block, arriving, _ = _landed()
    arriving.arrived(1, 0, 1000)
    view = arriving.finish(1, len(block), KEY, 9)
    assert view.readonly and bytes(view) == block


@pytest.mark.parametrize("spoil,problem", [
    (lambda buf, at, n: buf.__setitem__(at + n - 1, buf[at + n - 1] ^ 1), "payload CRC mismatch"),
    (lambda buf, at, n: buf.__setitem__(at + 64, buf[at + 64] ^ 1), "payload CRC mismatch"),
    (lambda buf, at, n: buf.__setitem__(at + 20, buf[at + 20] ^ 1), "header CRC mismatch"),
])
@pytest.mark.parametrize("notified", ["whole", "in pieces", "never"])
def test_a_block_that_landed_corrupt_fails(spoil, problem, notified):
    block, arriving, buffer = _landed()
    spoil(buffer, 1 << 17, len(block))  # as the transfer left it (a block torn by a reclaim mid-copy)
    if notified == "whole":
        arriving.arrived(1, 0, len(block))
    elif notified == "in pieces":
        arriving.arrived(1, 5000, len(block) - 5000)
        arriving.arrived(1, 0, 5000)
    with pytest.raises(BlockFormatError, match=problem):
        arriving.finish(1, len(block), KEY, 9)


def test_the_wrong_key_seq_or_length_fails():
    block, arriving, _ = _landed()
    arriving.arrived(1, 0, len(block))
    with pytest.raises(BlockFormatError, match="not the expected"):
        arriving.finish(1, len(block), b"\x03" * 16, 9)
    with pytest.raises(BlockFormatError, match="sequence 9 is not the expected 10"):
        arriving.finish(1, len(block), KEY, 10)
    with pytest.raises(BlockFormatError, match="header says"):
        arriving.finish(1, len(block) - 1, KEY, 9)
    with pytest.raises(BlockFormatError, match="does not fill its"):
        arriving.finish(1, (1 << 17) + 1, KEY, 9)


def test_ranges_outside_an_items_room_are_ignored():
    block, arriving, _ = _landed()
    for item, offset, length in [(2, 0, 10), (-1, 0, 10), (1, -5, 10), (1, 0, 0), (1, (1 << 17) - 5, 10)]:
        arriving.arrived(item, offset, length)
    assert not arriving.covered(1, 1)
    assert bytes(arriving.finish(1, len(block), KEY, 9)) == block


def _scattered(payload_bytes: int = 50_000, head_nbytes: int = 96, rows: int = 7):
    """A block whose payload past its first ``head_nbytes`` lands in ``rows`` views of another buffer."""
    block = encode_block(KEY, NS, 0, os.urandom(payload_bytes), 4)
    rest = len(block) - head_nbytes
    cuts = [head_nbytes + rest * r // rows for r in range(rows + 1)]
    head = bytearray(block[:head_nbytes])
    out = bytearray(2 * rest)  # the engine's KV: rows at a stride, as the output tensor's are
    views = []
    for r in range(rows):
        n = cuts[r + 1] - cuts[r]
        at = r * 2 * (rest // rows + 1)
        out[at:at + n] = block[cuts[r]:cuts[r + 1]]
        views.append(memoryview(out)[at:at + n])
    return block, [memoryview(head)] + views, head, out


def test_a_scattered_block_is_verified_across_its_views_and_handed_out_as_landed():
    block, views, head, out = _scattered()
    arriving = ArrivingBlocks([views])
    arriving.arrived(0, 30_000, len(block) - 30_000)
    arriving.arrived(0, 0, 30_000)
    landed = arriving.finish(0, len(block), KEY, 4)
    assert isinstance(landed, LandedBlock) and len(landed) == len(block) and bytes(landed.head) == block[:96]
    assert b"".join(bytes(v) for v in views) == block


def test_a_scattered_block_with_a_row_torn_or_of_another_length_fails():
    block, views, head, out = _scattered()
    arriving = ArrivingBlocks([views])
    with pytest.raises(BlockFormatError, match="does not fill"):
        arriving.finish(0, len(block) - 1, KEY, 4)
    views[3][100] ^= 0xFF
    arriving.arrived(0, 0, len(block))
    with pytest.raises(BlockFormatError, match="payload CRC mismatch"):
        arriving.finish(0, len(block), KEY, 4)
