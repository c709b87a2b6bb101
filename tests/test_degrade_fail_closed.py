"""An unexpected exception inside the engine fails it closed: the request gets INTERNAL,
readiness goes false, the daemon exits EXIT_ENGINE_FAILED (4) without sealing what it can no
longer trust, and a restart recovers from flash every acknowledged durable block."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from daemon_proc import KvtierdProcess, start_kvtierd
from kvtier.client import BlockClient, RemoteError
from kvtier.common.blockformat import encode_block
from kvtier.daemon.config import config_from_args
from kvtier.daemon.engine import EngineFailedError
from kvtier.daemon.main import EXIT_ENGINE_FAILED, Daemon
from kvtier.wire.events import ErrorCode

EXIT_WAIT_S = 30.0  # a daemon stopping without a seal takes well under a second


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, size: int = 3000) -> bytes:
    return encode_block(key(i), bytes(16), 1, np.random.default_rng(i).integers(0, 256, size, np.uint8).tobytes())


class FaultyDeviceDaemon(KvtierdProcess):
    """A real kvtierd process whose device writes raise RuntimeError while ``trigger`` exists."""

    def __init__(self, data_dir: Path, args: list[str], trigger: Path):
        self.trigger = trigger
        super().__init__(data_dir, args)

    @property
    def command(self) -> list[str]:
        child = Path(__file__).with_name("faulty_device_daemon.py")
        return [sys.executable, str(child), str(self.trigger), "--data-dir", str(self.data_dir), *self.args]


def test_unexpected_engine_exception_exits_non_zero_and_restart_recovers(tmp_path):
    plain = start_kvtierd(tmp_path / "d")  # formats the store, then hands it over
    args = plain.args
    assert plain.stop() == 0
    trigger = tmp_path / "fault-now"
    d = FaultyDeviceDaemon(tmp_path / "d", args, trigger)
    with BlockClient(d.data_addr, pool_size=1) as c:
        for i in range(5):
            c.put(key(i), block(i), durable=True)
        trigger.touch()
        with pytest.raises(RemoteError) as info:
            c.put(key(99), block(99), durable=True)
    assert info.value.code == ErrorCode.INTERNAL and "failed closed" in str(info.value)
    assert "RuntimeError" in str(info.value) and "injected bug" in str(info.value)
    assert d.proc.wait(EXIT_WAIT_S) == EXIT_ENGINE_FAILED, d.log_tail()
    d.proc.stdout.close()
    log = d.log_tail(20000)
    assert "event=engine_failed" in log and "event=stopped" in log
    trigger.unlink()
    again = start_kvtierd(tmp_path / "d")  # what systemd's Restart=on-failure does
    try:
        with BlockClient(again.data_addr) as c:
            assert c.lookup([key(i) for i in range(5)]) == 5
            assert all(c.get(key(i))[64:] == block(i)[64:] for i in range(5))
    finally:
        assert again.stop() == 0, again.log_tail()


def in_process_daemon(tmp_path, admin: str = "none") -> Daemon:
    """A kvtierd in this process on small devices, started and ready."""
    cfg = config_from_args(["--data-dir", str(tmp_path / "d"), "--device-size", "64m", "--region-size", "4m",
                            "--stripe-size", "256k", "--listen", "127.0.0.1:0", "--admin", admin])
    daemon = Daemon(cfg)
    daemon.start()
    daemon.state.set_ready(True)
    return daemon


def test_failed_engine_makes_the_daemon_not_ready_and_refuses_requests(tmp_path):
    daemon = in_process_daemon(tmp_path)
    try:
        engine = daemon.state.engine
        engine.fail("AssertionError in Put: test")
        assert not daemon.state.ready and daemon.engine_failure == "AssertionError in Put: test"
        with pytest.raises(EngineFailedError, match="failed closed"):
            engine.lookup([key(1)])
        host, port = daemon.state.data_address[:2]
        with BlockClient(f"{host}:{port}") as c:
            with pytest.raises(RemoteError) as info:
                c.lookup([key(1)])
        assert info.value.code == ErrorCode.SHUTTING_DOWN
    finally:
        assert daemon.shutdown()  # closes without sealing


def test_a_bug_outside_the_engine_fails_its_request_and_connection_and_the_daemon_serves_on(tmp_path, monkeypatch):
    import urllib.error
    import urllib.request

    from kvtier.daemon.admin.view import AdminStateView
    from kvtier.wire import connection as p

    daemon = in_process_daemon(tmp_path, admin="127.0.0.1:0")
    try:
        handler = daemon.state.data_server._handler

        def stats_bug(msg, session, token):
            raise RuntimeError("a bug in the STATS reply")
        monkeypatch.setitem(handler._dispatch, p.Stats, stats_bug)
        host, port = daemon.state.data_address[:2]
        with BlockClient(f"{host}:{port}", pool_size=1) as c:
            c.put(key(1), block(1), durable=True)
            with pytest.raises(RemoteError) as info:
                c.stats()
        assert info.value.code == ErrorCode.INTERNAL and "a bug in the STATS reply" in str(info.value)
        assert "serves on" in str(info.value)
        with BlockClient(f"{host}:{port}") as c:  # the engine did not fail: every other client is served
            assert c.lookup([key(1)]) == 1 and c.get(key(1))[64:] == block(1)[64:]
            c.put(key(2), block(2))
        assert daemon.engine_failure is None and daemon.state.ready

        monkeypatch.setattr(AdminStateView, "server_statistics", lambda self: 1 / 0)
        admin = "http://%s:%d" % daemon.state.admin_address[:2]
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(admin + "/v1/stats", timeout=10)
        assert http.value.code == 500 and b"ZeroDivisionError" in http.value.read()
        monkeypatch.undo()
        metrics = urllib.request.urlopen(admin + "/metrics", timeout=10).read().decode()
        assert "kvtier_admin_internal_errors_total 1.0" in metrics
        assert daemon.engine_failure is None and daemon.state.ready
    finally:
        assert daemon.shutdown()
