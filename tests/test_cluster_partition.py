"""A member cut off from etcd by a partition (its own network namespace, the veth link
set down) leaves when its lease expires and registers again once the link is back.

Needs root and ``ip netns``; skipped otherwise. The namespace and its veth pair are
removed afterwards, and the partition lasts only until the lease is seen gone.
"""
import contextlib
import os
import subprocess

import pytest

from cluster_fixtures import LEASE_TTL_S, wait_members
from daemon_proc import _merge, DEFAULT_ARGS
from etcd_server import EtcdServer, etcd_missing_reason
from kvtier.client.cluster_members import open_members
from netns import NS_DATA_PORT, NetnsKvtierd, veth_namespace
from netns import ip as _ip

@pytest.fixture
def netns():
    """(namespace, host-side veth, host address, namespace address); removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    with contextlib.ExitStack() as stack:
        try:
            joined = stack.enter_context(veth_namespace("10.213"))
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot create a network namespace here: {exc}")
        yield joined


@pytest.mark.root
def test_partitioned_member_leaves_and_re_registers(netns, tmp_path):
    reason = etcd_missing_reason()
    if reason:
        pytest.skip(reason)
    name, host_if, host_ip, ns_ip = netns
    etcd = EtcdServer(tmp_path / "etcd", also_listen=host_ip)
    args = _merge(list(DEFAULT_ARGS) + ["--admin", "none"],
                  ["--listen", f"127.0.0.1:{NS_DATA_PORT}", "--advertise", f"{ns_ip}:{NS_DATA_PORT}",
                   "--cluster", f"etcd://{host_ip}:{etcd.client_port}/kvtier", "--node-id", "node-p",
                   "--lease-ttl", str(LEASE_TTL_S)])
    d = None
    members = open_members(etcd.url())  # the watcher stays on loopback: only the member is cut off
    try:
        d = NetnsKvtierd(name, tmp_path / "node-p", args)
        wait_members(members, lambda v: v.addresses == (f"{ns_ip}:{NS_DATA_PORT}",))
        _ip("link", "set", host_if, "down")
        _, waited_s = wait_members(members, lambda v: len(v) == 0)
        assert waited_s <= LEASE_TTL_S + 1
        assert d.alive()
        _ip("link", "set", host_if, "up")
        view, _ = wait_members(members, lambda v: v.node_ids == ("node-p",))
        assert view.addresses == (f"{ns_ip}:{NS_DATA_PORT}",)
        assert d.stop() == 0  # its log is complete once it has exited
        log = d.log_tail(20000)
        assert "event=cluster_lease_expired node_id=node-p" in log
        assert "event=cluster_re_registered node_id=node-p" in log
    finally:
        members.close()
        if d is not None:
            d.kill()
        etcd.stop()
