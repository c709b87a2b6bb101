"""Blocks served as the device memory they lie in (Engine.blocks_in_memory): for a transfer posted
straight from memory-backed devices (NIXL WRITEs), with the header checked there first; and which
devices are memory-backed (daemon/engine/memory_backed.py, Device.memory)."""
from __future__ import annotations

import os

import pytest

from kvtier.common.aligned import aligned_buffer
from kvtier.common.blockformat import decode_header
from kvtier.daemon.engine import Engine, EngineConfig
from kvtier.daemon.engine.devices import FaultyDevice, FileDevice
from kvtier.daemon.engine.memory_backed import filesystem_type, on_memory_filesystem

from test_engine import block, key, mem_engine, same_block, seal

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
24 22 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1k
30 22 0:27 / /var/tmp/ram\\040disk rw - ramfs ramfs rw
31 22 0:28 / /mnt rw - xfs /dev/sdb rw
32 31 0:29 / /mnt rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize("path,fs", [
    ("/var/tmp/x", "ext4"), ("/dev/shm/kvtier/dev0", "tmpfs"), ("/dev/shmem", "devtmpfs"),
    ("/var/tmp/ram disk/dev0", "ramfs"), ("/mnt/dev0", "tmpfs"),  # the later mount over /mnt wins
])
def test_the_filesystem_of_a_path_is_its_longest_mount_point(path, fs):
    assert filesystem_type(path, MOUNTINFO) == fs


def test_a_path_under_no_mount_point_has_no_filesystem_type():
    assert filesystem_type("relative/path", MOUNTINFO) is None and filesystem_type("/x", "garbage\n") is None


def test_only_a_device_file_on_a_memory_filesystem_has_memory(tmp_path):
    shm = "/dev/shm"
    if not on_memory_filesystem(shm):
        pytest.skip("/dev/shm is not a memory filesystem here")
    on_flash = FileDevice(tmp_path / "dev0", create_size_bytes=1 << 20)
    in_ram = FileDevice(f"{shm}/kvtier-test-{os.getpid()}", create_size_bytes=1 << 20)
    try:
        assert not on_memory_filesystem(str(tmp_path)) and on_flash.memory() is None
        memory = in_ram.memory()
        assert memory is not None and memory.readonly and memory.nbytes == 1 << 20
        page = bytearray(os.urandom(4096))
        buf = aligned_buffer(4096)
        buf[:] = page
        in_ram.write(8192, [buf])
        assert bytes(memory[8192:12288]) == bytes(page)  # the mapping sees every write
        assert FaultyDevice(in_ram).memory() is None  # faults cannot be injected into a mapping
    finally:
        on_flash.close()
        in_ram.close()
        os.unlink(in_ram.name)


def _joined(found) -> bytes:
    return b"".join(bytes(piece) for piece in found.pieces)


def test_blocks_on_memory_devices_come_back_as_the_pieces_they_lie_in():
    engine, _, _ = mem_engine()
    try:
        blocks = [block(i, 300_000 + 999 * i) for i in range(4)]  # over two or more 256 KiB stripe units each
        engine.put_many(blocks)
        seal(engine)
        found = engine.blocks_in_memory([key(i) for i in range(4)] + [key(99)])
        assert found[-1] is None
        for i, f in enumerate(found[:-1]):
            assert len(f.pieces) > 1 and f.length == len(blocks[i]) and same_block(_joined(f), blocks[i])
            assert decode_header(_joined(f)).seq == f.seq
        stats = engine.statistics()
        assert stats.hits == 4 and stats.misses == 0  # the absent key is counted by the caller's own read
    finally:
        engine.close()


def test_a_block_only_in_a_dram_image_is_not_served_from_device_memory():
    engine, _, _ = mem_engine()
    try:
        engine.put_many([block(1), block(2)])
        assert engine.blocks_in_memory([key(1), key(2)]) == [None, None]  # buffered: not on the devices yet
        engine.flush()
        assert all(f is not None for f in engine.blocks_in_memory([key(1), key(2)]))  # written in place, synced
    finally:
        engine.close()


def test_a_block_whose_header_no_longer_matches_is_left_to_the_usual_read():
    engine, _, devs = mem_engine()
    try:
        engine.put_many([block(1, 5000)])
        seal(engine)
        (found,) = engine.blocks_in_memory([key(1)])
        device = next(d for d in devs if bytes(d.memory()).find(bytes(found.pieces[0][:64])) >= 0)
        at = bytes(device.memory()).find(bytes(found.pieces[0][:64]))
        device.data[at + 48] ^= 1  # the seq in the header (a region rewritten under the index)
        assert engine.blocks_in_memory([key(1)]) == [None]
        assert engine.get(key(1)) is None  # the usual read finds it corrupt and drops it
    finally:
        engine.close()


def test_devices_that_are_not_all_memory_serve_nothing_from_memory(tmp_path):
    cfg = EngineConfig(device_paths=(str(tmp_path / "d0"),), stripe_size_bytes=1 << 20, region_size_bytes=4 << 20)
    devs = [FileDevice(tmp_path / "d0", create_size_bytes=(1 << 20) + (16 << 20))]
    Engine.format(cfg, devices=devs)
    engine = Engine.open(cfg, devices=devs)
    try:
        engine.put_many([block(1)])
        engine.flush()
        assert engine.device_memories() is None and engine.blocks_in_memory([key(1)]) == [None]
        assert same_block(engine.get(key(1)), block(1))
    finally:
        engine.close()
