"""Network namespaces joined to the host's by a veth pair, and a kvtierd started inside one
(the partition, pull-through WAN and CDN tests and benchmarks). Needs root and ``ip netns``."""
from __future__ import annotations

import secrets
import subprocess
from contextlib import contextmanager

from daemon_proc import KvtierdProcess

NS_DATA_PORT = 17410  # inside the namespace nothing else listens
IP_TIMEOUT_S = 10.0


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT_S)


@contextmanager
def veth_namespace(subnet_prefix: str):
    """``(namespace, host-side veth, host address, namespace address)`` of a fresh namespace
    on a /30 under ``subnet_prefix`` (e.g. ``"10.213"``); removed afterwards. The namespace
    end of the pair is named ``"kvn" + host_if[3:]``."""
    tag = secrets.token_hex(3)
    name, host_if, ns_if = f"kvt-{tag}", f"kvh{tag}", f"kvn{tag}"
    subnet = 16 + int(tag[:2], 16) % 200
    host_ip, ns_ip = f"{subnet_prefix}.{subnet}.1", f"{subnet_prefix}.{subnet}.2"
    ip("netns", "add", name)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", name)
        ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", name, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        ip("-n", name, "link", "set", ns_if, "up")
        ip("-n", name, "link", "set", "lo", "up")
        yield name, host_if, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=IP_TIMEOUT_S)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=IP_TIMEOUT_S)


class NetnsKvtierd(KvtierdProcess):
    """A kvtierd started inside network namespace ``netns``."""

    def __init__(self, netns: str, data_dir, args):
        self.netns = netns
        super().__init__(data_dir, args)

    @property
    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *super().command]
