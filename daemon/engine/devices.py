"""Devices: flat byte spaces the engine stripes over.

Every device follows O_DIRECT's rules, even the in-memory one, so that code
tested against memory behaves the same on flash: offsets, lengths and buffer
addresses are multiples of :data:`ALIGNMENT_BYTES`. I/O is vectored (a list
of buffers, one contiguous device range), which maps 1:1 onto
``os.preadv``/``os.pwritev`` -- both release the GIL, so devices run in
parallel from a thread pool.

* :class:`FileDevice`   -- a regular file (created and sized on demand) or a
  block device, opened ``O_DIRECT``.
* :class:`MemoryDevice` -- a buffer in RAM; survives an engine "restart" in
  tests because the object outlives the engine.
* :class:`FaultyDevice` -- wraps another device and injects read/write/sync
  errors and torn writes.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence


from kvtier.common.aligned import ALIGNMENT_BYTES, address_of, aligned_buffer, align_up
from kvtier.common.views import views_past

from .devicelock import DeviceBusy, block_device_busy, lock_file
from .errors import DeviceError

log = logging.getLogger("kvtier.daemon.engine")

SECTOR_BYTES = 512  # the unit a torn write is cut at (the smallest atomic write of a drive)

class Device(ABC):
    """A flat, fixed-size byte space with O_DIRECT alignment rules."""

    name: str
    size_bytes: int

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` (in order) from ``offset``; all aligned."""
        total = self._check(offset, buffers, "read")
        if total:
            self._read(offset, buffers, total)

    def write(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Write ``buffers`` (in order) at ``offset``; all aligned."""
        total = self._check(offset, buffers, "write")
        if total:
            self._write(offset, buffers, total)

    @abstractmethod
    def sync(self) -> None:
        """Make every completed write durable (fdatasync)."""

    @abstractmethod
    def close(self) -> None:
        """Release the device (idempotent)."""

    @abstractmethod
    def _read(self, offset: int, buffers: Sequence[memoryview], total: int) -> None: ...

    @abstractmethod
    def _write(self, offset: int, buffers: Sequence[memoryview], total: int) -> None: ...

    def _check(self, offset: int, buffers: Sequence[memoryview], op: str) -> int:
        total = 0
        for buf in buffers:
            view = memoryview(buf)
            if view.nbytes % ALIGNMENT_BYTES or address_of(view) % ALIGNMENT_BYTES:
                raise ValueError(f"{op} on {self.name}: buffer of {view.nbytes} bytes is not "
                                 f"{ALIGNMENT_BYTES}-byte aligned in size and address")
            total += view.nbytes
        if offset < 0 or offset % ALIGNMENT_BYTES:
            raise ValueError(f"{op} on {self.name}: offset {offset} is not a multiple of {ALIGNMENT_BYTES}")
        if offset + total > self.size_bytes:
            raise ValueError(f"{op} on {self.name}: range {offset}+{total} is past the end ({self.size_bytes} bytes)")
        return total


class FileDevice(Device):
    """A regular file or a block device, opened O_DIRECT.

    A missing regular file is created with ``create_size_bytes``, its space
    reserved (``posix_fallocate``): a filesystem without room is an error now,
    naming the device, not a failed write later, and first writes skip block
    allocation. Without ``create_size_bytes`` a missing path raises
    :class:`DeviceError` naming it. An existing file is used as it is, sparse
    or not. The device is held exclusively while open (:mod:`.devicelock`):
    a second opener, in any process, gets a :class:`DeviceError` naming the
    device and, for a file, the holder's PID. ``created`` says whether this call made the
    file (the caller removes it if the store cannot be set up after all). A
    filesystem that cannot reserve space (no ``fallocate``: glibc then writes
    single bytes, which O_DIRECT refuses) gets a sparse file and a warning.
    """

    def __init__(self, path: str | os.PathLike, create_size_bytes: int | None = None, direct: bool = True):
        self.name = os.fspath(path)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        exists = os.path.exists(self.name)
        if not exists and create_size_bytes is None:
            raise DeviceError(f"device {self.name} does not exist")
        is_block = exists and stat.S_ISBLK(os.stat(self.name).st_mode)
        try:  # O_EXCL on a block device: exclusive open (EBUSY while another holds it)
            self._fd = os.open(self.name, flags | (os.O_EXCL if is_block else 0)
                               | (0 if exists else os.O_CREAT | os.O_EXCL), 0o600)
        except OSError as exc:
            if is_block and exc.errno == errno.EBUSY:
                raise DeviceError(block_device_busy(self.name).strerror) from exc
            raise DeviceError(f"cannot open device {self.name}: {exc.strerror}") from exc
        self._closed = False
        self.created = not exists
        self.is_block_device = stat.S_ISBLK(os.fstat(self._fd).st_mode)
        if not self.is_block_device:
            self._lock()
        if not exists:
            self._reserve(create_size_bytes)
        self.size_bytes = os.lseek(self._fd, 0, os.SEEK_END)

    def _lock(self) -> None:
        try:
            lock_file(self._fd, self.name)
        except OSError as exc:
            os.close(self._fd)
            self._closed = True
            if self.created:
                os.unlink(self.name)
            raise DeviceError(exc.strerror if isinstance(exc, DeviceBusy) else
                              f"cannot lock device {self.name}: {exc.strerror}") from exc

    def _reserve(self, size_bytes: int) -> None:
        try:
            os.posix_fallocate(self._fd, 0, size_bytes)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                log.warning("event=device_sparse device=%s size_bytes=%d reason=%r", self.name, size_bytes,
                            f"the filesystem cannot reserve space ({exc.strerror}): created sparse")
                os.ftruncate(self._fd, size_bytes)
                return
            os.close(self._fd)
            self._closed = True
            os.unlink(self.name)
            raise DeviceError(f"cannot reserve {size_bytes} bytes for device {self.name}: {exc.strerror}") from exc

    def _read(self, offset, buffers, total):
        views = list(buffers)
        done = 0
        while done < total:
            try:
                got = os.preadv(self._fd, views, offset + done)
            except OSError as exc:
                raise DeviceError(f"read of {total} bytes at {offset} on {self.name} failed: {exc.strerror}") from exc
            if got == 0:
                raise DeviceError(f"short read on {self.name}: {done} of {total} bytes at {offset}")
            done += got
            views = views_past(views, got)

    def _write(self, offset, buffers, total):
        views = list(buffers)
        done = 0
        while done < total:
            try:
                put = os.pwritev(self._fd, views, offset + done)
            except OSError as exc:
                raise DeviceError(f"write of {total} bytes at {offset} on {self.name} failed: {exc.strerror}") from exc
            done += put
            views = views_past(views, put)

    def sync(self) -> None:
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            raise DeviceError(f"fdatasync of {self.name} failed: {exc.strerror}") from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)


class MemoryDevice(Device):
    """A device in RAM with the same alignment rules as O_DIRECT."""

    def __init__(self, size_bytes: int, name: str = "mem"):
        if size_bytes <= 0 or size_bytes % ALIGNMENT_BYTES:
            raise ValueError(f"memory device size must be a positive multiple of {ALIGNMENT_BYTES}, got {size_bytes}")
        self.name = name
        self.size_bytes = size_bytes
        self.data = bytearray(size_bytes)
        self.syncs = 0

    def _read(self, offset, buffers, total):
        pos = offset
        for buf in buffers:
            view = memoryview(buf).cast("B")
            view[:] = self.data[pos:pos + view.nbytes]
            pos += view.nbytes

    def _write(self, offset, buffers, total):
        pos = offset
        for buf in buffers:
            view = memoryview(buf).cast("B")
            self.data[pos:pos + view.nbytes] = view
            pos += view.nbytes

    def sync(self) -> None:
        self.syncs += 1

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class FaultyDeviceStatistics:
    reads: int
    writes: int
    syncs: int
    injected_faults: int


class FaultyDevice(Device):
    """Wraps a device and injects faults, armed by the test:

    * ``fail_reads`` / ``fail_writes`` / ``fail_syncs``: every such call raises
      :class:`DeviceError` while set;
    * ``arm_torn_write(keep_bytes)``: the next write stores only its first
      ``keep_bytes`` (rounded down to a sector), then raises -- a crash in the
      middle of a write;
    * ``writes_until_failure``: after that many more writes, all writes fail.
    """

    def __init__(self, inner: Device):
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.size_bytes = inner.size_bytes
        self.fail_reads = False
        self.fail_writes = False
        self.fail_syncs = False
        self.writes_until_failure: int | None = None
        self._torn_keep_bytes: int | None = None
        self._lock = threading.Lock()
        self._reads = self._writes = self._syncs = self._faults = 0

    def arm_torn_write(self, keep_bytes: int) -> None:
        self._torn_keep_bytes = keep_bytes - keep_bytes % SECTOR_BYTES

    def statistics(self) -> FaultyDeviceStatistics:
        with self._lock:
            return FaultyDeviceStatistics(self._reads, self._writes, self._syncs, self._faults)

    def _fault(self, what: str) -> DeviceError:
        with self._lock:
            self._faults += 1
        return DeviceError(f"injected {what} fault on {self.name}")

    def _read(self, offset, buffers, total):
        with self._lock:
            self._reads += 1
        if self.fail_reads:
            raise self._fault("read")
        self.inner._read(offset, buffers, total)

    def _write(self, offset, buffers, total):
        with self._lock:
            self._writes += 1
            if self.writes_until_failure is not None:
                if self.writes_until_failure <= 0:
                    self.fail_writes = True
                self.writes_until_failure -= 1
            keep, self._torn_keep_bytes = self._torn_keep_bytes, None
        if self.fail_writes:
            raise self._fault("write")
        if keep is not None:
            self._write_prefix(offset, buffers, keep)
            raise self._fault(f"torn write ({keep} of {total} bytes)")
        self.inner._write(offset, buffers, total)

    def _write_prefix(self, offset, buffers, keep):
        joined = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:keep]
        if isinstance(self.inner, MemoryDevice):
            self.inner.data[offset:offset + len(joined)] = joined
        elif joined:
            buf = aligned_buffer(align_up(len(joined)))
            self.inner._read(offset, [buf], buf.nbytes)
            buf[:len(joined)] = joined
            self.inner._write(offset, [buf], buf.nbytes)

    def sync(self) -> None:
        with self._lock:
            self._syncs += 1
        if self.fail_syncs:
            raise self._fault("sync")
        self.inner.sync()

    def close(self) -> None:
        self.inner.close()
