"""A small CDN of real kvtierd processes for ``perf/bench_cdn.py``: one region and its edges on
loopback, each edge with ``--upstream`` at the region; with pre-placement, the region has
``--preplace-edges`` at all of them.

    engine --load/store--> edge kvtierd --miss: pull-through--> region kvtierd
       '--------------- store (write-through of computed KV) ------^
"""
from __future__ import annotations

import json
import socket
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from daemon_proc import KvtierdProcess, start_kvtierd  # noqa: E402

REGION_TOKEN = "cdn-region-secret"
UPSTREAM_TIMEOUT_MS = 2000  # loopback on a loaded 2-core machine: far past any real answer
DEVICE_ARGS = ("--device-size", "64m", "--region-size", "4m")


def free_port() -> int:
    """A port the kernel just handed out (the region must know the edges' ports before they start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PreplaceSettings:
    bytes_per_edge: str = "1m"
    interval_s: float = 1.0
    ttl_s: float = 600.0


@dataclass
class Cdn:
    region: KvtierdProcess
    edges: list[KvtierdProcess]
    token_file: Path

    @property
    def edge_addresses(self) -> list[str]:
        return [e.data_addr for e in self.edges]

    def stop(self) -> None:
        for daemon in [*self.edges, self.region]:
            daemon.stop()

    def kill(self) -> None:
        for daemon in [*self.edges, self.region]:
            daemon.kill()


def start_cdn(workdir: Path, edges: int, preplace: PreplaceSettings | None = None,
              edge_device_args: tuple[str, ...] = DEVICE_ARGS) -> Cdn:
    """A region and ``edges`` edges on fresh stores under ``workdir``, admin APIs on loopback."""
    workdir.mkdir(parents=True, exist_ok=True)
    token_file = workdir / "region-token"
    token_file.write_text(REGION_TOKEN + "\n")
    region_port = free_port()
    edge_ports = [free_port() for _ in range(edges)]
    started: list[KvtierdProcess] = []
    try:
        for i, port in enumerate(edge_ports):
            started.append(start_kvtierd(workdir / f"edge{i}", *edge_device_args, "--listen", f"127.0.0.1:{port}",
                                         "--upstream", f"127.0.0.1:{region_port}",
                                         "--upstream-token-file", str(token_file),
                                         "--upstream-timeout-ms", str(UPSTREAM_TIMEOUT_MS), admin="127.0.0.1:0"))
        region_args = [*DEVICE_ARGS, "--listen", f"127.0.0.1:{region_port}", "--token-file", str(token_file)]
        if preplace is not None:
            region_args += ["--preplace-edges", ",".join(f"127.0.0.1:{p}" for p in edge_ports),
                            "--preplace-bytes", preplace.bytes_per_edge,
                            "--preplace-interval-s", str(preplace.interval_s), "--preplace-ttl-s", str(preplace.ttl_s)]
        region = start_kvtierd(workdir / "region", *region_args, admin="127.0.0.1:0")
    except BaseException:
        for daemon in started:
            daemon.kill()
        raise
    return Cdn(region, started, token_file)


def admin_stats(daemon: KvtierdProcess, token: str | None = None) -> dict:
    """The daemon's ``GET /v1/stats``."""
    request = urllib.request.Request(f"http://{daemon.admin_addr}/v1/stats")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def preplace_push(region: KvtierdProcess, token: str | None = REGION_TOKEN) -> dict:
    """The region's ``POST /v1/preplace/push``: one push round of the hot prefixes now."""
    request = urllib.request.Request(f"http://{region.admin_addr}/v1/preplace/push", data=b"", method="POST")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


__all__ = ["Cdn", "PreplaceSettings", "REGION_TOKEN", "admin_stats", "free_port", "preplace_push", "start_cdn"]
