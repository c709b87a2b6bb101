"""Exclusive device access and start-up refusals, with real kvtierd and kvtier processes.

A second kvtierd, ``kvtier fsck`` (with or without ``--repair``) or ``kvtier format``
on the devices of a running store is refused, naming the device and the holder's
PID; the running daemon keeps serving. A missing device file is named as missing
and nothing is created without ``--format``; the ``--format`` refusal names ``--force``.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from daemon_proc import DEFAULT_ARGS, start_kvtierd

from kvtier.client import BlockClient
from kvtier.common.blockformat import encode_block, payload_of

GEOMETRY = ("--device-size", "64m", "--region-size", "4m", "--stripe-size", "256k")


def run(module: str, args: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s)


def kvtierd(args: list[str]) -> subprocess.CompletedProcess:
    return run("kvtier.daemon.main", [*DEFAULT_ARGS, "--admin", "none", *args])


def kvtier(args: list[str]) -> subprocess.CompletedProcess:
    return run("kvtier.tools.admin_cli", args)


def put_and_get(addr: str, tag: int) -> None:
    key = bytes([tag]) * 16
    payload = b"still serving %d" % tag
    with BlockClient(addr) as client:
        client.put(key, encode_block(key, bytes(16), 0, payload))
        assert payload_of(client.get(key)) == payload


def explicit_devices(tmp_path) -> list[str]:
    args = []
    for i in range(2):
        args += ["--device", str(tmp_path / f"dev{i}.img")]
    return args


def test_a_second_kvtierd_on_the_same_data_dir_is_refused_naming_the_device_and_pid(tmp_path):
    first = start_kvtierd(tmp_path / "data")
    try:
        second = kvtierd(["--data-dir", str(tmp_path / "data")])
        assert second.returncode == 1, second.stderr
        assert "device0.img is in use" in second.stderr and f"locked by process {first.pid}" in second.stderr
        assert first.alive()
        put_and_get(first.data_addr, 1)
    finally:
        assert first.stop() == 0, first.log_tail()
    again = start_kvtierd(tmp_path / "data")  # the lock goes with the process
    assert again.stop() == 0


@pytest.mark.parametrize("command", [["fsck", "--repair"], ["fsck"], ["format", "--force"], ["format"]])
def test_fsck_and_format_against_a_running_daemon_are_refused(tmp_path, command):
    devices = explicit_devices(tmp_path)
    daemon = start_kvtierd(tmp_path / "data", *devices, "--format")
    try:
        put_and_get(daemon.data_addr, 2)
        out = kvtier([command[0], *devices, *GEOMETRY, *command[1:]])
        assert out.returncode == (8 if command[0] == "fsck" else 1), (out.stdout, out.stderr)  # fsck: not run
        assert "dev0.img is in use" in out.stderr and f"locked by process {daemon.pid}" in out.stderr
        put_and_get(daemon.data_addr, 3)
    finally:
        assert daemon.stop() == 0, daemon.log_tail()
    stopped = kvtier(["fsck", *devices, *GEOMETRY])  # the same check on the stopped store runs
    assert stopped.returncode == 0, (stopped.stdout, stopped.stderr)


def test_missing_explicit_devices_are_named_and_not_created(tmp_path):
    out = kvtierd(["--data-dir", str(tmp_path / "data"), *explicit_devices(tmp_path)])
    assert out.returncode == 1
    assert f"devices {tmp_path / 'dev0.img'}, {tmp_path / 'dev1.img'} are missing" in out.stderr
    assert "--format" in out.stderr and "bad magic" not in out.stderr
    assert not (tmp_path / "dev0.img").exists() and not (tmp_path / "dev1.img").exists()


def test_embedded_default_formats_on_first_run_and_then_names_a_missing_file(tmp_path):
    data = tmp_path / "data"
    first = start_kvtierd(data)  # none of the device files: a first run, formatted
    assert first.stop() == 0
    (data / "device2.img").unlink()
    out = kvtierd(["--data-dir", str(data)])
    assert out.returncode == 1
    assert f"device {data / 'device2.img'} is missing" in out.stderr and "bad magic" not in out.stderr
    assert not (data / "device2.img").exists()


def test_the_format_refusal_names_the_force_flag(tmp_path):
    devices = explicit_devices(tmp_path)
    daemon = start_kvtierd(tmp_path / "data", *devices, "--format")
    assert daemon.stop() == 0
    out = kvtierd(["--data-dir", str(tmp_path / "data"), *devices, "--format"])
    assert out.returncode == 1
    assert "already holds kvtier store" in out.stderr and "needs --force" in out.stderr
    assert "force=True" not in out.stderr
    cli = kvtier(["format", *devices, *GEOMETRY])
    assert cli.returncode == 1 and "needs --force" in cli.stderr and "force=True" not in cli.stderr
