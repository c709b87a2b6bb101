"""kvperf's ttft workload over each transport (``ttft_transport``): a real kvtierd, a tiny
random Llama, and the blocks of the timed loads counted by the transport that carried them."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from daemon_proc import start_kvtierd
from kvtier.common.ucx_env import rdma_devices
from kvtier.tools.kvperf.cli import EXIT_OK, EXIT_USAGE, run

pytest.importorskip("transformers")

LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", **({} if rdma_devices() else {"UCX_MODULES": "^ib*"})}
# 2 prompts at concurrency 1, in the load and kvtier modes: 4 timed loads of the 3 stored blocks
TINY = ["--rw=ttft", "--model=random-llama-tiny", "--prompt_tokens=72", "--cached_tokens=60", "--block_tokens=16",
        "--concurrency=1", "--ttft_prompts=2", "--verify=1"]
TIMED_BLOCKS = 4 * 3


def ttft_report(capsys, *argv) -> dict:
    code = run(["--output-format=json", *argv])
    out = capsys.readouterr()
    assert code == EXIT_OK, out.err
    (job,) = json.loads(out.out)["jobs"]
    assert job["verify_errors"] == 0, job
    return job["ttft"]


@pytest.mark.parametrize("transport", ["tcp", None])
def test_tcp_carries_every_timed_block(kvtierd, capsys, transport):
    option = [] if transport is None else [f"--ttft_transport={transport}"]  # tcp is a tcp target's default
    t = ttft_report(capsys, f"--target=tcp://{kvtierd.data_addr}", "--name=t", *TINY, *option)
    assert t["transport"] == "tcp" and t["nixl_ready"] is None
    assert t["transports"] == {"tcp": TIMED_BLOCKS}
    assert t["warm_tier"]["transports"]["tcp"] == TIMED_BLOCKS + 2 * 3  # and the 2 warm-up loads
    assert t["logits_max_abs_diff"] == 0.0


def test_direct_reads_the_sealed_blocks_from_the_device_files(kvtierd, capsys):
    devices = ",".join(str(p) for p in sorted(kvtierd.data_dir.glob("device*.img")))
    t = ttft_report(capsys, f"--target=direct:{devices}@tcp://{kvtierd.data_addr}", "--name=t", *TINY,
                    "--ttft_transport=direct")
    assert t["transport"] == "direct" and t["transports"] == {"direct": TIMED_BLOCKS}
    assert t["warm_tier"]["fallbacks"] == 0


def test_tcp_on_a_direct_target_reads_over_tcp(kvtierd, capsys):
    devices = ",".join(str(p) for p in sorted(kvtierd.data_dir.glob("device*.img")))
    t = ttft_report(capsys, f"--target=direct:{devices}@tcp://{kvtierd.data_addr}", "--name=t", *TINY,
                    "--ttft_transport=tcp")
    assert t["transport"] == "tcp" and t["transports"] == {"tcp": TIMED_BLOCKS}


def test_an_unknown_transport_is_a_usage_error(kvtierd, capsys):
    code = run([f"--target=tcp://{kvtierd.data_addr}", "--name=t", *TINY, "--ttft_transport=rdma"])
    assert code == EXIT_USAGE
    assert "ttft_transport='rdma': unknown transport; choose one of tcp, direct, nixl, auto" in capsys.readouterr().err


def test_direct_without_a_device_map_is_a_usage_error(kvtierd, capsys):
    code = run([f"--target=tcp://{kvtierd.data_addr}", "--name=t", *TINY, "--ttft_transport=direct"])
    assert code == EXIT_USAGE
    assert "ttft_transport=direct needs the daemon's device map" in capsys.readouterr().err


needs_nixl = pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                                reason="NIXL is not installed (pip install 'kvtier[nixl]')")


@pytest.fixture
def nixl_kvtierd(tmp_path, monkeypatch):
    for name, value in LOOPBACK_ENV.items():  # this process's client agent: loopback only
        monkeypatch.setenv(name, value)
    daemon = start_kvtierd(tmp_path / "kvtierd-nixl", "--nixl", "on", env={**os.environ, **LOOPBACK_ENV})
    yield daemon
    assert daemon.stop() == 0, daemon.log_tail()


@needs_nixl
def test_nixl_carries_every_timed_block_once_set_up(nixl_kvtierd, capsys):
    t = ttft_report(capsys, f"--target=tcp://{nixl_kvtierd.data_addr}", "--name=t", *TINY, "--ttft_transport=nixl")
    assert t["transport"] == "nixl" and t["nixl_ready"] is True
    assert t["transports"] == {"nixl": TIMED_BLOCKS}
    assert t["warm_tier"]["fallbacks"] == 0 and t["logits_max_abs_diff"] == 0.0


@needs_nixl
def test_nixl_against_a_daemon_without_it_is_a_usage_error(kvtierd, capsys):
    code = run([f"--target=tcp://{kvtierd.data_addr}", "--name=t", *TINY, "--ttft_transport=nixl"])
    assert code == EXIT_USAGE
    assert "ttft_transport=nixl: transport='nixl'" in capsys.readouterr().err


@needs_nixl
def test_auto_against_a_daemon_without_nixl_reports_tcp(kvtierd, capsys):
    t = ttft_report(capsys, f"--target=tcp://{kvtierd.data_addr}", "--name=t", *TINY, "--ttft_transport=auto")
    assert t["transport"] == "auto" and t["nixl_ready"] is False
    assert t["transports"] == {"tcp": TIMED_BLOCKS}
