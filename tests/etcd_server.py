"""A real etcd for tests (and ``make cluster``): Debian's ``etcd-server``, on loopback.

    etcd = EtcdServer(tmp_path / "etcd")   # random free ports, a temp data dir; started
    etcd.url("kvtier")                     # "etcd://127.0.0.1:PORT/kvtier"
    etcd.kill()  ;  etcd.start()           # kill -9, then back on the same ports and data
    etcd.stop()

The ports are found free by binding port 0 and closing; the short window until etcd
binds them is a race a test retries by starting again.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from ports import free_port

ETCD_BINARY = shutil.which("etcd") or "/usr/bin/etcd"
READY_TIMEOUT_S = 20.0  # etcd's first start writes its WAL and elects itself
STOP_TIMEOUT_S = 10.0
READY_POLL_S = 0.05  # /health answers within milliseconds once etcd serves


def etcd_missing_reason() -> str | None:
    """Why the cluster tests cannot run here, or None."""
    if not os.access(ETCD_BINARY, os.X_OK):
        return "etcd is not installed (apt-get install etcd-server; .ci/run does)"
    try:
        import etcd3gw  # noqa: F401
    except ModuleNotFoundError:
        return "etcd3gw is not installed (pip install -e '.[test]' or '.[cluster]')"
    return None


START_ATTEMPTS = 3  # fresh ports after a bind race


class PortTaken(RuntimeError):
    """etcd could not bind a port free_port() had found free."""


class EtcdServer:
    def __init__(self, data_dir: Path, client_port: int | None = None, name: str = "kvtier-test",
                 also_listen: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.also_listen = also_listen  # another local address to serve clients on (a veth's, for netns tests)
        self.name = name
        self.client_port = client_port or free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        for attempt in range(START_ATTEMPTS):
            try:
                self.start()
                return
            except PortTaken:  # another process bound a port between free_port() and etcd's bind
                if attempt + 1 == START_ATTEMPTS:
                    raise
                self.client_port = client_port or free_port()
                self.peer_port = free_port()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str = "kvtier") -> str:
        return f"etcd://{self.endpoint}/{prefix}"

    def start(self) -> None:
        assert not self.alive(), "etcd already running"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        listen = client if self.also_listen is None else f"{client},http://{self.also_listen}:{self.client_port}"
        cmd = [ETCD_BINARY, "--name", self.name, "--data-dir", str(self.data_dir),
               "--listen-client-urls", listen, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
               "--log-level", "warn", "--logger", "zap"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(READY_POLL_S)  # polling a process we started: nothing to wait on instead
        self.kill()
        tail = self.log_tail()
        kind = PortTaken if "address already in use" in tail else RuntimeError
        raise kind(f"etcd did not become healthy on {self.endpoint}; log tail:\n{tail}")

    def log_tail(self, nbytes: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9, as a crash."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
