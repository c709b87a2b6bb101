"""Fixtures of the tests of auth, body limits and the CLI: one real kvtierd with a token.

    from token_daemon import AUTH, TOKEN, token_daemon, token_http  # noqa: F401  (fixtures)

``token_daemon`` is a kvtierd on small devices in a temporary directory, its admin API on a
free loopback port, the data port and the admin API both taking ``TOKEN`` (the file it was
read from is ``token_daemon.token_file``). One daemon serves a whole test module; it is
stopped with SIGTERM after the module's last test and must exit 0. ``token_http`` is an
httpx client of its admin API that sends no token unless a test adds ``AUTH``.
``open_state`` is the in-process twin: a ready ``DaemonState`` over a real engine, for tests
that drive the admin app without a daemon process.
"""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from daemon_proc import KvtierdProcess, start_kvtierd

from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.engine import Engine
from kvtier.daemon.state import DaemonState

TOKEN = "token-daemon-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HTTP_TIMEOUT_S = 30.0  # an admin request on a loaded CI machine answers well within this


@pytest.fixture(scope="module")
def token_daemon(tmp_path_factory) -> Iterator[KvtierdProcess]:
    root = tmp_path_factory.mktemp("token-daemon")
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    daemon = start_kvtierd(root / "store", "--token-file", str(token_file), admin="127.0.0.1:0")
    daemon.token_file = token_file
    yield daemon
    assert daemon.stop() == 0, daemon.log_tail()


@pytest.fixture(scope="module")
def token_http(token_daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{token_daemon.admin_addr}", timeout=HTTP_TIMEOUT_S) as client:
        yield client


def open_state(tmp_path, token_file: str | None = None) -> DaemonState:
    """A ready daemon state over a new engine in ``tmp_path``; the caller closes ``state.engine``."""
    cfg = DaemonConfig(data_dir=str(tmp_path), device_size_bytes=8 << 20, stripe_size_bytes=64 << 10,
                       region_size_bytes=1 << 20, token_file=token_file)
    state = DaemonState(cfg, Engine.open(cfg.engine_config(), create_if_missing=True))
    state.set_ready(True)
    return state
