"""Shared fixtures: ``kvtierd`` starts a real daemon on small devices in tmp_path.

Every test that starts an etcd (the ``etcd`` fixture, or an ``EtcdServer`` of its own) or a
network namespace (``netns``) is marked ``slow``: ``make test`` leaves them out, ``make
test-all`` (CI) runs them."""
import pytest

SLOW_FIXTURES = {"etcd", "netns"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)

from daemon_proc import start_kvtierd  # tests/ is on sys.path (rootdir conftest)


@pytest.fixture
def kvtierd(tmp_path):
    """A running kvtierd (``--admin none``); stopped with SIGTERM afterwards."""
    daemon = start_kvtierd(tmp_path / "kvtierd")
    yield daemon
    if daemon.alive():
        code = daemon.stop()
        assert code == 0, f"kvtierd exited {code}; log tail:\n{daemon.log_tail()}"
