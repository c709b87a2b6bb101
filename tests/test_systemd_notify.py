"""kvtierd under a real $NOTIFY_SOCKET (an AF_UNIX datagram socket, as systemd makes):
READY, WATCHDOG and STOPPING in order; SIGHUP reloads the token and log level without
dropping connections; SIGTERM drains and loses nothing acknowledged."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest
from daemon_proc import start_kvtierd

from kvtier.client import BlockClient, ClientError, RemoteError
from kvtier.common.blockformat import encode_block, payload_of

from test_systemd import UNIT, unit_settings

NOTIFY_WAIT_S = 30.0  # a message the daemon owes us; generous for a loaded machine
WATCHDOG_USEC = 2_000_000  # pings every 1 s; systemd would kill after 2 s without one


class NotifySocket:
    """The receiving end of sd_notify: a bound AF_UNIX datagram socket."""

    def __init__(self, address: str) -> None:
        self.env_value = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(NOTIFY_WAIT_S)
        self.messages: list[tuple[float, dict[str, str]]] = []

    def receive(self) -> dict[str, str]:
        data = self.sock.recv(4096)
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append((time.monotonic(), fields))
        return fields

    def wait_for(self, key: str, value: str = "1") -> dict[str, str]:
        """Receive until a message carries key=value (blocks on the socket, no polling)."""
        while True:
            fields = self.receive()
            if fields.get(key) == value:
                return fields

    def close(self) -> None:
        self.sock.close()


def _env(notify: NotifySocket, **extra: str) -> dict:
    env = dict(os.environ)
    env.pop("WATCHDOG_PID", None)
    env.update(NOTIFY_SOCKET=notify.env_value, **extra)
    return env


def test_ready_watchdog_stopping_in_order_and_sigterm_drains(tmp_path):
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    d = start_kvtierd(tmp_path / "store", env=_env(notify, WATCHDOG_USEC=str(WATCHDOG_USEC)))
    try:
        ready = notify.wait_for("READY")
        assert "serving" in ready.get("STATUS", "")
        assert f"data={d.data_addr}" in ready["STATUS"]
        for _ in range(3):
            notify.wait_for("WATCHDOG")

        # SIGTERM while a client is putting: every acknowledged put survives
        acked: list[bytes] = []
        started = threading.Event()
        failure: list[BaseException] = []

        def writer():
            with BlockClient(d.data_addr, pool_size=1, timeout_s=30) as client:
                try:
                    for i in range(100_000):
                        key = i.to_bytes(16, "little")
                        client.put(key, encode_block(key, bytes(16), 0, bytes([i & 0xFF]) * 20_000))
                        acked.append(key)
                        started.set()
                except ClientError as exc:  # the daemon closed the connection: expected after SIGTERM
                    failure.append(exc)
                finally:
                    started.set()

        thread = threading.Thread(target=writer)
        thread.start()
        assert started.wait(NOTIFY_WAIT_S)
        d.signal(signal.SIGTERM)
        notify.wait_for("STOPPING")
        assert d.proc.wait(60) == 0, d.log_tail()
        thread.join(60)
        assert not thread.is_alive()
        assert acked, "the writer never got a put acknowledged"
    finally:
        if d.alive():
            d.kill()
        notify.close()

    first = notify.messages[0][1]
    assert "READY" not in first and "recovering" in first.get("STATUS", ""), first  # said before the index rebuild
    kinds = [next(k for k in ("READY", "WATCHDOG", "STOPPING", "RELOADING") if k in m) for _, m in notify.messages[1:]]
    assert kinds[0] == "READY" and kinds[-1] == "STOPPING"
    assert set(kinds[1:-1]) == {"WATCHDOG"} and len(kinds) >= 5
    pings = [t for t, m in notify.messages if "WATCHDOG" in m]
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert max(gaps) < WATCHDOG_USEC / 1e6, f"watchdog gaps {gaps}: systemd would have killed the daemon"

    # restart on the same store: nothing acknowledged was lost
    d.proc.stdout.close()
    d.start()
    try:
        with BlockClient(d.data_addr) as client:
            got = client.get_many(acked)
        missing = [k.hex() for k, b in zip(acked, got) if b is None]
        assert not missing, f"{len(missing)} of {len(acked)} acknowledged blocks lost: {missing[:3]}"
        i = int.from_bytes(acked[-1], "little")
        assert bytes(payload_of(got[-1])) == bytes([i & 0xFF]) * 20_000
    finally:
        assert d.stop() == 0, d.log_tail()


def _exec_reload(pid: int) -> None:
    """Run the unit's ExecReload= command line, as systemd would, with $MAINPID set."""
    (command,) = unit_settings(UNIT.read_text())["Service.ExecReload"]
    argv = [arg.replace("$MAINPID", str(pid)) for arg in shlex.split(command)]
    subprocess.run(argv, check=True, timeout=30)


def test_sighup_reloads_token_and_log_level_without_dropping_connections(tmp_path):
    notify = NotifySocket(f"@kvtier-test-{os.getpid()}-{time.monotonic_ns()}")  # abstract namespace
    token_file = tmp_path / "token"
    token_file.write_text("old-token\n")
    config = tmp_path / "kvtierd.toml"
    config.write_text(f'token_file = "{token_file}"\nlog_level = "info"\n')
    d = start_kvtierd(tmp_path / "store", "--config", str(config), admin="127.0.0.1:0", env=_env(notify))
    http = httpx.Client(base_url=f"http://{d.admin_addr}", timeout=30)
    try:
        notify.wait_for("READY")
        key = bytes(range(16))
        old_client = BlockClient(d.data_addr, token="old-token", pool_size=1)
        old_client.put(key, encode_block(key, bytes(16), 0, b"before reload"))
        assert http.get("/v1/stats", headers={"Authorization": "Bearer old-token"}).status_code == 200

        token_file.write_text("new-token\n")
        config.write_text(f'token_file = "{token_file}"\nlog_level = "debug"\n')
        _exec_reload(d.pid)
        notify.wait_for("RELOADING")
        notify.wait_for("READY")

        assert http.get("/v1/stats", headers={"Authorization": "Bearer old-token"}).status_code == 401
        stats = http.get("/v1/stats", headers={"Authorization": "Bearer new-token"})
        assert stats.status_code == 200
        # the connection opened with the old token is still up and serving
        assert bytes(payload_of(old_client.get(key))) == b"before reload"
        assert old_client.statistics().reconnects == 0
        assert stats.json()["server"]["open_connections"] >= 1
        old_client.close()
        with pytest.raises(RemoteError):
            with BlockClient(d.data_addr, token="old-token") as client:
                client.get(key)
        with BlockClient(d.data_addr, token="new-token") as client:
            assert client.get(key) is not None
        assert "log_level=debug" in d.log_tail(20000)

        # a broken config on reload: the error is logged, the old settings stay, serving goes on
        config.write_text('log_level = "loud"\n')
        _exec_reload(d.pid)
        notify.wait_for("READY")
        assert "reload_failed" in d.log_tail(20000) and "loud" in d.log_tail(20000)
        assert http.get("/v1/stats", headers={"Authorization": "Bearer new-token"}).status_code == 200
    finally:
        http.close()
        code = d.stop()
        notify.close()
    assert code == 0, d.log_tail()
