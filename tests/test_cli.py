"""The ``kvtier`` CLI against a real kvtierd (with a token), and ``kvtier fsck`` / ``format``
on real device files with corruption planted in them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from token_daemon import TOKEN, token_daemon  # noqa: F401  (fixture)

from kvtier.client import BlockClient
from kvtier.common.blockformat import HEADER_SIZE, encode_block, payload_of
from kvtier.common.keys import KVLayout, Namespace
from kvtier.daemon.engine import Engine, EngineConfig
from kvtier.common.codec_ids import codec_id
from kvtier.tools.admin_cli import main
from kvtier.tools.admin_client import EXPECT_CONTINUE_BYTES_MIN

NS = Namespace("cli-model", KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=2))
NS_JSON = {"model": "cli-model", "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 2}}
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def kv(token_daemon, monkeypatch, capsys):
    """Run the CLI in-process against the daemon; returns (exit code, stdout, stderr)."""
    for name in ("KVTIER_ADMIN", "KVTIER_TOKEN", "KVTIER_TOKEN_FILE", "KVTIER_CONFIG"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, auth: bool = True):
        base = ["--admin", token_daemon.admin_addr] + (["--token", TOKEN] if auth else [])
        code = main(base + list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_status_human_and_json(kv, token_daemon):
    code, out, _ = kv("status")
    assert code == 0
    assert "ready" in out and "regions" in out and "hit ratio" in out
    assert f"data port   {token_daemon.data_addr}" in out
    code, out, _ = kv("--json", "status")
    doc = json.loads(out)
    assert doc["ready"] is True and doc["health"]["status"] == "ok"
    assert doc["stats"]["engine"]["regions_total"] > 0


def test_put_get_info_roundtrip(kv, tmp_path):
    key = "11" * 16
    src = tmp_path / "payload.bin"
    src.write_bytes(os.urandom(20000))
    code, out, _ = kv("put", key, str(src), "--codec", "int8", "--namespace-id", NS.id.hex(), "--durable")
    assert code == 0 and "stored 20064 bytes" in out and "durable" in out
    dst = tmp_path / "out.bin"
    code, _, err = kv("get", key, "-o", str(dst))
    assert code == 0 and dst.read_bytes() == src.read_bytes()
    code, out, _ = kv("--json", "info", key)
    doc = json.loads(out)
    assert doc["codec"] == "int8" and doc["ns_id"] == NS.id.hex() and doc["size_bytes"] == 20000 + HEADER_SIZE
    code, out, _ = kv("info", key)
    assert code == 0 and "region" in out and "pinned" in out


def test_a_put_large_enough_to_wait_for_100_continue_is_stored(kv, tmp_path):
    key = "44" * 16
    src = tmp_path / "large.bin"
    src.write_bytes(os.urandom(EXPECT_CONTINUE_BYTES_MIN + 1000))  # still below a region
    code, out, err = kv("put", key, str(src))
    assert code == 0 and f"stored {src.stat().st_size + HEADER_SIZE} bytes" in out, err
    code, _, err = kv("get", key, "-o", str(tmp_path / "back.bin"))
    assert code == 0 and (tmp_path / "back.bin").read_bytes() == src.read_bytes(), err


def test_get_to_stdout_and_whole_block(tmp_path, capsysbinary, token_daemon):
    key = bytes(range(16))
    block = encode_block(key, NS.id, codec_id("raw"), b"stdout payload")
    with BlockClient(token_daemon.data_addr, token=TOKEN) as client:
        client.put(key, block)
    assert main(["--admin", token_daemon.admin_addr, "--token", TOKEN, "get", key.hex()]) == 0
    assert capsysbinary.readouterr().out == b"stdout payload"
    out = tmp_path / "block.bin"
    assert main(["--admin", token_daemon.admin_addr, "--token", TOKEN, "get", key.hex(), "--block",
                 "-o", str(out)]) == 0
    assert bytes(payload_of(out.read_bytes())) == b"stdout payload"
    # a whole block file goes back in as is
    other = bytes(range(1, 17))
    (tmp_path / "other.bin").write_bytes(encode_block(other, NS.id, 0, b"prebuilt"))
    assert main(["--admin", token_daemon.admin_addr, "--token", TOKEN, "put", other.hex(), str(tmp_path / "other.bin"),
                 "--block"]) == 0
    with BlockClient(token_daemon.data_addr, token=TOKEN) as client:
        assert bytes(payload_of(client.get(other))) == b"prebuilt"


def test_get_of_a_missing_key_fails_clearly(kv):
    code, out, err = kv("get", "ee" * 16)
    assert code == 1 and "not stored" in err and out == ""
    code, out, err = kv("info", "ee" * 16)
    assert code == 1 and "not stored" in out


def test_lookup_pin_unpin_by_namespace_and_tokens(kv, tmp_path, token_daemon):
    tokens = list(range(40, 48))  # 4 blocks
    keys = NS.keys(tokens)
    with BlockClient(token_daemon.data_addr, token=TOKEN) as client:
        for key in keys[:3]:
            client.put(key, encode_block(key, NS.id, 0, b"x" * 100))
    ns_file = tmp_path / "ns.json"
    ns_file.write_text(json.dumps(NS_JSON))
    tok_file = tmp_path / "tokens.txt"
    tok_file.write_text(" ".join(map(str, tokens)))
    code, out, _ = kv("lookup", "--namespace", str(ns_file), "--tokens", f"@{tok_file}")
    assert code == 0 and out.strip() == "3 of 4 leading blocks stored"
    code, out, _ = kv("--json", "pin", "--namespace", str(ns_file), "--tokens", ",".join(map(str, tokens[:4])))
    assert code == 0 and json.loads(out) == {"requested": 2, "pinned": 2, "missing": []}
    code, out, _ = kv("pin", keys[3].hex())
    assert code == 1 and f"not stored: {keys[3].hex()}" in out
    code, out, _ = kv("--json", "info", keys[0].hex())
    assert json.loads(out)["pinned"] is True
    code, out, _ = kv("unpin", keys[0].hex(), keys[1].hex())
    assert code == 0 and "2 of 2 blocks unpinned" in out


def test_evict_forms(kv, token_daemon):
    keys = [bytes([i]) * 16 for i in range(3)]
    with BlockClient(token_daemon.data_addr, token=TOKEN) as client:
        for key in keys:
            client.put(key, encode_block(key, NS.id, 0, b"evict me"))
    code, out, _ = kv("evict", keys[0].hex())
    assert code == 0 and out.strip() == "evicted 1 blocks (keys)"
    code, out, _ = kv("--json", "evict", "--namespace-id", NS.id.hex())
    assert code == 0 and json.loads(out)["evicted_blocks"] >= 2
    code, out, _ = kv("evict", "--all")
    assert code == 0 and "(all)" in out
    code, _, err = kv("evict", "--all", keys[0].hex())
    assert code == 2 and "exactly one" in err


def test_stats_and_config(kv):
    code, out, _ = kv("stats")
    assert code == 0 and "tier warm" in out and "lookup" in out and "engine" in out
    code, out, _ = kv("--json", "stats")
    assert set(json.loads(out)) >= {"engine", "server", "tiers", "lookup", "namespaces"}
    code, out, _ = kv("--json", "config")
    assert json.loads(out)["token_file"] == "<set>"


def test_devices_map(kv, token_daemon):
    code, out, _ = kv("--json", "devices", "--map")
    device_map = json.loads(out)
    assert code == 0 and len(device_map) == 4
    assert all(len(dev) == 32 and Path(path).exists() for dev, path in device_map.items())
    code, out, _ = kv("--json", "devices")
    assert list(device_map) == [d["device_id"] for d in json.loads(out)["devices"]]  # stripe order, as the API
    code, out, _ = kv("devices")
    assert code == 0 and all(dev in out for dev in device_map) and "stripe" in out


def test_auth_errors_and_token_sources(kv, token_daemon, monkeypatch, tmp_path, capsys):
    code, _, err = kv("stats", auth=False)
    assert code == 1 and "HTTP 401" in err and "Authorization" in err
    assert main(["--admin", token_daemon.admin_addr, "--token", "nope", "stats"]) == 1
    assert "wrong token" in capsys.readouterr().err
    # environment
    monkeypatch.setenv("KVTIER_ADMIN", token_daemon.admin_addr)
    monkeypatch.setenv("KVTIER_TOKEN_FILE", str(token_daemon.token_file))
    assert main(["--json", "stats"]) == 0
    capsys.readouterr()
    monkeypatch.delenv("KVTIER_TOKEN_FILE")
    # the config file names the admin address and the token file
    conf = tmp_path / "kvtierd.toml"
    conf.write_text(f'admin = "{token_daemon.admin_addr}"\ntoken_file = "{token_daemon.token_file}"\n')
    monkeypatch.delenv("KVTIER_ADMIN")
    assert main(["--config", str(conf), "--json", "status"]) == 0
    assert json.loads(capsys.readouterr().out)["ready"] is True
    monkeypatch.setenv("KVTIER_CONFIG", str(conf))
    assert main(["stats"]) == 0
    capsys.readouterr()
    (tmp_path / "bad.toml").write_text("colour = 1\n")
    assert main(["--config", str(tmp_path / "bad.toml"), "stats"]) == 2
    assert "unknown key 'colour'" in capsys.readouterr().err


def test_usage_errors_and_unreachable_daemon(kv, capsys, tmp_path):
    code, _, err = kv("get", "xyz")
    assert code == 2 and "32 hex digits" in err
    code, _, err = kv("pin")
    assert code == 2 and "give keys" in err
    code, _, err = kv("put", "00" * 16, str(tmp_path / "missing.bin"))
    assert code == 2 and "missing.bin" in err
    code, _, err = kv("put", "00" * 16, __file__, "--codec", "zip")
    assert code == 2 and "unknown codec" in err
    assert main(["--admin", "127.0.0.1:1", "status"]) == 1
    assert "cannot reach the kvtierd admin API at 127.0.0.1:1" in capsys.readouterr().err
    assert main(["--admin", "nonsense", "status"]) == 2


def test_console_script_runs(token_daemon):
    script = VENV_BIN / "kvtier"
    if not script.exists():
        pytest.skip("the kvtier console script is not installed (pip install -e .)")
    result = subprocess.run([str(script), "--admin", token_daemon.admin_addr, "--token", TOKEN, "--json", "status"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ready"] is True


# -- offline: format and fsck ---------------------------------------------------------
STORE_FLAGS = ("--device-size", "8m", "--stripe-size", "64k", "--region-size", "1m")


def _store_args(tmp_path) -> list[str]:
    args = []
    for i in range(2):
        args += ["--device", str(tmp_path / f"dev{i}.img")]
    return args + list(STORE_FLAGS)


def _engine_config(tmp_path) -> EngineConfig:
    return EngineConfig(device_paths=(str(tmp_path / "dev0.img"), str(tmp_path / "dev1.img")),
                        device_size_bytes=8 << 20, stripe_size_bytes=64 << 10, region_size_bytes=1 << 20)


def _fsck(tmp_path, capsys, *extra) -> tuple[int, dict]:
    code = main(["--json", "fsck", *_store_args(tmp_path), *extra])
    return code, json.loads(capsys.readouterr().out)


def test_format_then_fsck_finds_planted_corruption_and_repairs_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVTIER_CONFIG", raising=False)
    assert main(["fsck", *_store_args(tmp_path)]) == 8  # nothing there yet: not run (as e2fsck), the engine says why
    assert "dev0.img" in capsys.readouterr().err
    assert main(["format", *_store_args(tmp_path)]) == 0
    assert "formatted 2 device(s)" in capsys.readouterr().out
    assert main(["format", *_store_args(tmp_path)]) == 1  # an existing store needs --force
    capsys.readouterr()
    assert main(["format", *_store_args(tmp_path), "--force"]) == 0
    capsys.readouterr()

    cfg = _engine_config(tmp_path)
    keys = [bytes([7, i]) * 8 for i in range(6)]
    with Engine.open(cfg) as engine:
        for i, key in enumerate(keys):
            engine.put(encode_block(key, NS.id, 0, bytes([i]) * 50_000))
        engine.flush()
        victim = engine.locate_many([keys[2]])[0]
        geometry = engine.geometry

    code, doc = _fsck(tmp_path, capsys)
    assert code == 0 and doc["clean"] is True and doc["blocks_ok"] == 6 and doc["blocks_bad"] == 0

    # flip one payload byte of keys[2] in its device file
    dev, dev_off, _ = geometry.map_range(victim.logical_offset + HEADER_SIZE + 1000, 1)[0]
    with open(cfg.device_paths[dev], "r+b") as fh:
        fh.seek(dev_off)
        byte = fh.read(1)
        fh.seek(dev_off)
        fh.write(bytes([byte[0] ^ 0xFF]))

    code, doc = _fsck(tmp_path, capsys)
    assert code == 4 and doc["clean"] is False and doc["blocks_bad"] == 1 and doc["blocks_ok"] == 5
    bad_regions = [r for r in doc["regions"] if r["entries_bad"]]
    assert len(bad_regions) == 1 and doc["repaired_regions"] == []
    assert main(["fsck", *_store_args(tmp_path)]) == 4
    human = capsys.readouterr().out
    assert "NOT CLEAN" in human and "--repair" in human

    code, doc = _fsck(tmp_path, capsys, "--repair")
    assert code == 1 and doc["repaired_regions"] == [bad_regions[0]["region"]]
    code, doc = _fsck(tmp_path, capsys)
    assert code == 0 and doc["clean"] is True and doc["blocks_ok"] == 5

    with Engine.open(cfg) as engine:
        assert engine.get(keys[2]) is None, "the corrupt block is gone, never served"
        for i in (0, 1, 3, 4, 5):
            assert bytes(payload_of(engine.get(keys[i]))) == bytes([i]) * 50_000


def test_a_bad_token_file_is_a_usage_error_naming_it(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    for path, fragment in ((empty, "empty"), (big, "longer than"), (tmp_path / "absent", "No such file")):
        assert main(["--token-file", str(path), "status"]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and fragment in err


def test_fsck_of_a_store_a_running_kvtierd_holds_is_not_run(token_daemon, capsys):
    devices = sorted(token_daemon.data_dir.glob("device*.img"))
    code = main(["fsck", *[arg for path in devices for arg in ("--device", str(path))]])
    assert code == 8 and "in use" in capsys.readouterr().err


def test_cluster_repair_refuses_an_interval_that_is_not_positive(capsys):
    for interval in ("-1", "0"):
        assert main(["cluster", "repair", "--cluster", "etcd://127.0.0.1:1/kv", "--interval", interval]) == 2
        assert "--interval must be a positive number" in capsys.readouterr().err
