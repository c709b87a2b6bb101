"""The ``kvtier`` CLI answers bad flags, unwritable outputs and a wrong peer with one line naming the
problem and its exit status, never a traceback (a real kvtierd, the CLI as a process)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from daemon_proc import start_kvtierd

from kvtier.client import BlockClient
from kvtier.common.blockformat import encode_block

TOKEN = "cli-errors-token"
EXIT_FAILED, EXIT_USAGE = 1, 2
RUN_TIMEOUT_S = 60.0
KEY = bytes(range(16))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "token").write_text(TOKEN)
    d = start_kvtierd(root / "store", "--token-file", str(root / "token"), admin="127.0.0.1:0")
    with BlockClient(d.data_addr, token=TOKEN) as client:
        client.put(KEY, encode_block(KEY, bytes(16), 0, b"payload"))
    yield d
    assert d.stop() == 0, d.log_tail()


def _kvtier(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.tools.admin_cli", *args], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, env={"PATH": "/usr/bin:/bin"})


def _assert_one_line_error(result: subprocess.CompletedProcess, code: int, fragment: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and fragment in result.stderr, result.stderr


def test_get_into_an_unwritable_file_names_it(daemon, tmp_path):
    target = tmp_path / "no-such-dir" / "out.bin"
    result = _kvtier("--admin", daemon.admin_addr, "--token", TOKEN, "get", KEY.hex(), "-o", str(target))
    _assert_one_line_error(result, EXIT_USAGE, str(target))


def test_an_admin_address_that_is_not_an_http_server_names_the_address(daemon):
    result = _kvtier("--admin", daemon.data_addr, "--token", TOKEN, "status")
    _assert_one_line_error(result, EXIT_FAILED, daemon.data_addr)


def test_a_token_and_a_token_file_together_are_refused(daemon, tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    result = _kvtier("--admin", daemon.admin_addr, "--token", "other", "--token-file", str(tmp_path / "token"), "status")
    _assert_one_line_error(result, EXIT_USAGE, "not allowed with argument --token")


@pytest.mark.parametrize("command", ["format", "fsck"])
@pytest.mark.parametrize("flags, fragment", [(["--region-size", "3k"], "region_size"),
                                             (["--device-size", "1000"], "device_size"),
                                             (["--device", "{dev}"], "twice")])
def test_offline_commands_name_a_bad_geometry(tmp_path, command, flags, fragment):
    device = str(tmp_path / "d0.img")
    args = [command, "--device", device, *(f.format(dev=device) for f in flags)]
    _assert_one_line_error(_kvtier(*args), EXIT_USAGE, fragment)
