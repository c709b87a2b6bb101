"""Shared fixtures: ``kvtierd`` starts a real daemon on small devices in tmp_path."""
import pytest

from daemon_proc import start_kvtierd  # tests/ is on sys.path (rootdir conftest)


@pytest.fixture
def kvtierd(tmp_path):
    """A running kvtierd (``--admin none``); stopped with SIGTERM afterwards."""
    daemon = start_kvtierd(tmp_path / "kvtierd")
    yield daemon
    if daemon.alive():
        code = daemon.stop()
        assert code == 0, f"kvtierd exited {code}; log tail:\n{daemon.log_tail()}"
