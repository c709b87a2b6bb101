"""kvtierd's cluster membership on etcd (``--cluster etcd://HOST:PORT/PREFIX``).

The entry point calls :func:`join_cluster` once the data port is bound and
``ClusterMember.stop()`` on SIGTERM; the admin API reads ``statistics()``.

- :mod:`.node_id`      the node id, kept in the data dir
- :mod:`.lease_state`  what to do next (a literal transition table; no I/O)
- :mod:`.etcd_session` the etcd calls (etcd3gw over etcd's JSON gateway)
- :mod:`.lease_keeper` ClusterMember: register, keep alive, re-register, deregister
"""
from __future__ import annotations

import time

from kvtier.common.addresses import format_address
from kvtier.common.cluster_url import ClusterUrl, MemberRecord

from .lease_keeper import (LEASE_TTL_S_DEFAULT, LEASE_TTL_S_MAX, LEASE_TTL_S_MIN, ClusterError, ClusterMember,
                           ClusterSettings)
from .lease_state import MembershipStatistics
from .node_id import NodeIdError, load_or_create_node_id

__all__ = ["ClusterError", "ClusterMember", "ClusterSettings", "MembershipStatistics", "join_cluster",
           "LEASE_TTL_S_DEFAULT", "LEASE_TTL_S_MIN", "LEASE_TTL_S_MAX"]

_WILDCARDS = ("0.0.0.0", "::", "")


def join_cluster(url: ClusterUrl, *, data_dir: str, data_address: tuple[str, int],
                 admin_address: tuple[str, int] | None, advertise: tuple[str, int] | None,
                 node_id: str | None, lease_ttl_s: int) -> ClusterMember:
    """Register the daemon and start its lease keeper; ClusterError names the URL when etcd
    does not answer. ``advertise`` (else the bound data address) is what clients dial; the
    admin address is advertised on the same host."""
    try:
        node = load_or_create_node_id(data_dir, node_id)
    except NodeIdError as exc:
        raise ClusterError(str(exc)) from None
    data = advertise if advertise is not None else tuple(data_address[:2])
    assert data[0] not in _WILDCARDS, f"advertised data address {data}: config checks a wildcard needs --advertise"
    admin = None
    if admin_address is not None:
        host = data[0] if advertise is not None or admin_address[0] in _WILDCARDS else admin_address[0]
        admin = format_address(host, admin_address[1])
    record = MemberRecord(node_id=node, data=format_address(*data), admin=admin, started_unix_s=time.time())
    member = ClusterMember(ClusterSettings(url=url, record=record, lease_ttl_s=lease_ttl_s))
    member.start()
    return member
