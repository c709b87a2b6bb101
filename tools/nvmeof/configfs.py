"""Applies :mod:`.export_plan` operations to a configfs root, and reads back what an
export holds there.

Works on the kernel's configfs and on a plain directory laid out like it (tests, and
rehearsing on a machine without nvmet). The differences are the kernel's to make: on
configfs a mkdir creates the item's default groups and attribute files; in a plain
directory an attribute file appears when it is first written, and a rmdir has to remove
those files and empty default groups first, which configfs does by itself.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from .export_plan import NVMET, ExportState, Op, OpKind, subsystem_dir

# The default groups nvmet creates inside its items (subsystem, port, namespace).
DEFAULT_GROUPS = frozenset({"namespaces", "allowed_hosts", "passthru", "subsystems", "referrals", "ana_groups"})
ATTRIBUTE_BYTES_MAX = 4096  # configfs attribute pages are one page


class ApplyError(Exception):
    """An operation failed; ``done`` operations before it took effect."""

    def __init__(self, op: Op, reason: str, done: int) -> None:
        super().__init__(f"{op.kind.value} {op.path}: {reason}")
        self.op, self.reason, self.done = op, reason, done


@dataclass(frozen=True)
class ApplyResult:
    applied: int  # operations that changed something
    skipped: int  # operations already in effect (an existing directory, an equal value, a link in place)


def is_configfs(path: str) -> bool:
    """True where ``path`` lies on a mounted configfs (from /proc/self/mountinfo)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                sep = fields.index("-")
                mount_point = fields[4].replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) > len(best):
                    best, fstype = mount_point, fields[sep + 1]
    except OSError:
        return False
    return fstype == "configfs"


def check_nvmet_root(root: str) -> None:
    """The nvmet directory must be there: the kernel creates it when the nvmet module loads."""
    if not os.path.isdir(os.path.join(root, NVMET)):
        raise FileNotFoundError(errno.ENOENT, f"no {NVMET}/ under {root}: load the NVMe target modules first "
                                              "(modprobe nvmet nvmet-tcp, or nvmet-rdma), or give --configfs")


class ConfigfsApplier:
    """Runs operations under ``root``, in order, stopping at the first failure."""

    def __init__(self, root: str, kernel: bool | None = None) -> None:
        self.root = root
        self.kernel = is_configfs(root) if kernel is None else kernel

    def _at(self, path: str) -> str:
        return os.path.join(self.root, path)

    def apply(self, ops: list[Op]) -> ApplyResult:
        applied = skipped = 0
        for op in ops:
            try:
                changed = self._one(op)
            except OSError as exc:
                raise ApplyError(op, exc.strerror or str(exc), applied + skipped) from exc
            applied += changed
            skipped += not changed
        return ApplyResult(applied, skipped)

    def _one(self, op: Op) -> bool:
        path = self._at(op.path)
        if op.kind is OpKind.MKDIR:
            return self._mkdir(path, op.exist_ok)
        if op.kind is OpKind.WRITE:
            return self._write(path, op.value)
        if op.kind is OpKind.SYMLINK:
            return self._symlink(path, self._at(op.value))
        if op.kind is OpKind.UNLINK:
            if not os.path.lexists(path):
                return False
            os.unlink(path)
            return True
        assert op.kind is OpKind.RMDIR, op
        return self._rmdir(path)

    def _mkdir(self, path: str, exist_ok: bool) -> bool:
        try:
            os.mkdir(path)
        except FileExistsError:
            if exist_ok and os.path.isdir(path):
                return False
            raise OSError(errno.EEXIST, "exists already (unexport it first, or choose another name)") from None
        return True

    def _write(self, path: str, value: str) -> bool:
        data = (value + "\n").encode()
        assert len(data) <= ATTRIBUTE_BYTES_MAX, (path, len(data))
        try:
            with open(path, "rb") as fh:
                if fh.read(ATTRIBUTE_BYTES_MAX).decode(errors="replace").strip() == value:
                    return False
        except FileNotFoundError:
            if self.kernel:
                raise OSError(errno.ENOENT, "no such attribute (is this kernel's nvmet older?)") from None
        flags = os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | (0 if self.kernel else os.O_CREAT)
        fd = os.open(path, flags, 0o644)
        try:
            written = os.write(fd, data)  # configfs takes an attribute in one write
        finally:
            os.close(fd)
        if written != len(data):
            raise OSError(errno.EIO, f"short write: {written} of {len(data)} bytes")
        return True

    def _symlink(self, link: str, target: str) -> bool:
        # configfs resolves the target from the caller's working directory: always absolute
        target = os.path.abspath(target)
        if os.path.islink(link):
            if os.path.abspath(os.path.join(os.path.dirname(link), os.readlink(link))) == target:
                return False
            raise OSError(errno.EEXIST, f"links to {os.readlink(link)}, not {target}")
        os.symlink(target, link)
        return True

    def _rmdir(self, path: str) -> bool:
        if not os.path.isdir(path):
            return False
        if not self.kernel:
            _remove_item_contents(path)
        os.rmdir(path)
        return True


def _remove_item_contents(path: str) -> None:
    """What configfs removes by itself on rmdir: attribute files and empty default groups.
    Anything else (a link, a child item) stays, and the rmdir fails as the kernel's would."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_symlink():
                continue
            if entry.is_file():
                os.unlink(entry.path)
            elif entry.is_dir() and entry.name in DEFAULT_GROUPS:
                with os.scandir(entry.path) as children:
                    if any(not c.is_file(follow_symlinks=False) for c in children):
                        continue
                _remove_item_contents(entry.path)
                os.rmdir(entry.path)


def read_state(root: str, nqn: str) -> ExportState:
    """What configfs under ``root`` holds of subsystem ``nqn``, for :func:`unexport_plan`."""
    nvmet = os.path.join(root, NVMET)
    sub = os.path.join(root, subsystem_dir(nqn))
    if not os.path.isdir(sub):
        return ExportState(nqn, exists=False)
    namespaces = tuple(sorted(int(n) for n in _names(os.path.join(sub, "namespaces")) if n.isdigit()))
    hosts = tuple(sorted(_names(os.path.join(sub, "allowed_hosts"))))
    shared_hosts = set()
    for other in _names(os.path.join(nvmet, "subsystems")):
        if other != nqn:
            shared_hosts.update(_names(os.path.join(nvmet, "subsystems", other, "allowed_hosts")))
    ports, shared_ports = [], set()
    for port in _names(os.path.join(nvmet, "ports")):
        linked = _names(os.path.join(nvmet, "ports", port, "subsystems"))
        if nqn in linked and port.isdigit():
            ports.append(int(port))
            if len(linked) > 1:
                shared_ports.add(int(port))
    return ExportState(nqn, True, namespaces, hosts, tuple(sorted(ports)), frozenset(shared_hosts & set(hosts)),
                       frozenset(shared_ports))


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
