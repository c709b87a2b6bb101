"""Fixtures of the cluster tests: a real etcd on loopback and kvtierd members of it.

    from cluster_fixtures import etcd, members_of, start_member, wait_members  # noqa: F401

``etcd`` starts Debian's etcd on random free ports in tmp_path and stops it after the
test; the tests skip, with the reason, where etcd or etcd3gw is not installed (.ci/run
installs both). Short leases (``LEASE_TTL_S``) keep the suite fast.
"""
from __future__ import annotations

import time

import pytest

from daemon_proc import start_kvtierd
from etcd_server import EtcdServer, etcd_missing_reason

LEASE_TTL_S = 2  # etcd's minimum with its default heartbeat: kill -9 tests wait ~2 s
WAIT_S_MAX = 15.0  # a membership change seen through etcd takes well under this


@pytest.fixture
def etcd(tmp_path):
    reason = etcd_missing_reason()
    if reason:
        pytest.skip(reason)
    server = EtcdServer(tmp_path / "etcd")
    yield server
    server.stop()


def start_member(tmp_path, etcd_server, name: str, *extra: str, admin: str = "none", prefix: str = "kvtier"):
    """A kvtierd registered in ``etcd_server`` under ``prefix`` as node ``name``."""
    return start_kvtierd(tmp_path / name, "--cluster", etcd_server.url(prefix), "--node-id", name,
                         "--lease-ttl", str(LEASE_TTL_S), *extra, admin=admin)


def members_of(url: str) -> dict[str, str]:
    """{node id: data address} as etcd lists them now (one read, no watch)."""
    from kvtier.client.cluster_etcd import EtcdReader
    from kvtier.client.cluster_members import MemberTable
    from kvtier.common.cluster_url import parse_cluster_url

    parsed = parse_cluster_url(url)
    kvs, revision = EtcdReader(parsed).members()
    table = MemberTable(parsed)
    table.reset(kvs, revision)
    return {m.node_id: m.address for m in table.view().members}


def wait_members(members, predicate, timeout_s: float = WAIT_S_MAX):
    """The first view of a ClusterMembers source for which ``predicate(view)`` holds, and the
    seconds it took; fails the test after ``timeout_s``."""
    started = time.monotonic()
    view = members.current()
    while not predicate(view):
        left = timeout_s - (time.monotonic() - started)
        if left <= 0:
            pytest.fail(f"members never matched within {timeout_s} s; last view {view}")
        view = members.wait_changed(view.version, left)
    return view, time.monotonic() - started
