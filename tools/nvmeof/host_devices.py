"""What the client's kernel shows of attached NVMe namespaces, and waiting for them.

``nvme connect`` returns once the controller exists; the kernel scans its namespaces in
the background and adds ``/dev/nvmeXnY`` some moments later. The wait watches the
device directory with inotify (a new node wakes it) and re-reads sysfs at least every
:data:`SYSFS_RECHECK_S`, since sysfs attributes send no events.
"""
from __future__ import annotations

import ctypes
import os
import select
import time

from .connect_plan import DeviceMapResolution, resolve_device_map

SYSFS_RECHECK_S = 0.5  # sysfs gives no inotify events: re-read it at least this often while waiting
WAIT_S_MAX = 600.0  # a connect that has not shown its namespaces in 10 minutes is not going to
_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80


def read_namespace_uuids(sysfs_root: str = "/sys") -> dict[str, str]:
    """``{block device name: uuid}`` for each NVMe namespace under ``sysfs_root/block``."""
    block = os.path.join(sysfs_root, "block")
    out: dict[str, str] = {}
    try:
        names = os.listdir(block)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.startswith("nvme"):
            continue
        try:
            with open(os.path.join(block, name, "uuid"), encoding="ascii", errors="replace") as fh:
                out[name] = fh.read().strip()
        except (FileNotFoundError, NotADirectoryError):
            continue
    return out


def resolve_visible(device_ids: tuple[str, ...], sysfs_root: str, dev_dir: str) -> DeviceMapResolution:
    """The device map of namespaces that sysfs shows and whose device node exists."""
    found = resolve_device_map(device_ids, read_namespace_uuids(sysfs_root), dev_dir)
    present = {dev: path for dev, path in found.device_map.items() if os.path.exists(path)}
    return DeviceMapResolution(present, tuple(d for d in device_ids if d not in present))


class _DirWatch:
    """inotify on one directory: wakes on entries created or moved into it."""

    def __init__(self, path: str) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
        if self.fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        if self._libc.inotify_add_watch(self.fd, os.fsencode(path), _IN_CREATE | _IN_MOVED_TO) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"cannot watch {path}: {os.strerror(err)}")

    def wait(self, timeout_s: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout_s))
        if ready:
            try:
                while os.read(self.fd, 65536):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        os.close(self.fd)


def wait_for_namespaces(device_ids: tuple[str, ...], sysfs_root: str, dev_dir: str,
                        timeout_s: float) -> DeviceMapResolution:
    """The device map once every device id is visible, or what is visible at the deadline."""
    if not 0 <= timeout_s <= WAIT_S_MAX:
        raise ValueError(f"wait of {timeout_s} s is outside 0..{WAIT_S_MAX}")
    deadline = time.monotonic() + timeout_s
    watch = _DirWatch(dev_dir)
    try:
        while True:
            found = resolve_visible(device_ids, sysfs_root, dev_dir)
            remaining = deadline - time.monotonic()
            if not found.missing or remaining <= 0:
                return found
            watch.wait(min(remaining, SYSFS_RECHECK_S))
    finally:
        watch.close()
