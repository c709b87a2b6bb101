"""Direct reader: striped device files -> aligned O_DIRECT reads -> verified blocks.

These tests lay blocks out on real files with the same RAID0 mapping the
daemon uses (``StripeGeometry``); the end-to-end tests against a running
kvtierd (same bytes as TCP, recycled regions) are in test_kvcache_direct.py.
"""
from __future__ import annotations

import os

import pytest

from kvtier.common.blockformat import encode_block, stamp_sequence
from kvtier.common.aligned import ALIGNMENT_BYTES
from kvtier.client.direct_reader import (DirectLocation, DirectReader, choose_backend,
                                         kvikio_available, libcuda_available)
from kvtier.common.stripe import StripeGeometry

STRIPE = 64 * 1024
DATA_OFFSET = 4096
DEV_BYTES = 8 * STRIPE
NS = bytes(range(16))


def make_devices(tmp_path, n=3):
    ids = tuple(f"{i:032x}" for i in range(1, n + 1))
    geom = StripeGeometry(ids, STRIPE, DATA_OFFSET, DEV_BYTES)
    paths = {}
    for dev_id in ids:
        p = tmp_path / f"dev-{dev_id[-4:]}"
        p.write_bytes(b"\0" * (DATA_OFFSET + DEV_BYTES))
        paths[dev_id] = str(p)
    return geom, paths


def write_logical(geom, paths, offset, data):
    pos = 0
    for dev, dev_off, length in geom.map_range(offset, len(data)):
        with open(paths[geom.device_ids[dev]], "r+b") as f:
            f.seek(dev_off)
            f.write(data[pos:pos + length])
        pos += length


def block(i: int, size: int, seq: int) -> bytes:
    key = i.to_bytes(16, "little")
    buf = bytearray(encode_block(key, NS, 1, bytes([i % 251]) * size))
    stamp_sequence(buf, seq)
    return bytes(buf)


def lay_out(geom, paths, sizes, start=1000):
    """Blocks packed back to back from an unaligned offset (as a region packs them)."""
    keys, locs, blocks, off = [], [], [], start
    for i, size in enumerate(sizes):
        blk = block(i, size, seq=100 + i)
        write_logical(geom, paths, off, blk)
        keys.append(i.to_bytes(16, "little"))
        locs.append(DirectLocation(off, len(blk), 100 + i))
        blocks.append(blk)
        off += len(blk)
    return keys, locs, blocks


def test_reads_blocks_across_stripe_units_and_devices(tmp_path):
    geom, paths = make_devices(tmp_path)
    # sizes chosen so blocks straddle stripe units (and so devices)
    keys, locs, blocks = lay_out(geom, paths, [5000, 70000, 123, 150000, 4096 - 64])
    with DirectReader(geom, paths, backend="posix") as reader:
        got = reader.read_many(keys, locs)
        assert [bytes(g) for g in got] == blocks
        stats = reader.statistics()
    assert stats.blocks_read == 5 and stats.validation_failures == 0
    assert stats.o_direct  # ext4 / xfs accept O_DIRECT
    assert stats.bytes_read % ALIGNMENT_BYTES == 0


def test_reads_in_any_order_and_subsets(tmp_path):
    geom, paths = make_devices(tmp_path, n=2)
    keys, locs, blocks = lay_out(geom, paths, [9000, 20000, 300000, 7])
    order = [3, 0, 2]
    with DirectReader(geom, paths) as reader:
        got = reader.read_many([keys[i] for i in order], [locs[i] for i in order])
    assert [bytes(g) for g in got] == [blocks[i] for i in order]


def test_recycled_location_is_a_miss_not_data(tmp_path):
    geom, paths = make_devices(tmp_path)
    keys, locs, blocks = lay_out(geom, paths, [10000, 10000, 10000])
    # the daemon recycled the region: block 1's bytes now hold another block
    other = block(77, 10000, seq=999)
    write_logical(geom, paths, locs[1].logical_offset, other)
    # block 2 was rewritten in place with a newer sequence (same key)
    newer = block(2, 10000, seq=555)
    write_logical(geom, paths, locs[2].logical_offset, newer)
    with DirectReader(geom, paths) as reader:
        got = reader.read_many(keys, locs)
        assert bytes(got[0]) == blocks[0]
        assert got[1] is None and got[2] is None
        assert reader.statistics().validation_failures == 2


def test_torn_payload_is_a_miss(tmp_path):
    geom, paths = make_devices(tmp_path)
    keys, locs, _ = lay_out(geom, paths, [30000])
    write_logical(geom, paths, locs[0].logical_offset + 20000, b"\xff" * 16)
    with DirectReader(geom, paths) as reader:
        assert reader.read_many(keys, locs) == [None]


def test_missing_device_mapping_is_a_clear_error(tmp_path):
    geom, paths = make_devices(tmp_path)
    del paths[geom.device_ids[1]]
    with pytest.raises(ValueError, match=geom.device_ids[1]):
        DirectReader(geom, paths)


def test_location_outside_logical_space_is_an_error(tmp_path):
    geom, paths = make_devices(tmp_path, n=1)
    with DirectReader(geom, paths) as reader:
        with pytest.raises(ValueError, match="outside"):
            reader.read_many([b"k" * 16], [DirectLocation(DEV_BYTES - 10, 100, 1)])


def test_short_device_is_an_io_error_not_a_miss(tmp_path):
    geom, paths = make_devices(tmp_path, n=1)
    keys, locs, _ = lay_out(geom, paths, [5000])
    os.truncate(paths[geom.device_ids[0]], DATA_OFFSET + 4096)
    with DirectReader(geom, paths) as reader:
        with pytest.raises(OSError, match="short direct read"):
            reader.read_many(keys, locs)
        assert reader.statistics().io_errors == 1


def test_backend_choice_follows_capabilities():
    assert choose_backend("posix") == "posix"
    assert choose_backend("auto") == "posix"  # kvikio into host buffers gains nothing: only on request
    if not kvikio_available():
        with pytest.raises(ValueError, match="libcuda.so.1"):
            choose_backend("kvikio")
    with pytest.raises(ValueError, match="backend"):
        choose_backend("gds")


@pytest.mark.gpu
@pytest.mark.skipif(not kvikio_available(),
                    reason=f"kvikio needs libcuda.so.1 (loads: {libcuda_available()}) and the kvikio package")
def test_kvikio_backend_reads_the_same_bytes(tmp_path):
    geom, paths = make_devices(tmp_path)
    keys, locs, blocks = lay_out(geom, paths, [5000, 70000])
    with DirectReader(geom, paths, backend="kvikio") as reader:
        assert [bytes(g) for g in reader.read_many(keys, locs)] == blocks
