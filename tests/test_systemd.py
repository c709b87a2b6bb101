"""The systemd integration files: the unit verifies, sysusers/tmpfiles apply to a real
alternate root, and the example config documents (and loads) every setting."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvtier.daemon import config as daemon_config

REPO = Path(__file__).resolve().parent.parent
SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "kvtierd.service"
SYSUSERS = SYSTEMD / "sysusers.d" / "kvtier.conf"
TMPFILES = SYSTEMD / "tmpfiles.d" / "kvtier.conf"
EXAMPLE_TOML = SYSTEMD / "kvtierd.toml"


def unit_settings(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file (repeated keys kept in order), section-qualified."""
    out: dict[str, list[str]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a Key=value line in the unit: {raw!r}"
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (apt-get install systemd)")
    return path


def test_unit_has_the_service_contract():
    s = unit_settings(UNIT.read_text())
    assert s["Service.Type"] == ["notify"]
    assert s["Service.NotifyAccess"] == ["main"]
    assert s["Service.Restart"] == ["on-failure"]
    assert re.fullmatch(r"\d+(s|min)?", s["Service.WatchdogSec"][0])
    assert s["Service.ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["Service.ExecStart"][0].split()[0].endswith("/kvtierd")
    assert s["Service.User"] == ["kvtier"] and s["Service.Group"] == ["kvtier"]
    assert s["Service.StateDirectory"] == ["kvtier"] and s["Service.RuntimeDirectory"] == ["kvtier"]
    assert int(s["Service.LimitNOFILE"][0]) >= 65536
    for hardening, value in (("ProtectSystem", "strict"), ("ProtectHome", "yes"), ("PrivateTmp", "yes"),
                             ("NoNewPrivileges", "yes"), ("DevicePolicy", "closed")):
        assert s[f"Service.{hardening}"] == [value], hardening
    assert any(v.startswith("block-") and v.endswith(" rw") for v in s["Service.DeviceAllow"])
    assert s["Install.WantedBy"] == ["multi-user.target"]


def test_unit_passes_systemd_analyze_verify(tmp_path):
    tool = _need("systemd-analyze")
    # verify checks that ExecStart's binary exists: point a copy at a real one
    text = UNIT.read_text().replace("ExecStart=/usr/bin/kvtierd", f"ExecStart={sys.executable} -m kvtier.daemon.main")
    copy = tmp_path / "kvtierd.service"
    copy.write_text(text)
    result = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "kvtierd.service" in line]
    assert result.returncode == 0, result.stderr
    assert ours == [], ours


SECURITY_EXPOSURE_MAX = 3  # of 10; systemd-analyze rates <= 3.9 "OK"; kvtierd scores about 1.6


def test_unit_security_exposure_stays_low(tmp_path):
    tool = _need("systemd-analyze")
    copy = tmp_path / "kvtierd.service"
    copy.write_text(UNIT.read_text().replace("ExecStart=/usr/bin/kvtierd",
                                             f"ExecStart={sys.executable} -m kvtier.daemon.main"))
    threshold = SECURITY_EXPOSURE_MAX * 10  # --threshold counts on a 0..100 scale
    result = subprocess.run([tool, "security", "--offline=yes", f"--threshold={threshold}", "--no-pager", str(copy)],
                            capture_output=True, text=True, timeout=60)
    if "Unknown option" in result.stderr or "unrecognized option" in result.stderr:
        pytest.skip(f"this systemd-analyze has no offline security review: {result.stderr.strip()}")
    level = re.search(r"Overall exposure level for kvtierd\.service: ([0-9.]+)", result.stdout)
    assert level, result.stdout[-500:] + result.stderr
    assert float(level.group(1)) <= SECURITY_EXPOSURE_MAX and result.returncode == 0


def test_unit_with_a_bad_option_fails_verify(tmp_path):
    """The verify test above can fail: a misspelt option is reported."""
    tool = _need("systemd-analyze")
    text = UNIT.read_text().replace("ExecStart=/usr/bin/kvtierd", f"ExecStart={sys.executable} -m kvtier.daemon.main")
    copy = tmp_path / "kvtierd.service"
    copy.write_text(text.replace("ProtectHome=yes", "ProtectHome=yes\nProtectHomez=yes"))
    result = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert "ProtectHomez" in result.stderr


def test_devices_drop_in_example_verifies(tmp_path):
    tool = _need("systemd-analyze")
    text = UNIT.read_text().replace("ExecStart=/usr/bin/kvtierd", f"ExecStart={sys.executable} -m kvtier.daemon.main")
    (tmp_path / "kvtierd.service").write_text(text)
    dropin = tmp_path / "kvtierd.service.d"
    dropin.mkdir()
    shutil.copy(SYSTEMD / "devices.conf.example", dropin / "devices.conf")
    result = subprocess.run([tool, "verify", str(tmp_path / "kvtierd.service")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_sysusers_and_tmpfiles_apply_to_an_alternate_root(tmp_path):
    sysusers = _need("systemd-sysusers")
    tmpfiles = _need("systemd-tmpfiles")
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles --root chowns to the kvtier user: needs root")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run([sysusers, f"--root={root}", str(SYSUSERS)], check=True, capture_output=True, timeout=60)
    passwd = {line.split(":")[0]: line.split(":") for line in (root / "etc/passwd").read_text().splitlines()}
    assert "kvtier" in passwd
    uid, gid, home = int(passwd["kvtier"][2]), int(passwd["kvtier"][3]), passwd["kvtier"][5]
    assert uid < 1000, "a system user"
    assert home == "/var/lib/kvtier"
    subprocess.run([tmpfiles, "--create", f"--root={root}", str(TMPFILES)], check=True, capture_output=True,
                   timeout=60)
    for path, owner, mode in (("var/lib/kvtier", uid, 0o750), ("run/kvtier", uid, 0o750), ("etc/kvtier", 0, 0o750)):
        st = (root / path).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (owner, gid, mode), path


def test_unit_directories_match_tmpfiles_and_sysusers():
    s = unit_settings(UNIT.read_text())
    lines = [l.split() for l in TMPFILES.read_text().splitlines() if l.strip() and not l.startswith("#")]
    paths = {l[1]: l for l in lines}
    assert f"/var/lib/{s['Service.StateDirectory'][0]}" in paths
    assert f"/run/{s['Service.RuntimeDirectory'][0]}" in paths
    assert paths["/var/lib/kvtier"][3] == s["Service.User"][0]
    users = [l.split()[1] for l in SYSUSERS.read_text().splitlines() if l.startswith("u ")]
    assert users == s["Service.User"]
    assert s["Service.WorkingDirectory"] == ["/var/lib/kvtier"]


def _documented_keys(text: str) -> set[str]:
    keys = set()
    for line in text.splitlines():
        m = re.match(r"^#?\s*([a-z_]+)\s*=", line)
        if m:
            keys.add(m.group(1))
    return keys


def test_example_config_documents_and_loads_every_setting(tmp_path):
    text = EXAMPLE_TOML.read_text()
    assert _documented_keys(text) == set(daemon_config._TOML_KEYS)
    settings = daemon_config.load_toml(str(EXAMPLE_TOML))
    cfg = daemon_config.DaemonConfig(**settings)
    assert cfg.data_dir == "/var/lib/kvtier"
    assert cfg.listen_address == ("127.0.0.1", 7410) and cfg.admin_address == ("127.0.0.1", 7411)
    # the commented examples are valid too
    uncommented = re.sub(r"(?m)^# ((?:device|token_file) = .*)$", r"\1", text)
    uncommented = re.sub(r"(?m)^device = \[\]$", "", uncommented)
    path = tmp_path / "example.toml"
    path.write_text(uncommented)
    example = daemon_config.load_toml(str(path))
    assert example["devices"] == ("/dev/disk/by-id/nvme-KVTIER_DEV0", "/dev/disk/by-id/nvme-KVTIER_DEV1")
    assert example["token_file"] == "/etc/kvtier/token"
    assert tomllib.loads(uncommented)  # still one valid TOML document


def test_example_config_every_key_has_a_comment_above_it():
    lines = EXAMPLE_TOML.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+\s*=", line):
            before = [l for l in lines[max(0, i - 8):i] if l.startswith("#") and "=" not in l]
            assert before, f"setting without documentation: {line}"


def test_unit_command_line_parses_with_the_example_config():
    """ExecStart's flags are kvtierd's flags, and the example config is what it reads."""
    (command,) = unit_settings(UNIT.read_text())["Service.ExecStart"]
    argv = command.split()[1:]
    assert argv == ["--config", "/etc/kvtier/kvtierd.toml"]
    cfg = daemon_config.config_from_args(["--config", str(EXAMPLE_TOML)])
    assert cfg.data_dir == "/var/lib/kvtier" == f"/var/lib/{unit_settings(UNIT.read_text())['Service.StateDirectory'][0]}"
    assert cfg.config_file == str(EXAMPLE_TOML)
