"""Exclusive access to a device: one kvtierd, ``fsck`` or ``format`` at a time.

* A regular file is locked with ``flock(LOCK_EX | LOCK_NB)`` on the open file
  description; the kernel drops the lock when the holder exits (also on kill -9),
  so nothing stale is left behind.
* A block device is opened ``O_EXCL``: Linux answers EBUSY while another O_EXCL
  opener (or a mount) holds it.

The holder of a file lock is named from ``/proc/locks``, which lists each FLOCK
with its PID and the locked inode, rather than from a pid file beside the device:
a pid file needs a writable directory next to the device, outlives a kill -9 and
can name a PID that has since been reused; /proc/locks is the kernel's own record.
"""
from __future__ import annotations

import errno
import fcntl
import os

PROC_LOCKS_PATH = "/proc/locks"


class DeviceBusy(OSError):
    """The device is held by another process; the message names it and, if known, its PID."""


def lock_file(fd: int, name: str) -> None:
    """Take the exclusive flock on ``fd`` or raise :class:`DeviceBusy` naming the holder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        pid = flock_holder_pid(os.fstat(fd))
        holder = f"process {pid}" if pid is not None else "another process"
        raise DeviceBusy(errno.EBUSY, f"device {name} is in use: locked by {holder} "
                                      f"(a running kvtierd, fsck or format)") from None


def block_device_busy(name: str) -> DeviceBusy:
    """The error for an O_EXCL open of a block device that answered EBUSY (the holder is not known)."""
    return DeviceBusy(errno.EBUSY, f"device {name} is in use: opened exclusively by another process "
                                   f"or mounted (a running kvtierd, fsck or format?)")


def flock_holder_pid(st: os.stat_result, locks_path: str = PROC_LOCKS_PATH) -> int | None:
    """The PID /proc/locks gives for an FLOCK on the file ``st`` describes; None if not found."""
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open(locks_path) as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or "->" in fields[1] or fields[1] != "FLOCK":
            continue  # "->" marks a waiter, not a holder
        if fields[5] == want:
            return int(fields[4])
    return None
