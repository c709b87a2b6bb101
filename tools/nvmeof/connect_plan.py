"""The client side of an NVMe-oF export, without I/O: the ``nvme connect`` command, the
commands that keep the attached namespaces read-only, and the device map that direct
reads need, resolved from what the client's sysfs shows.

Each exported namespace carries its daemon device id as its UUID
(:func:`.export_plan.device_uuid`), and the client kernel shows it in
``/sys/block/nvmeXnY/uuid``; the device map is::

    {daemon device id: "/dev/nvmeXnY"}   (the form KVCache(device_map=...) and
                                          DirectReader take, in stripe order)

``/dev/nvmeXnY`` numbers change between connects and boots; the UUIDs do not, so the
map is resolved again after every connect.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from .export_plan import DEFAULT_TRSVCID, TRANSPORTS, PlanError, address_family, check_nqn, device_uuid

NAMESPACE_BLOCK_RE = re.compile(r"^nvme\d+n\d+$")  # a namespace (or multipath head); not nvmeXcYnZ paths
FEATURE_WRITE_PROTECT = "0x84"  # NVMe Set Features: Namespace Write Protection Config
WRITE_PROTECT_ON = "1"


@dataclass(frozen=True)
class ConnectConfig:
    nqn: str
    traddr: str
    device_ids: tuple[str, ...]
    transport: str = "tcp"
    trsvcid: int = DEFAULT_TRSVCID
    hostnqn: str | None = None  # None: nvme-cli's default, /etc/nvme/hostnqn

    def __post_init__(self) -> None:
        check_nqn(self.nqn, "subsystem NQN")
        if self.hostnqn is not None:
            check_nqn(self.hostnqn, "host NQN")
        if self.transport not in TRANSPORTS:
            raise PlanError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        address_family(self.traddr)
        if not isinstance(self.trsvcid, int) or not 1 <= self.trsvcid <= 65535:
            raise PlanError(f"service port {self.trsvcid!r} is out of range 1..65535")
        object.__setattr__(self, "device_ids", tuple(self.device_ids))
        if not self.device_ids:
            raise PlanError("the daemon reports no devices")
        for dev in self.device_ids:
            device_uuid(dev)


def connect_command(cfg: ConnectConfig, nvme: str = "nvme") -> list[str]:
    """``nvme connect -t tcp -a ADDR -s PORT -n NQN [-q HOSTNQN]``."""
    argv = [nvme, "connect", "-t", cfg.transport, "-a", cfg.traddr, "-s", str(cfg.trsvcid), "-n", cfg.nqn]
    if cfg.hostnqn is not None:
        argv += ["-q", cfg.hostnqn]
    return argv


def read_only_commands(device_map: Mapping[str, str], blockdev: str = "blockdev") -> list[list[str]]:
    """``blockdev --setro`` for every attached namespace: the client's block layer refuses
    writes to it (the target cannot enforce that; see docs/operations.md)."""
    return [[blockdev, "--setro", path] for path in device_map.values()]


def write_protect_commands(device_map: Mapping[str, str], device_ids: tuple[str, ...],
                           nvme: str = "nvme") -> list[list[str]]:
    """Set the NVMe Write Protect feature on each namespace (namespace id = stripe position
    + 1, as exported): the target then fails writes from every host until one clears it."""
    return [[nvme, "set-feature", device_map[dev], f"--namespace-id={nsid}", f"--feature-id={FEATURE_WRITE_PROTECT}",
             f"--value={WRITE_PROTECT_ON}"]
            for nsid, dev in enumerate(device_ids, start=1) if dev in device_map]


@dataclass(frozen=True)
class DeviceMapResolution:
    device_map: dict[str, str]  # device id -> local path, in stripe order, for the ids found
    missing: tuple[str, ...]  # device ids no namespace shows yet


def resolve_device_map(device_ids: tuple[str, ...], namespace_uuids: Mapping[str, str],
                       dev_dir: str = "/dev") -> DeviceMapResolution:
    """Match each daemon device id to the namespace whose UUID carries it.
    ``namespace_uuids`` is ``{block device name: uuid text}`` as sysfs shows it. Two
    namespaces with one UUID (two paths, native multipath off) is a PlanError: picking one
    would be a guess."""
    by_uuid: dict[str, list[str]] = {}
    for name, text in namespace_uuids.items():
        if NAMESPACE_BLOCK_RE.match(name):
            by_uuid.setdefault(text.strip().lower(), []).append(name)
    found: dict[str, str] = {}
    missing = []
    for dev in device_ids:
        names = sorted(by_uuid.get(device_uuid(dev), []))
        if len(names) > 1:
            raise PlanError(f"daemon device {dev} is visible as {', '.join(names)}: one path per namespace is "
                            "expected (enable native NVMe multipath, nvme_core.multipath=Y)")
        if names:
            found[dev] = f"{dev_dir.rstrip('/')}/{names[0]}"
        else:
            missing.append(dev)
    return DeviceMapResolution(found, tuple(missing))
