"""Direct reads through NIXL's file backends (DirectReader(backend="nixl")): real striped device
files, the same validation as the O_DIRECT reader, which stays the fallback."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed (pip install 'kvtier[nixl]')")

from test_direct_read import block, lay_out, make_devices, write_logical  # noqa: E402

from kvtier.client.direct_reader import DirectReader, choose_backend  # noqa: E402
from kvtier.client.nixl_file_reads import NixlFileReads, gds_backend  # noqa: E402

GDS, GDS_WHY = gds_backend()


def test_nixl_reads_the_same_bytes_as_preadv(tmp_path):
    geom, paths = make_devices(tmp_path)
    keys, locs, blocks = lay_out(geom, paths, [5000, 70000, 123, 150000, 4096 - 64])
    with DirectReader(geom, paths, backend="nixl") as nixl, DirectReader(geom, paths, backend="posix") as posix:
        got = nixl.read_many(keys, locs)
        assert [bytes(g) for g in got] == blocks == [bytes(g) for g in posix.read_many(keys, locs)]
        stats = nixl.statistics()
    assert stats.backend == "nixl" and stats.blocks_read == 5 and stats.nixl_fallbacks == 0 and stats.o_direct


def test_recycled_and_torn_blocks_are_misses(tmp_path):
    geom, paths = make_devices(tmp_path)
    keys, locs, blocks = lay_out(geom, paths, [10000, 10000, 30000])
    write_logical(geom, paths, locs[1].logical_offset, block(77, 10000, seq=999))  # another block now
    write_logical(geom, paths, locs[2].logical_offset + 20000, b"\xff" * 16)  # a torn payload
    with DirectReader(geom, paths, backend="nixl") as reader:
        got = reader.read_many(keys, locs)
        assert bytes(got[0]) == blocks[0] and got[1] is None and got[2] is None
        assert reader.statistics().validation_failures == 2


def test_a_failed_nixl_read_is_read_again_with_preadv(tmp_path):
    geom, paths = make_devices(tmp_path, n=1)
    keys, locs, _ = lay_out(geom, paths, [5000])
    os.truncate(paths[geom.device_ids[0]], 4096)  # the block's bytes are gone: both readers fail
    with DirectReader(geom, paths, backend="nixl") as reader:
        with pytest.raises(OSError, match="short direct read"):
            reader.read_many(keys, locs)
        stats = reader.statistics()
        assert stats.nixl_fallbacks == 1 and stats.io_errors == 1


def test_file_reads_fill_host_views_from_the_file(tmp_path):
    path = tmp_path / "dev"
    path.write_bytes(os.urandom(8192))
    fd = os.open(path, os.O_RDONLY)
    try:
        reads = NixlFileReads([fd])
        view = memoryview(bytearray(4096))
        reads.read([(0, 4096, view)])
        assert bytes(view) == path.read_bytes()[4096:]
        reads.close()
    finally:
        os.close(fd)


def test_backend_choice_names_nixl():
    assert choose_backend("nixl") == "nixl"
    assert choose_backend("auto") == "posix"  # the project's own reader stays the default


@pytest.mark.skipif(GDS is None, reason=f"GPU-memory file reads: {GDS_WHY}")
def test_gds_backend_is_created_on_a_gpu_host():
    assert GDS in ("GDS_MT", "GDS")
