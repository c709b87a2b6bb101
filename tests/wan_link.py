"""A region kvtierd across a shaped "WAN" link from the edge, for the pull-through tests and
``perf/bench_upstream.py``.

The region runs in its own network namespace (``netns.veth_namespace`` and ``NetnsKvtierd``), joined to the host's by a veth pair; both ends of the pair
get a tbf qdisc (the rate), and a :class:`~upstream_proxy.FrameProxy` on the host side adds
the latency (this kernel has tbf, not netem). The edge runs on the host and dials the proxy::

    edge (host) --> FrameProxy(delay) --> veth [tbf] ==== [tbf] veth --> region (netns)
"""
from __future__ import annotations

import subprocess
from contextlib import contextmanager
from dataclasses import dataclass

from daemon_proc import DEFAULT_ARGS, _merge
from netns import NS_DATA_PORT, NetnsKvtierd, veth_namespace
from netns import ip as _ip
from upstream_proxy import FrameProxy

WAN_RATE = "1gbit"
WAN_BURST = "256kb"  # tbf's bucket: at least rate / HZ, with room for a few 64 KiB segments
WAN_QUEUE_LATENCY = "100ms"  # how long a packet may wait in tbf before it is dropped
WAN_DELAY_S = 0.020  # one reply frame held this long: the round trip a 20 ms WAN adds
REGION_TOKEN = "region-wan-secret"


@contextmanager
def wan_namespace():
    """``(namespace, host-side veth, host address, namespace address)``: a fresh namespace for
    the region (for scripts outside pytest too); removed afterwards. Needs root."""
    with veth_namespace("10.214") as joined:
        yield joined


def shape(netns: str, host_if: str, rate: str = WAN_RATE) -> None:
    """tbf at ``rate`` on both ends of the veth pair (the namespace's end is its only non-lo link)."""
    _ip_tc(["qdisc", "replace", "dev", host_if, "root", "tbf", "rate", rate, "burst", WAN_BURST,
            "latency", WAN_QUEUE_LATENCY])
    ns_if = "kvn" + host_if[3:]
    _ip_tc(["qdisc", "replace", "dev", ns_if, "root", "tbf", "rate", rate, "burst", WAN_BURST,
            "latency", WAN_QUEUE_LATENCY], netns)


def _ip_tc(args: list[str], netns: str | None = None) -> None:
    command = (["ip", "netns", "exec", netns] if netns else []) + ["tc", *args]
    subprocess.run(command, check=True, capture_output=True, timeout=10)


@dataclass
class WanRegion:
    region: NetnsKvtierd
    proxy: FrameProxy
    address: str  # the region's data address inside its namespace (direct, no proxy)

    def close(self) -> None:
        self.proxy.close()
        self.region.kill()


def start_wan_region(netns_info, data_dir, token_file) -> WanRegion:
    name, host_if, _host_ip, ns_ip = netns_info
    token_file.write_text(REGION_TOKEN + "\n")
    args = _merge(list(DEFAULT_ARGS) + ["--admin", "none"],
                  ["--listen", f"{ns_ip}:{NS_DATA_PORT}", "--token-file", str(token_file),
                   "--device-size", "256m", "--region-size", "8m"])
    region = NetnsKvtierd(name, data_dir, args)
    shape(name, host_if)
    proxy = FrameProxy(f"{ns_ip}:{NS_DATA_PORT}")
    proxy.delay_s = WAN_DELAY_S
    return WanRegion(region, proxy, f"{ns_ip}:{NS_DATA_PORT}")


__all__ = ["WanRegion", "start_wan_region", "shape", "wan_namespace", "_ip", "REGION_TOKEN", "WAN_DELAY_S"]
