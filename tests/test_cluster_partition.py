"""A member cut off from etcd by a partition (its own network namespace, the veth link
set down) leaves when its lease expires and registers again once the link is back.

Needs root and ``ip netns``; skipped otherwise. The namespace and its veth pair are
removed afterwards, and the partition lasts only until the lease is seen gone.
"""
import os
import secrets
import subprocess

import pytest

from cluster_fixtures import LEASE_TTL_S, wait_members
from daemon_proc import KvtierdProcess, _merge, DEFAULT_ARGS
from etcd_server import EtcdServer, etcd_missing_reason
from kvtier.client.cluster_members import open_members

NS_DATA_PORT = 17410  # inside the namespace nothing else listens
IP_TIMEOUT_S = 10.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT_S)


class NetnsKvtierd(KvtierdProcess):
    """A kvtierd started inside network namespace ``netns``."""

    def __init__(self, netns: str, data_dir, args):
        self.netns = netns
        super().__init__(data_dir, args)

    @property
    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *super().command]


@pytest.fixture
def netns():
    """(namespace, host-side veth, host address, namespace address); removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = secrets.token_hex(3)
    name, host_if, ns_if = f"kvt-{tag}", f"kvh{tag}", f"kvn{tag}"
    subnet = 16 + int(tag[:2], 16) % 200
    host_ip, ns_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", name, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _ip("-n", name, "link", "set", ns_if, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield name, host_if, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=IP_TIMEOUT_S)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=IP_TIMEOUT_S)


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
