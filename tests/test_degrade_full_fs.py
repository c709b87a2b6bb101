"""A full filesystem under the device files: the daemon starts, serves what is stored, refuses
writes with DEVICE_ERROR naming the device, and takes writes again once space returns.

Real parts: an ext4 filesystem on a loop device (root), sparse device files on it (a store
whose files do not hold their space: writes into the holes need free blocks), a real kvtierd."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient, RemoteError
from kvtier.common.blockformat import encode_block, verify_block
from kvtier.wire.events import ErrorCode

FS_BYTES = 160 << 20
DEVICE_BYTES = 32 << 20


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, size: int = 5000) -> bytes:
    return encode_block(key(i), bytes(16), 1, os.urandom(size))


@pytest.fixture
def small_fs(tmp_path):
    """A 160 MiB ext4 filesystem mounted from a loop device (skips without root or the tools)."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("mkfs.ext4", "mount", "umount")):
        pytest.skip("needs root, mkfs.ext4 and mount (a loop-mounted filesystem to fill up)")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(FS_BYTES)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot loop-mount a filesystem here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path) -> None:
    """Write zeros to ``path`` until the filesystem has no block left."""
    chunk = bytes(1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        os.fsync(f.fileno())
    with open(path, "ab", buffering=0) as f:  # the last partial blocks too
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def put_until_refused(client, first: int) -> RemoteError:
    for i in range(first, first + 400):
        try:
            client.put(key(i), block(i, 400_000), durable=True)
        except RemoteError as exc:
            return exc
    raise AssertionError("puts were never refused on a full filesystem")


@pytest.mark.root
def test_full_filesystem_at_start_serves_refuses_writes_then_recovers(small_fs, tmp_path):
    devices = [small_fs / "d0", small_fs / "d1"]
    for path in devices:
        with open(path, "wb") as f:
            f.truncate(DEVICE_BYTES)  # sparse: the space is not held
    args = [a for path in devices for a in ("--device", str(path))]
    d = start_kvtierd(tmp_path / "kvtierd", *args, "--format")
    stored = {}
    try:
        with BlockClient(d.data_addr) as c:
            for i in range(10):
                stored[i] = block(i)
                c.put(key(i), stored[i], durable=True)
            fill(small_fs / "filler")
            exc = put_until_refused(c, 100)
            assert exc.code == ErrorCode.DEVICE_ERROR and str(small_fs) in str(exc) and "No space" in str(exc)
    finally:
        code = d.stop()
    assert code in (0, 3), d.log_tail()  # 3: the open region could not be sealed (unacknowledged puts lost)

    d.args = [a for a in d.args if a != "--format"]
    d.start()  # on the full filesystem
    try:
        with BlockClient(d.data_addr) as c:
            assert c.lookup([key(i) for i in range(10)]) == 10
            for i, sent in stored.items():
                got = c.get(key(i))
                assert got is not None and verify_block(got).key == key(i) and got[64:] == sent[64:]
            exc = put_until_refused(c, 1000)
            assert exc.code == ErrorCode.DEVICE_ERROR and str(small_fs) in str(exc)
            assert c.lookup([key(i) for i in range(10)]) == 10  # still served
            os.unlink(small_fs / "filler")  # space returns: writes go on, no restart needed
            c.put(key(2000), block(2000), durable=True)
            assert c.lookup([key(2000)]) == 1
    finally:
        assert d.stop() == 0, d.log_tail()
    d.start()
    try:
        with BlockClient(d.data_addr) as c:
            assert c.lookup([key(i) for i in range(10)]) == 10 and c.lookup([key(2000)]) == 1
    finally:
        assert d.stop() == 0, d.log_tail()
