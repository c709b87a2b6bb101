"""The kernel NVMe target (nvmet) configfs entries that export a kvtierd's devices, as a
list of operations computed from the config alone (no I/O; :mod:`.configfs` applies them).

What one export creates, under the configfs root (``/sys/kernel/config``)::

    nvmet/subsystems/NQN/                    mkdir
        attr_allow_any_host = 0              only the hosts below may connect
        namespaces/1/                        one per daemon device, in stripe order
            device_path = /dev/disk/by-id/.. the daemon's device
            device_uuid = <daemon device id> so a client finds the namespace by id
            enable      = 1
        allowed_hosts/HOSTNQN -> nvmet/hosts/HOSTNQN
    nvmet/hosts/HOSTNQN/                     mkdir (shared with other subsystems)
    nvmet/ports/ID/                          mkdir (may be shared: same address, same port)
        addr_trtype  = tcp | rdma
        addr_adrfam  = ipv4 | ipv6
        addr_traddr  = ADDR
        addr_trsvcid = PORT
        subsystems/NQN -> nvmet/subsystems/NQN   last: this link opens the export

The kernel creates the default children (``namespaces/``, ``allowed_hosts/``, a port's
``subsystems/``) and every attribute file itself on mkdir; the plan also asks for those
directories with ``exist_ok``, so that it lays out the same tree in a plain directory.
Attributes are written only where their value differs, so a port shared with another
subsystem is left as it is when it already has this address.

nvmet has no read-only attribute for a namespace (see docs/operations.md, "NVMe-oF
export"): clients are trusted to connect read-only, and ``kvtier nvmeof connect`` marks
the attached namespaces read-only on the client.
"""
from __future__ import annotations

import enum
import ipaddress
import re
import uuid
from dataclasses import dataclass

NQN_BYTES_MAX = 223  # NVMF_NQN_SIZE: the NVMe base specification's limit on an NQN
NAMESPACES_MAX = 1024  # NVMET_MAX_NAMESPACES in the kernel
HOSTS_MAX = 256  # allowed hosts per export: one entry per inference host
PORT_ID_MAX = 65535  # addr_portid is a u16
TRANSPORTS = ("tcp", "rdma")
DEFAULT_TRSVCID = 4420  # the IANA port of NVMe over Fabrics
DEFAULT_PORT_ID = 1
NQN_UUID_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"  # the specification's UUID-based NQN form
NVMET = "nvmet"
_DEVICE_ID_RE = re.compile(r"^[0-9a-f]{32}$")


class PlanError(ValueError):
    """A config that cannot be exported; the message names the field and the value."""


class OpKind(enum.Enum):
    MKDIR = "mkdir"
    WRITE = "write"
    SYMLINK = "symlink"
    UNLINK = "unlink"
    RMDIR = "rmdir"


@dataclass(frozen=True)
class Op:
    """One configfs operation; paths are relative to the configfs root."""

    kind: OpKind
    path: str
    value: str = ""  # WRITE: the attribute's value; SYMLINK: the target (relative to the root)
    exist_ok: bool = False  # MKDIR: a directory already there (the kernel's default groups) is fine


@dataclass(frozen=True)
class ExportDevice:
    """A daemon device: its id (32 hex digits, from its superblock) and its local path."""

    device_id: str
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.device_id, str) or not _DEVICE_ID_RE.match(self.device_id):
            raise PlanError(f"device id {self.device_id!r} is not 32 lowercase hex digits")
        if not isinstance(self.path, str) or not self.path.startswith("/") or "\n" in self.path:
            raise PlanError(f"device path {self.path!r} of device {self.device_id} is not an absolute path")


def device_uuid(device_id: str) -> str:
    """The namespace UUID that carries a daemon device id (8-4-4-4-12, lowercase), as nvmet's
    ``device_uuid`` takes it and the client's ``/sys/block/nvmeXnY/uuid`` shows it."""
    if not _DEVICE_ID_RE.match(device_id):
        raise PlanError(f"device id {device_id!r} is not 32 lowercase hex digits")
    return str(uuid.UUID(hex=device_id))


def default_nqn(device_ids: list[str] | tuple[str, ...]) -> str:
    """The subsystem NQN when none is given: the UUID form, from the first device's id, so
    the storage node and its clients derive the same name from the daemon's device list."""
    if not device_ids:
        raise PlanError("the daemon reports no devices")
    return NQN_UUID_PREFIX + device_uuid(device_ids[0])


def check_nqn(nqn: str, what: str = "NQN") -> str:
    if not isinstance(nqn, str) or not nqn.startswith("nqn."):
        raise PlanError(f"{what} {nqn!r} does not start with 'nqn.'")
    if len(nqn.encode()) > NQN_BYTES_MAX:
        raise PlanError(f"{what} {nqn!r} is {len(nqn.encode())} bytes, over the limit {NQN_BYTES_MAX}")
    if not all(0x21 <= ord(c) <= 0x7e for c in nqn) or "/" in nqn:
        raise PlanError(f"{what} {nqn!r} must be printable ASCII without spaces or '/'")
    return nqn


def address_family(traddr: str) -> str:
    """``ipv4`` or ``ipv6``: nvmet's TCP and RDMA ports listen on an IP address, not a name."""
    try:
        ip = ipaddress.ip_address(traddr)
    except ValueError:
        raise PlanError(f"address {traddr!r} is not an IP address (nvmet ports listen on an IP)") from None
    return "ipv4" if ip.version == 4 else "ipv6"


@dataclass(frozen=True)
class ExportConfig:
    """What to export, where, and to whom."""

    nqn: str
    devices: tuple[ExportDevice, ...]
    traddr: str
    hosts: tuple[str, ...]
    transport: str = "tcp"
    trsvcid: int = DEFAULT_TRSVCID
    port_id: int = DEFAULT_PORT_ID

    def __post_init__(self) -> None:
        check_nqn(self.nqn, "subsystem NQN")
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "hosts", tuple(self.hosts))
        if not self.devices:
            raise PlanError("no devices to export")
        if len(self.devices) > NAMESPACES_MAX:
            raise PlanError(f"{len(self.devices)} devices is over the limit {NAMESPACES_MAX} namespaces")
        ids = [d.device_id for d in self.devices]
        if len(set(ids)) != len(ids):
            raise PlanError(f"device ids repeat: {ids}")
        if not self.hosts:
            raise PlanError("no allowed hosts: give each client's host NQN (cat /etc/nvme/hostnqn on the client); "
                            "an export open to any host would let any host write the devices")
        if len(self.hosts) > HOSTS_MAX:
            raise PlanError(f"{len(self.hosts)} hosts is over the limit {HOSTS_MAX}")
        for host in self.hosts:
            check_nqn(host, "host NQN")
        if len(set(self.hosts)) != len(self.hosts):
            raise PlanError(f"host NQNs repeat: {list(self.hosts)}")
        if self.transport not in TRANSPORTS:
            raise PlanError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        address_family(self.traddr)
        if not isinstance(self.trsvcid, int) or not 1 <= self.trsvcid <= 65535:
            raise PlanError(f"service port {self.trsvcid!r} is out of range 1..65535")
        if not isinstance(self.port_id, int) or not 1 <= self.port_id <= PORT_ID_MAX:
            raise PlanError(f"port id {self.port_id!r} is out of range 1..{PORT_ID_MAX}")


def subsystem_dir(nqn: str) -> str:
    return f"{NVMET}/subsystems/{nqn}"


def port_dir(port_id: int) -> str:
    return f"{NVMET}/ports/{port_id}"


def host_dir(host: str) -> str:
    return f"{NVMET}/hosts/{host}"


def export_plan(cfg: ExportConfig) -> list[Op]:
    """The operations that export ``cfg``, in the order the kernel needs them: a namespace's
    attributes before its ``enable``, the allowed hosts before the port link that opens
    the subsystem to the network."""
    sub = subsystem_dir(cfg.nqn)
    ops = [Op(OpKind.MKDIR, f"{NVMET}/subsystems", exist_ok=True),
           Op(OpKind.MKDIR, sub),  # not exist_ok: an existing export is unexported first
           Op(OpKind.WRITE, f"{sub}/attr_allow_any_host", "0"),
           Op(OpKind.MKDIR, f"{sub}/namespaces", exist_ok=True)]
    for nsid, device in enumerate(cfg.devices, start=1):
        ns = f"{sub}/namespaces/{nsid}"
        ops += [Op(OpKind.MKDIR, ns),
                Op(OpKind.WRITE, f"{ns}/device_path", device.path),
                Op(OpKind.WRITE, f"{ns}/device_uuid", device_uuid(device.device_id)),
                Op(OpKind.WRITE, f"{ns}/enable", "1")]
    ops += [Op(OpKind.MKDIR, f"{NVMET}/hosts", exist_ok=True), Op(OpKind.MKDIR, f"{sub}/allowed_hosts", exist_ok=True)]
    for host in cfg.hosts:
        ops += [Op(OpKind.MKDIR, host_dir(host), exist_ok=True),
                Op(OpKind.SYMLINK, f"{sub}/allowed_hosts/{host}", host_dir(host))]
    port = port_dir(cfg.port_id)
    ops += [Op(OpKind.MKDIR, f"{NVMET}/ports", exist_ok=True),
            Op(OpKind.MKDIR, port, exist_ok=True),
            Op(OpKind.WRITE, f"{port}/addr_trtype", cfg.transport),
            Op(OpKind.WRITE, f"{port}/addr_adrfam", address_family(cfg.traddr)),
            Op(OpKind.WRITE, f"{port}/addr_traddr", cfg.traddr),
            Op(OpKind.WRITE, f"{port}/addr_trsvcid", str(cfg.trsvcid)),
            Op(OpKind.MKDIR, f"{port}/subsystems", exist_ok=True),
            Op(OpKind.SYMLINK, f"{port}/subsystems/{cfg.nqn}", sub)]
    return ops


@dataclass(frozen=True)
class ExportState:
    """What configfs holds of one subsystem now (read by :func:`.configfs.read_state`)."""

    nqn: str
    exists: bool
    namespaces: tuple[int, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    ports: tuple[int, ...] = ()  # ports that link the subsystem
    shared_hosts: frozenset[str] = frozenset()  # hosts that other subsystems allow too
    shared_ports: frozenset[int] = frozenset()  # ports that link other subsystems too


def unexport_plan(state: ExportState) -> list[Op]:
    """The operations that undo an export, closing it to the network first: the port
    links, the allowed hosts, each namespace (disabled, then removed), the subsystem, and
    the hosts and ports that nothing else uses. Empty when the subsystem does not exist."""
    if not state.exists:
        return []
    sub = subsystem_dir(state.nqn)
    ops = [Op(OpKind.UNLINK, f"{port_dir(p)}/subsystems/{state.nqn}") for p in state.ports]
    ops += [Op(OpKind.UNLINK, f"{sub}/allowed_hosts/{h}") for h in state.allowed_hosts]
    for nsid in state.namespaces:
        ns = f"{sub}/namespaces/{nsid}"
        ops += [Op(OpKind.WRITE, f"{ns}/enable", "0"), Op(OpKind.RMDIR, ns)]
    ops.append(Op(OpKind.RMDIR, sub))
    ops += [Op(OpKind.RMDIR, host_dir(h)) for h in state.allowed_hosts if h not in state.shared_hosts]
    ops += [Op(OpKind.RMDIR, port_dir(p)) for p in state.ports if p not in state.shared_ports]
    return ops


def render_shell(ops: list[Op], root: str) -> str:
    """The operations as the shell commands an operator would type (for ``--dry-run``)."""
    def at(path: str) -> str:
        return _quote(f"{root.rstrip('/')}/{path}")

    lines = []
    for op in ops:
        if op.kind is OpKind.MKDIR:
            lines.append(f"mkdir {'-p ' if op.exist_ok else ''}{at(op.path)}")
        elif op.kind is OpKind.WRITE:
            lines.append(f"echo {_quote(op.value)} > {at(op.path)}")
        elif op.kind is OpKind.SYMLINK:
            lines.append(f"ln -s {at(op.value)} {at(op.path)}")
        elif op.kind is OpKind.UNLINK:
            lines.append(f"rm {at(op.path)}")
        else:
            lines.append(f"rmdir {at(op.path)}")
    return "\n".join(lines)


def _quote(text: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_./:=+-]+", text):
        return text
    return "'" + text.replace("'", "'\\''") + "'"
