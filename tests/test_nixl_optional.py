"""NIXL is optional: a daemon and a client without it run as before, and say why where it is asked for."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvtier.daemon.config import ConfigError, config_from_args
from kvtier.daemon.nixl import start_nixl


def test_nixl_modes_and_tls_are_validated():
    assert config_from_args([]).nixl == "auto"
    cfg = config_from_args(["--nixl", "on", "--nixl-tls", "self,tcp"])
    assert cfg.nixl == "on" and cfg.nixl_tls == "self,tcp"
    with pytest.raises(SystemExit):
        config_from_args(["--nixl", "sometimes"])
    with pytest.raises(ConfigError, match="nixl_tls: names no UCX transport"):
        config_from_args(["--nixl-tls", " , "])


def test_toml_keys(tmp_path):
    path = tmp_path / "kvtierd.toml"
    path.write_text('nixl = "off"\nnixl_tls = "self,sm,tcp"\n')
    cfg = config_from_args(["--config", str(path)])
    assert cfg.nixl == "off" and cfg.nixl_tls == "self,sm,tcp"
    path.write_text('nixl = "maybe"\n')
    with pytest.raises(ConfigError, match="nixl: 'maybe' is not one of"):
        config_from_args(["--config", str(path)])


def test_off_and_auto_without_nixl_start_nothing(monkeypatch):
    assert start_nixl("off", True) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl_cu12" else object())
    assert start_nixl("auto", True) is None


CLIENT_WITHOUT_NIXL = textwrap.dedent("""
    import json, sys
    sys.modules["nixl_cu12"] = None  # as if not installed: importing it raises ImportError
    import torch
    from kvtier.client.kvcache import KVCache
    from kvtier.common.keys import KVLayout, Namespace
    ns = Namespace(model="optional", layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16",
                                                     block_tokens=16), codec="raw")
    out = {}
    try:
        KVCache(ns, sys.argv[1], transport="nixl")
    except ValueError as exc:
        out["nixl"] = str(exc)
    with KVCache(ns, sys.argv[1], transport="auto", hot_pool_bytes=0) as cache:
        kv = [(torch.ones(1, 1, 16, 16).half(), torch.ones(1, 1, 16, 16).half())]
        cache.store(list(range(16)), kv)
        out["auto"] = dict(cache.load(list(range(16))).transports)
    print(json.dumps(out))
""")


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="the daemon side needs NIXL installed")
def test_a_client_without_nixl_uses_tcp_under_auto_and_says_why_under_nixl(tmp_path):
    from daemon_proc import start_kvtierd
    d = start_kvtierd(tmp_path / "kvtierd", "--nixl", "auto",
                      env={**os.environ, "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib*"})
    try:
        out = subprocess.run([sys.executable, "-c", CLIENT_WITHOUT_NIXL, d.data_addr], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout.strip().splitlines()[-1])
        assert "NIXL is not importable" in doc["nixl"] and "kvtier[nixl]" in doc["nixl"]
        assert doc["auto"] == {"tcp": 1}
    finally:
        assert d.stop() == 0, d.log_tail()
