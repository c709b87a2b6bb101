"""kvtierd refuses settings it cannot serve safely at start, exit 2 naming the setting, before it
creates or opens anything (real kvtierd processes)."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from daemon_proc import DEFAULT_ARGS

from kvtier.daemon.config import ConfigError, config_from_args

EXIT_CONFIG = 2
REFUSAL_TIMEOUT_S = 30.0  # a refused start exits at once; one that serves instead is stopped after this
STOP_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kvtierd(tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvtier.daemon.main", "--data-dir", str(tmp_path / "store"),
               *DEFAULT_ARGS, *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=REFUSAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # it serves: stop it, report what it printed
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=STOP_TIMEOUT_S)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _assert_refused(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == EXIT_CONFIG, (result.returncode, result.stdout, result.stderr)
    assert "kvtierd ready" not in result.stdout
    assert fragment in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_an_empty_token_file_path_is_refused_not_taken_for_no_token(tmp_path):
    _assert_refused(_kvtierd(tmp_path, "--listen", "0.0.0.0:0", "--admin", "none", "--token-file", ""),
                    "token_file")
    config = tmp_path / "k.toml"
    config.write_text('token_file = ""\n')
    with pytest.raises(ConfigError, match="token_file"):
        config_from_args(["--config", str(config)])


def test_the_same_address_for_data_and_admin_is_refused_before_any_device_is_made(tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    _assert_refused(_kvtierd(tmp_path, "--listen", address, "--admin", address), "admin")
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").glob("device*.img"))


def test_a_device_listed_twice_is_a_config_error(tmp_path):
    device = str(tmp_path / "d0.img")
    _assert_refused(_kvtierd(tmp_path, "--device", device, "--device", device, "--format"), "twice")


def test_a_region_size_the_stripes_do_not_divide_is_a_config_error(tmp_path):
    _assert_refused(_kvtierd(tmp_path, "--region-size", "1536k"), "region_size")
