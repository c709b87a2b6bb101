"""Config parsing and sd_notify, in-process (no daemon)."""
import os
import socket

import pytest

from kvtier.daemon.config import ConfigError, DaemonConfig, config_from_args, parse_size
from kvtier.daemon.notify import Notifier
from kvtier.daemon.state import DaemonState, read_token


def test_sizes_take_suffixes():
    assert parse_size("64m") == 64 << 20 and parse_size("1G") == 1 << 30 and parse_size("512k") == 512 << 10
    assert parse_size("4096") == 4096 and parse_size(8192) == 8192 and parse_size("2MiB") == 2 << 20
    for bad in ("", "m", "12q", "-1m", "0", True, 1.5):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_flags_override_the_file(tmp_path):
    cfg_file = tmp_path / "k.toml"
    cfg_file.write_text('region_size = "8m"\nstripe_size = 262144\nlisten = "127.0.0.1:9000"\nframe_timeout = 5\n'
                        'device = ["/dev/a", "/dev/b"]\n')
    cfg = config_from_args(["--config", str(cfg_file), "--listen", "127.0.0.1:0", "--admin", "none"])
    assert cfg.region_size_bytes == 8 << 20 and cfg.stripe_size_bytes == 256 << 10 and cfg.frame_timeout_s == 5.0
    assert cfg.listen_address == ("127.0.0.1", 0) and cfg.admin_address is None
    assert cfg.device_paths == ("/dev/a", "/dev/b")
    hot = config_from_args(["--reinsert-hits", "3"])
    assert hot.reinsert_hits == 3 and hot.engine_config().reinsertion_hits_min == 3
    assert config_from_args(["--data-dir", "/x"]).device_paths == tuple(f"/x/device{i}.img" for i in range(4))


def test_bad_settings_name_themselves(tmp_path):
    for text, fragment in (("eviction = 'random'", "eviction"), ("frame_timeout = 'soon'", "frame_timeout"),
                           ("device = 3", "device"), ("admin = 'nowhere'", "admin"),
                           ("reinsert_hits = 300", "reinsert_hits"), ("reinsert_hits = 'often'", "reinsert_hits")):
        cfg_file = tmp_path / "k.toml"
        cfg_file.write_text(text + "\n")
        with pytest.raises(ConfigError, match=fragment):
            config_from_args(["--config", str(cfg_file)])
    with pytest.raises(ConfigError, match="non-loopback"):
        DaemonConfig(listen="192.168.1.5:7410")
    assert DaemonConfig(listen="0.0.0.0:7410", token_file="/t").listen_address == ("0.0.0.0", 7410)
    with pytest.raises(ConfigError, match="--force"):
        config_from_args(["--force"])


@pytest.mark.parametrize("flag, value", [("--idle-timeout", "2592000"), ("--idle-timeout", "inf"),
                                         ("--frame-timeout", "inf"), ("--frame-timeout", "1e10"),
                                         ("--frame-timeout", "nan"), ("--idle-timeout", "0")])
def test_timeouts_a_socket_cannot_hold_are_refused(flag, value):
    with pytest.raises(ConfigError, match=f"{flag[2:].replace('-', '_')}: must be positive and at most"):
        config_from_args([flag, value])


def test_a_timeout_of_inf_in_the_config_file_is_refused(tmp_path):
    cfg_file = tmp_path / "k.toml"
    cfg_file.write_text("idle_timeout = inf\n")
    with pytest.raises(ConfigError, match="idle_timeout: must be positive and at most"):
        config_from_args(["--config", str(cfg_file)])


def test_redacted_config_and_token_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("  s3cret \n")
    cfg = DaemonConfig(token_file=str(token), admin="none")
    doc = cfg.redacted()
    assert doc["token_file"] == "<set>" and "s3cret" not in repr(doc) and doc["devices"][0].endswith("device0.img")
    assert read_token(str(token)) == "s3cret"
    state = DaemonState(cfg, engine=None)
    assert state.token == "s3cret" and state.check_token("s3cret") and not state.check_token("nope")
    assert not state.ready
    state.set_ready()
    assert state.ready and state.uptime_s >= 0
    token.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        read_token(str(token))
    with pytest.raises(ConfigError, match="token_file"):
        read_token(str(tmp_path / "missing"))


def test_notifier_speaks_to_abstract_and_path_sockets(tmp_path):
    name = f"kvtier-test-{os.getpid()}"
    for address, env_value in (("\0" + name, "@" + name), (str(tmp_path / "n.sock"), str(tmp_path / "n.sock"))):
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(address)
            sock.settimeout(5)
            n = Notifier({"NOTIFY_SOCKET": env_value, "WATCHDOG_USEC": "3000000"})
            assert n.enabled and n.watchdog_interval_s == 1.5
            assert n.ready("serving")
            assert sock.recv(100) == b"READY=1\nSTATUS=serving"
            assert n.watchdog() and sock.recv(100) == b"WATCHDOG=1"
            assert n.stopping() and sock.recv(100) == b"STOPPING=1"
    silent = Notifier({})
    assert not silent.enabled and silent.watchdog_interval_s is None and silent.ready() is False
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "100", "WATCHDOG_PID": "1"}).watchdog_interval_s is None


def test_clean_regions_target_from_the_file_and_the_flag(tmp_path):
    toml = tmp_path / "kvtierd.toml"
    toml.write_text("clean_regions_target = 4\n")
    data = str(tmp_path / "data")
    assert config_from_args(["--config", str(toml), "--data-dir", data]).engine_config().clean_regions_target == 4
    assert config_from_args(["--config", str(toml), "--data-dir", data,
                             "--clean-regions-target", "3"]).clean_regions_target == 3
    with pytest.raises(ConfigError, match="clean_regions_target"):
        config_from_args(["--data-dir", data, "--clean-regions-target", "0"])
