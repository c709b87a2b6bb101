"""Which UCX transports a NIXL agent of kvtier uses, and the environment that says so.

UCX reads its settings from the environment when an agent's UCX backend is
created, so both sides (kvtierd and the client) call :func:`ucx_environment`
and apply it before they create their agent. The choice::

    client and daemon on one host   sm (shared memory: CMA / SysV / POSIX), then tcp
    an RDMA device present          rc, ud (verbs), then tcp
    otherwise                       tcp
    always                          self (loopback inside one process)

UCX picks, per peer, the best of the transports both sides allow, so a list that
names shared memory costs nothing towards a peer on another host. Each part is
overridable: ``KVTIER_NIXL_TLS`` (or a ``tls`` argument, e.g. kvtierd's
``--nixl-tls``) replaces the list, ``KVTIER_NIXL_NET_DEVICES`` the network
devices, and any ``UCX_*`` variable already set in the environment wins over
kvtier's choice of it. Without an RDMA device, UCX's InfiniBand modules are not
loaded (``UCX_MODULES=^ib*``): their teardown crashes the process at exit there.

:func:`transport_plan` and :func:`ucx_environment` are pure; :func:`rdma_devices`
lists ``/sys/class/infiniband``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

RDMA_SYSFS_DIR = "/sys/class/infiniband"
TCP_SEGMENT_BYTES = "1m"  # UCX_TCP_{TX,RX}_SEG_SIZE: 8 KiB default segments cost a syscall each per MiB
TRANSPORT_NAMES = ("sm", "rdma", "tcp")
TLS_OVERRIDE_ENV = "KVTIER_NIXL_TLS"
NET_DEVICES_OVERRIDE_ENV = "KVTIER_NIXL_NET_DEVICES"


@dataclass(frozen=True)
class TransportPlan:
    """``name``: the best transport for this peer ("sm", "rdma" or "tcp"); ``tls``: UCX_TLS."""

    name: str
    tls: str

    def __post_init__(self) -> None:
        if self.name not in TRANSPORT_NAMES:
            raise ValueError(f"transport {self.name!r} is not one of {TRANSPORT_NAMES}")


def rdma_devices(sysfs_dir: str = RDMA_SYSFS_DIR) -> tuple[str, ...]:
    """The RDMA devices the kernel has (empty where there is none, or no sysfs class for them)."""
    try:
        return tuple(sorted(os.listdir(sysfs_dir)))
    except OSError:
        return ()


def transport_plan(same_host: bool, rdma: bool, tls_override: str | None = None) -> TransportPlan:
    """The transports for a peer on this host (``same_host``) or not, with or without RDMA."""
    if tls_override:
        names = {t.strip() for t in tls_override.split(",") if t.strip()}
        if not names:
            raise ValueError(f"UCX transport list {tls_override!r} names no transport")
        if same_host and names & {"sm", "shm", "sysv", "posix", "cma"}:
            name = "sm"
        elif rdma and names & {"rc", "ud", "dc", "rc_x", "ud_x", "dc_x", "ib"}:
            name = "rdma"
        else:
            name = "tcp"
        return TransportPlan(name, ",".join(sorted(names)))
    tls = ["self"]
    if same_host:
        tls.append("sm")
    if rdma:
        tls += ["rc", "ud"]
    tls.append("tcp")
    name = "sm" if same_host else "rdma" if rdma else "tcp"
    return TransportPlan(name, ",".join(tls))


def ucx_environment(plan: TransportPlan, loopback_only: bool, rdma: bool, environ: Mapping[str, str],
                    net_devices: str | None = None) -> dict[str, str]:
    """The UCX_* variables to set for ``plan`` (those ``environ`` already sets are left out).

    ``loopback_only``: the peers are on this host (the daemon listens on loopback), so UCX's
    TCP stays on ``lo`` instead of also using the machine's external interfaces."""
    wanted = {"UCX_TLS": plan.tls, "UCX_TCP_TX_SEG_SIZE": TCP_SEGMENT_BYTES, "UCX_TCP_RX_SEG_SIZE": TCP_SEGMENT_BYTES}
    devices = net_devices or environ.get(NET_DEVICES_OVERRIDE_ENV) or ("lo" if loopback_only else None)
    if devices:
        wanted["UCX_NET_DEVICES"] = devices
    if not rdma:
        wanted["UCX_MODULES"] = "^ib*"
    return {key: value for key, value in wanted.items() if key not in environ}


def apply_ucx_environment(same_host: bool, loopback_only: bool, tls_override: str | None = None,
                          net_devices: str | None = None) -> TransportPlan:
    """Detect RDMA, choose, and set the UCX variables in ``os.environ`` (before an agent exists)."""
    rdma = bool(rdma_devices())
    plan = transport_plan(same_host, rdma,
                          tls_override or os.environ.get(TLS_OVERRIDE_ENV) or os.environ.get("UCX_TLS"))
    os.environ.update(ucx_environment(plan, loopback_only, rdma, os.environ, net_devices))
    return plan
