"""Which devices already hold their bytes in DRAM, and their bytes as memory.

A device file on a memory filesystem (tmpfs, ramfs, hugetlbfs) is page cache
and nothing else: mapping it gives the bytes a read would copy, so a transfer
can be posted straight from them (NIXL WRITEs from the mapping; no read into an
arena first). A file on any other filesystem is not mapped: its pages may not be
resident, and faulting them in from flash would bypass O_DIRECT and stall the
thread that posted the transfer.

:func:`filesystem_type` is pure (it parses ``/proc/self/mountinfo`` text);
:func:`map_read_only` maps an open file.
"""
from __future__ import annotations

import mmap
import os

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space) undone."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def filesystem_type(path: str, mountinfo_text: str) -> str | None:
    """The type of the filesystem ``path`` (absolute, symlinks resolved) lies on: the mount point
    that is its longest prefix wins (the last one listed among equals: it is mounted over the others)."""
    best, best_len = None, -1
    for line in mountinfo_text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount_point = _unescape(fields[4])
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= best_len:
            best, best_len = right.split()[0], len(mount_point)
    return best


def on_memory_filesystem(path: str) -> bool:
    """Whether ``path``'s bytes live on a memory filesystem (False where that cannot be told)."""
    try:
        with open(MOUNTINFO) as f:
            text = f.read()
    except OSError:
        return False
    return filesystem_type(os.path.realpath(path), text) in MEMORY_FILESYSTEMS


def map_read_only(fd: int, size_bytes: int) -> mmap.mmap:
    """The first ``size_bytes`` of an open file, mapped shared and read-only."""
    return mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
