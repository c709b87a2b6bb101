"""The ``kvtier`` CLI answers bad flags, unwritable outputs and a wrong peer with one line naming the
problem and its exit status, never a traceback (a real kvtierd, the CLI as a process)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import pytest
from token_daemon import TOKEN, token_daemon  # noqa: F401  (fixture)

from kvtier.client import BlockClient
from kvtier.common.blockformat import encode_block

EXIT_FAILED, EXIT_USAGE = 1, 2
RUN_TIMEOUT_S = 60.0
KEY = bytes(range(16))
REGION_BYTES = 4 << 20  # daemon_proc's default region: no block reaches it
CUT_BODY_BYTES = 32 << 20  # more than loopback's socket buffers hold: the send is cut, not finished


def _kvtier(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.tools.admin_cli", *args], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, env={"PATH": "/usr/bin:/bin"})


def _assert_one_line_error(result: subprocess.CompletedProcess, code: int, fragment: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and fragment in result.stderr, result.stderr


def test_get_into_an_unwritable_file_names_it(token_daemon, tmp_path):
    with BlockClient(token_daemon.data_addr, token=TOKEN) as client:
        client.put(KEY, encode_block(KEY, bytes(16), 0, b"payload"))
    target = tmp_path / "no-such-dir" / "out.bin"
    result = _kvtier("--admin", token_daemon.admin_addr, "--token", TOKEN, "get", KEY.hex(), "-o", str(target))
    _assert_one_line_error(result, EXIT_USAGE, str(target))


def test_an_admin_address_that_is_not_an_http_server_names_the_address(token_daemon):
    result = _kvtier("--admin", token_daemon.data_addr, "--token", TOKEN, "status")
    _assert_one_line_error(result, EXIT_FAILED, token_daemon.data_addr)


def test_a_token_and_a_token_file_together_are_refused(token_daemon, tmp_path):
    result = _kvtier("--admin", token_daemon.admin_addr, "--token", "other", "--token-file",
                     str(token_daemon.token_file), "status")
    _assert_one_line_error(result, EXIT_USAGE, "not allowed with argument --token")


@pytest.mark.parametrize("size_bytes", [REGION_BYTES, 4 * REGION_BYTES])
def test_a_put_larger_than_a_block_may_be_names_the_limit(token_daemon, tmp_path, size_bytes):
    (tmp_path / "big.bin").write_bytes(b"\x5a" * size_bytes)
    result = _kvtier("--admin", token_daemon.admin_addr, "--token", TOKEN, "put", "33" * 16, str(tmp_path / "big.bin"))
    _assert_one_line_error(result, EXIT_FAILED, "HTTP 413")
    assert "over the limit of" in result.stderr and "the largest block a region holds" in result.stderr
    assert "reset" not in result.stderr, result.stderr


def test_a_put_to_a_server_that_answers_and_closes_in_the_middle_of_the_body_reports_its_answer(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"\x5a" * CUT_BODY_BYTES)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = threading.Thread(target=_answer_413_after_a_little_of_the_body, args=(listener,), daemon=True)
        server.start()
        address = "127.0.0.1:%d" % listener.getsockname()[1]
        result = _kvtier("--admin", address, "put", "33" * 16, str(tmp_path / "big.bin"))
        server.join(RUN_TIMEOUT_S)
    _assert_one_line_error(result, EXIT_FAILED, "HTTP 413: too big for this server")


def _answer_413_after_a_little_of_the_body(listener: socket.socket) -> None:
    """A server that says 100 Continue, reads a little of the body, answers 413 and closes."""
    conn, _ = listener.accept()
    with conn:
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        conn.recv(65536)
        body = json.dumps({"error": "too_large", "message": "too big for this server"}).encode()
        conn.sendall(b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


@pytest.mark.parametrize("command", ["format", "fsck"])
@pytest.mark.parametrize("flags, fragment", [(["--region-size", "3k"], "region_size"),
                                             (["--device-size", "1000"], "device_size"),
                                             (["--device", "{dev}"], "twice")])
def test_offline_commands_name_a_bad_geometry(tmp_path, command, flags, fragment):
    device = str(tmp_path / "d0.img")
    args = [command, "--device", device, *(f.format(dev=device) for f in flags)]
    _assert_one_line_error(_kvtier(*args), EXIT_USAGE, fragment)
