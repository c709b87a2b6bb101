"""One conformance suite for every Device (O_DIRECT file, loop block device,
memory, fault-injecting wrapper), plus fault injection and RAID0 striping."""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.common.stripe import StripeGeometry
from kvtier.daemon.engine.devicelock import flock_holder_pid
from kvtier.daemon.engine.devices import DeviceError, FaultyDevice, FileDevice, MemoryDevice
from kvtier.common.aligned import ALIGNMENT_BYTES, aligned_buffer
from kvtier.daemon.engine.raid0 import StripedArray

SIZE = 1 << 20
PAGE = ALIGNMENT_BYTES


def _loop_device(tmp_path):
    backing = tmp_path / "loop.img"
    backing.write_bytes(b"\0" * SIZE)
    try:
        out = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"losetup unavailable: {exc}")
    if out.returncode != 0:
        pytest.skip(f"losetup failed (needs root): {out.stderr.strip()}")
    return out.stdout.strip()


@pytest.fixture(params=["file", pytest.param("loop", marks=pytest.mark.root), "memory", "faulty"])
def device(request, tmp_path):
    if request.param == "file":
        dev = FileDevice(tmp_path / "dev.img", create_size_bytes=SIZE)
    elif request.param == "loop":
        path = _loop_device(tmp_path)
        request.addfinalizer(lambda: subprocess.run(["losetup", "-d", path], timeout=10))
        dev = FileDevice(path)
        assert dev.is_block_device
    elif request.param == "memory":
        dev = MemoryDevice(SIZE)
    else:
        dev = FaultyDevice(MemoryDevice(SIZE))
    yield dev
    dev.close()


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_size_and_fresh_device_reads_zeros(device):
    assert device.size_bytes == SIZE
    buf = aligned_buffer(PAGE)
    buf[:] = b"\xff" * PAGE
    device.read_into(SIZE - PAGE, [buf])
    assert bytes(buf) == bytes(PAGE)


def test_vectored_write_then_read_roundtrip(device):
    src = [aligned_buffer(PAGE), aligned_buffer(3 * PAGE)]
    src[0][:] = pattern(PAGE, 1)
    src[1][:] = pattern(3 * PAGE, 2)
    device.write(8 * PAGE, src)
    device.sync()
    dst = aligned_buffer(4 * PAGE)
    device.read_into(8 * PAGE, [dst])
    assert bytes(dst) == pattern(PAGE, 1) + pattern(3 * PAGE, 2)
    parts = [aligned_buffer(2 * PAGE), aligned_buffer(2 * PAGE)]
    device.read_into(8 * PAGE, parts)
    assert bytes(parts[0]) + bytes(parts[1]) == bytes(dst)


def test_misaligned_and_out_of_range_io_is_refused_naming_the_device(device):
    buf = aligned_buffer(2 * PAGE)
    with pytest.raises(ValueError, match="offset 100"):
        device.read_into(100, [buf])
    with pytest.raises(ValueError, match="aligned"):
        device.write(0, [buf[:100]])
    with pytest.raises(ValueError, match="aligned"):
        device.write(0, [buf[512:512 + PAGE]])  # address not page-aligned
    with pytest.raises(ValueError, match=f"past the end.*{SIZE}"):
        device.read_into(SIZE - PAGE, [buf])
    with pytest.raises(ValueError, match=device.name.replace("(", r"\(").replace(")", r"\)")):
        device.read_into(1, [buf])


def test_missing_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(DeviceError, match="nothere.img does not exist"):
        FileDevice(tmp_path / "nothere.img")


def test_a_second_open_of_a_device_file_is_refused_naming_the_holder(tmp_path):
    first = FileDevice(tmp_path / "held.img", create_size_bytes=1 << 20)
    try:
        assert flock_holder_pid(os.stat(tmp_path / "held.img")) == os.getpid()
        with pytest.raises(DeviceError, match=f"held.img is in use: locked by process {os.getpid()}"):
            FileDevice(tmp_path / "held.img")  # the flock is per open file: refused in this process too
    finally:
        first.close()
    assert flock_holder_pid(os.stat(tmp_path / "held.img")) is None
    FileDevice(tmp_path / "held.img").close()  # closing released it


@pytest.mark.root
def test_a_second_open_of_a_block_device_is_refused_by_o_excl(tmp_path):
    path = _loop_device(tmp_path)
    try:
        first = FileDevice(path)
        try:
            assert first.is_block_device
            with pytest.raises(DeviceError, match=f"^device {path} is in use: opened exclusively"):
                FileDevice(path)
        finally:
            first.close()
        FileDevice(path).close()  # closing released it
    finally:
        subprocess.run(["losetup", "-d", path], timeout=10)


def test_the_lock_holder_is_read_from_proc_locks_lines(tmp_path):
    st = os.stat(tmp_path)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    locks = tmp_path / "locks"
    locks.write_text(f"1: POSIX  ADVISORY  WRITE 11 {inode} 0 EOF\n"
                     f"2: FLOCK  ADVISORY  WRITE 22 00:01:5 0 EOF\n"
                     f"2: -> FLOCK  ADVISORY  WRITE 33 {inode} 0 EOF\n"
                     f"3: FLOCK  ADVISORY  WRITE 44 {inode} 0 EOF\n")
    assert flock_holder_pid(st, str(locks)) == 44  # not the POSIX lock, nor the waiter ("->")
    assert flock_holder_pid(st, str(tmp_path / "absent")) is None


def test_a_created_file_has_its_space_reserved(tmp_path):
    dev = FileDevice(tmp_path / "new.img", create_size_bytes=8 << 20)
    try:
        st = os.stat(tmp_path / "new.img")
        assert dev.created and st.st_size == 8 << 20 and st.st_blocks * 512 >= 8 << 20
    finally:
        dev.close()
    again = FileDevice(tmp_path / "new.img", create_size_bytes=8 << 20)
    assert not again.created
    again.close()


@pytest.mark.root
def test_a_filesystem_without_fallocate_gets_a_sparse_file_and_a_warning(tmp_path, caplog):
    """ext2 has no fallocate: glibc's fallback writes single bytes, which O_DIRECT refuses."""
    image, mnt = tmp_path / "ext2.img", tmp_path / "mnt"
    mnt.mkdir()
    image.write_bytes(b"")
    os.truncate(image, 32 << 20)
    if subprocess.run(["mkfs.ext2", "-q", "-F", str(image)], capture_output=True).returncode != 0:
        pytest.skip("mkfs.ext2 is not available")
    if subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot loop-mount an ext2 image here")
    try:
        with caplog.at_level("WARNING", logger="kvtier.daemon.engine"):
            dev = FileDevice(mnt / "dev.img", create_size_bytes=8 << 20)
        try:
            st = os.stat(mnt / "dev.img")
            assert st.st_size == 8 << 20 and st.st_blocks * 512 < 1 << 20
            assert "event=device_sparse" in caplog.text and "dev.img" in caplog.text
            block = aligned_buffer(ALIGNMENT_BYTES)
            block[:] = os.urandom(ALIGNMENT_BYTES)
            dev.write(4096, [block])  # O_DIRECT writes work on the sparse file
        finally:
            dev.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_file_device_is_opened_o_direct(tmp_path):
    dev = FileDevice(tmp_path / "d.img", create_size_bytes=SIZE)
    try:
        import fcntl
        assert fcntl.fcntl(dev._fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        dev.close()


def test_faulty_device_injects_errors_and_torn_writes():
    inner = MemoryDevice(SIZE)
    dev = FaultyDevice(inner)
    buf = aligned_buffer(2 * PAGE)
    buf[:] = b"\xab" * (2 * PAGE)
    dev.arm_torn_write(PAGE + 700)  # rounded down to a sector: 4096 + 512 bytes land
    with pytest.raises(DeviceError, match="torn write"):
        dev.write(0, [buf])
    assert bytes(inner.data[:PAGE + 512]) == b"\xab" * (PAGE + 512)
    assert bytes(inner.data[PAGE + 512:2 * PAGE]) == bytes(PAGE - 512)
    dev.write(0, [buf])  # armed once only
    dev.fail_reads = True
    with pytest.raises(DeviceError, match=r"read fault on faulty\(mem\)"):
        dev.read_into(0, [buf])
    dev.fail_reads = False
    dev.writes_until_failure = 1
    dev.write(0, [buf])
    with pytest.raises(DeviceError, match="write fault"):
        dev.write(0, [buf])
    dev.fail_syncs = True
    with pytest.raises(DeviceError, match="sync fault"):
        dev.sync()
    assert dev.statistics().injected_faults == 4


def test_torn_write_on_an_o_direct_file(tmp_path):
    dev = FaultyDevice(FileDevice(tmp_path / "t.img", create_size_bytes=SIZE))
    buf = aligned_buffer(2 * PAGE)
    buf[:] = b"\xcd" * (2 * PAGE)
    dev.arm_torn_write(1024)
    with pytest.raises(DeviceError):
        dev.write(PAGE, [buf])
    out = aligned_buffer(2 * PAGE)
    dev.read_into(PAGE, [out])
    assert bytes(out) == b"\xcd" * 1024 + bytes(2 * PAGE - 1024)
    dev.close()


def test_striped_array_places_units_as_stripe_geometry_says():
    devs = [MemoryDevice(SIZE, f"m{i}") for i in range(3)]
    unit = 2 * PAGE
    geo = StripeGeometry(("a", "b", "c"), unit, PAGE, SIZE - PAGE - (SIZE - PAGE) % unit)
    with ThreadPoolExecutor(4) as pool:
        array = StripedArray(devs, geo, pool)
        data = aligned_buffer(20 * PAGE)
        data[:] = pattern(20 * PAGE, 3)
        array.write(2 * unit, data)
        pos = 0
        for dev, dev_off, length in geo.map_range(2 * unit, 20 * PAGE):
            assert bytes(devs[dev].data[dev_off:dev_off + length]) == bytes(data[pos:pos + length])
            pos += length
        back = aligned_buffer(20 * PAGE)
        array.read(2 * unit, back)
        assert bytes(back) == bytes(data)
        plan = array.plan(0, aligned_buffer(6 * unit))
        assert {dev: len(runs) for dev, runs in plan.items()} == {0: 1, 1: 1, 2: 1}  # contiguous per device: 1 iovec run
        assert all(len(bufs) == 2 for runs in plan.values() for _, bufs in runs)


def test_striped_array_reports_the_failing_device():
    devs = [MemoryDevice(SIZE, "m0"), FaultyDevice(MemoryDevice(SIZE, "m1"))]
    devs[1].fail_writes = True
    geo = StripeGeometry(("a", "b"), PAGE, PAGE, SIZE - PAGE)
    with ThreadPoolExecutor(2) as pool:
        array = StripedArray(devs, geo, pool)
        with pytest.raises(DeviceError, match=r"faulty\(m1\)"):
            array.write(0, aligned_buffer(4 * PAGE))


def test_huge_page_buffers_are_zeroed_aligned_and_writable():
    from kvtier.common.aligned import HUGE_PAGE_BYTES, aligned_buffer, is_aligned
    for size, populate in ((2 * HUGE_PAGE_BYTES, True), (HUGE_PAGE_BYTES + 4096, False), (8192, True)):
        buf = aligned_buffer(size, populate=populate, huge=True)
        assert buf.nbytes == size and is_aligned(buf) and not buf.readonly
        assert not any(buf[::4096])
        buf[-1] = 7
        assert buf[-1] == 7
