"""kvperf against real kvtierd processes: every workload, JSON keys, gates,
exit codes, verify catching corruption, several targets, direct reads, plots."""
import json
import sys
from pathlib import Path

import pytest

from daemon_proc import start_kvtierd
from kvtier.client import BlockClient
from kvtier.client.routing import Rendezvous
from kvtier.tools.kvperf.cli import EXIT_GATE_FAILED, EXIT_OK, run
from kvtier.tools.kvperf.content import block_key, payload_for

SMALL = ["--bs=64k", "--size=8m", "--iodepth=4"]


def kvperf_json(capsys, *argv):
    code = run(["--output-format=json", *argv])
    out = capsys.readouterr()
    assert out.out, f"kvperf exited {code} with no report; stderr:\n{out.err}"
    return code, json.loads(out.out), out.err


@pytest.mark.parametrize("ioengine", ["sync", "asyncio"])
def test_write_then_read_verify_json_keys(kvtierd, capsys, ioengine):
    t = f"--target=tcp://{kvtierd.data_addr}"
    code, doc, err = kvperf_json(capsys, t, *SMALL, f"--ioengine={ioengine}", "--verify=1", "--name=w", "--rw=write",
                                 "--name=r", "--rw=read")
    assert code == EXIT_OK, err
    assert err == ""  # no progress line in JSON mode
    assert {"kvperf version", "timestamp", "timestamp_ms", "time", "global options", "jobs"} <= set(doc)
    assert doc["global options"]["bs"] == "64k"
    w, r = doc["jobs"]
    for job in (w, r):
        assert {"jobname", "groupid", "error", "job options", "job_runtime", "read", "write"} <= set(job)
        assert job["error"] == 0 and job["verify_errors"] == 0
        for d in (job["read"], job["write"]):
            assert {"io_bytes", "bw_bytes", "bw", "iops", "runtime", "total_ios", "clat_ns"} <= set(d)
            assert {"min", "max", "mean", "stddev", "N", "percentile"} <= set(d["clat_ns"])
    assert w["write"]["io_bytes"] == 8 << 20 and w["write"]["total_ios"] == 128 and w["read"]["total_ios"] == 0
    assert w["verified_blocks"] == 128  # write + verify reads everything back
    assert r["read"]["io_bytes"] == 8 << 20 and r["laid_out_blocks"] == 0  # read what the write job wrote
    clat = r["read"]["clat_ns"]
    assert clat["N"] == 128 and "99.000000" in clat["percentile"] and "99.990000" in clat["percentile"]
    assert clat["min"] <= clat["percentile"]["50.000000"] <= clat["max"]
    assert r["read"]["bw"] == r["read"]["bw_bytes"] // 1024


def test_gates_pass_fail_and_table(kvtierd, capsys, tmp_path):
    job = tmp_path / "gated.fio"
    job.write_text(f"[global]\ntarget=tcp://{kvtierd.data_addr}\nbs=64k\nsize=4m\n"
                   "[seqwrite]\nrw=write\ngate=write.bw_bytes>=1\n")
    assert run([str(job), "--gate", "write.clat_ns.percentile.99<=1e12"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "seqwrite: (groupid=0, jobs=1): err= 0" in out and "write: IOPS=" in out
    assert "gates: 2 passed, 0 failed" in out
    assert run([str(job), "--gate", "write_bw>=1000GiB/s"]) == EXIT_GATE_FAILED
    out = capsys.readouterr().out
    assert "write_bw>=1000GiB/s" in out and "FAIL" in out and "gates: 1 passed, 1 failed" in out
    code, doc, err = kvperf_json(capsys, str(job), "--gate=read_bw>=1")
    assert code == EXIT_GATE_FAILED  # the only job does no reads: nobody reports read_bw
    assert [g["pass"] for g in doc["gates"]] == [False, True] and "no job reports read.bw_bytes" in err


def test_mixed_time_based_two_clones(kvtierd, capsys):
    code, doc, err = kvperf_json(capsys, f"--target=tcp://{kvtierd.data_addr}", "--name=mix", "--rw=randrw",
                                 "--bs=64k", "--size=4m", "--iodepth=2", "--numjobs=2", "--runtime=1",
                                 "--time_based", "--rwmixread=70", "--verify=1")
    assert code == EXIT_OK, err
    (job,) = doc["jobs"]
    assert job["clones"] == 2 and job["verify_errors"] == 0
    assert job["read"]["total_ios"] > 0 and job["write"]["total_ios"] > 0
    assert job["read"]["total_ios"] > job["write"]["total_ios"]  # rwmixread=70
    assert 900 <= job["job_runtime"] <= 5000


def test_lookup_chains(kvtierd, capsys):
    code, doc, err = kvperf_json(capsys, f"--target=tcp://{kvtierd.data_addr}", "--name=lk", "--rw=lookup",
                                 "--bs=4k", "--size=2m", "--lookup_keys=128", "--runtime=1")
    assert code == EXIT_OK, err
    lk = doc["jobs"][0]["lookup"]
    assert lk["keys"] > 0 and lk["found"] == lk["keys"] and lk["misses"] == 0
    assert lk["total_ios"] * 128 == lk["keys"] and lk["keys_per_s"] > 0


def test_prefix_synthetic(kvtierd, capsys):
    code, doc, err = kvperf_json(capsys, f"--target=tcp://{kvtierd.data_addr}", "--name=p", "--rw=prefix",
                                 "--bs=8k", "--prompt_tokens=256", "--block_tokens=16", "--prefix_requests=24",
                                 "--prefix_systems=2", "--prefix_docs=3", "--iodepth=2", "--verify=1",
                                 "--gate=hit_ratio>=0.2")
    assert code == EXIT_OK, err
    p = doc["jobs"][0]["prefix"]
    assert p["requests"] == 24 and p["blocks"] == 24 * 16
    assert 0.2 <= p["hit_ratio"] < 0.75  # at most the shared 3/4 of each prompt can hit
    assert p["bytes_saved"] == p["hit_blocks"] * 8192 and p["tokens_saved"] == p["hit_blocks"] * 16
    assert doc["jobs"][0]["read"]["io_bytes"] == p["bytes_saved"]


def test_prefix_trace_replay_exact_hits(kvtierd, capsys, tmp_path):
    a, b = list(range(1, 65)), list(range(1000, 1064))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join([json.dumps(a), json.dumps({"tokens": a + [7] * 10}), json.dumps(b)]) + "\n")
    code, doc, err = kvperf_json(capsys, f"--target=tcp://{kvtierd.data_addr}", "--name=replay", "--rw=prefix",
                                 f"--trace={trace}", "--bs=4k", "--block_tokens=16", "--iodepth=1",
                                 "--keyspace=replay-test")
    assert code == EXIT_OK, err
    p = doc["jobs"][0]["prefix"]
    assert (p["requests"], p["blocks"], p["hit_blocks"]) == (3, 12, 4)  # the second prompt reuses all 4 of a's
    assert p["tokens_recomputed"] == 8 * 16


def _flip_payload_byte(data_dir: Path, key: bytes, size_bytes: int) -> bool:
    """Flip one payload byte of the stored block ``key`` in the device files,
    where the first bytes of its payload lie next to its header on one device."""
    expected = payload_for(key, size_bytes)
    for dev in sorted(data_dir.glob("device*.img")):
        raw = bytearray(dev.read_bytes())
        pos = raw.find(key)
        while pos >= 0:
            start = pos - 12  # the key sits at offset 12 of the 64-byte header
            body = start + 64
            if raw[start:start + 4] == b"KVTB" and raw[body:body + 256] == expected[:256]:
                raw[body + 100] ^= 0xFF
                dev.write_bytes(bytes(raw))
                return True
            pos = raw.find(key, pos + 1)
    return False


def test_verify_catches_corrupted_and_missing_blocks(tmp_path, capsys):
    daemon = start_kvtierd(tmp_path / "d")
    try:
        args = ["--bs=64k", "--size=4m", "--keyspace=corrupt", "--seed=7"]
        code, doc, err = kvperf_json(capsys, f"--target=tcp://{daemon.data_addr}", *args, "--name=w", "--rw=write", "--verify=1", "--durable=1")
        assert code == EXIT_OK and doc["jobs"][0]["verify_errors"] == 0, err
        daemon.stop()
        keys = [block_key(7, "corrupt", 0, i) for i in range(64)]
        corrupted = next(i for i, k in enumerate(keys) if _flip_payload_byte(tmp_path / "d", k, 65536))
        daemon.start()
        deleted = (corrupted + 1) % 64
        with BlockClient(daemon.data_addr) as c:
            assert c.delete(keys[deleted])
        code, doc, err = kvperf_json(capsys, f"--target=tcp://{daemon.data_addr}", *args, "--name=check", "--rw=read", "--verify=1", "--verify_only=1")
        assert code == EXIT_GATE_FAILED
        job = doc["jobs"][0]
        assert job["error"] == 84 and job["verify_errors"] == 2  # EILSEQ, as fio reports a verify failure
        assert job["read"]["total_ios"] == 64 and job["read"]["io_bytes"] == 62 * 65536
        text = "\n".join(job["verify_messages"])
        assert keys[corrupted].hex() in text and keys[deleted].hex() in text and "missing" in text
        assert "verify error(s)" in err
    finally:
        daemon.stop()


def test_two_targets_spread_blocks(tmp_path, capsys):
    a, b = start_kvtierd(tmp_path / "a"), start_kvtierd(tmp_path / "b")
    try:
        args = ["--bs=64k", "--size=4m", "--keyspace=spread", "--seed=5"]
        both = f"--target=tcp://{a.data_addr},tcp://{b.data_addr}"
        code, _, err = kvperf_json(capsys, both, *args, "--name=w", "--rw=write", "--verify=1")
        assert code == EXIT_OK, err
        # each block lives on its owner by the rule KVCache uses (kvtier.client.routing)
        owners = Rendezvous([a.data_addr, b.data_addr]).owners([block_key(5, "spread", 0, i) for i in range(64)])
        on_b = int(owners.sum())
        assert 0 < on_b < 64
        for alone, missing in ((a, on_b), (b, 64 - on_b)):
            code, doc, _ = kvperf_json(capsys, f"--target=tcp://{alone.data_addr}", *args, "--name=r", "--rw=read",
                                       "--verify=1", "--verify_only=1")
            assert code == EXIT_GATE_FAILED and doc["jobs"][0]["verify_errors"] == missing
        code, doc, _ = kvperf_json(capsys, both, *args, "--name=r", "--rw=read", "--verify=1", "--verify_only=1")
        assert code == EXIT_OK and doc["jobs"][0]["verify_errors"] == 0
        code, doc, err = kvperf_json(capsys, both, *args, "--name=lk", "--rw=lookup", "--lookup_keys=8",
                                     "--runtime=1")
        assert code == EXIT_OK, err
        lk = doc["jobs"][0]["lookup"]
        assert lk["keys"] > 0 and lk["found"] == lk["keys"] and lk["misses"] == 0
    finally:
        a.stop()
        b.stop()


def test_direct_reads_from_device_files(kvtierd, capsys):
    devices = ",".join(str(p) for p in sorted(kvtierd.data_dir.glob("device*.img")))
    tcp = f"tcp://{kvtierd.data_addr}"
    code, _, err = kvperf_json(capsys, f"--target={tcp}", *SMALL, "--name=w", "--rw=write", "--verify=1")
    assert code == EXIT_OK, err
    code, doc, err = kvperf_json(capsys, f"--target=direct:{devices}@{tcp}", *SMALL, "--name=r", "--rw=read",
                                 "--verify=1", "--verify_only=1")
    assert code == EXIT_OK, err
    job = doc["jobs"][0]
    assert job["verify_errors"] == 0 and job["read"]["total_ios"] == 128
    assert job["direct"]["blocks"] > 0  # sealed regions came straight from the files
    assert job["direct"]["blocks"] + job["direct"]["fallbacks"] == 128


def test_plot_and_output_file(kvtierd, capsys, tmp_path):
    png, report = tmp_path / "run.png", tmp_path / "report.json"
    code = run([f"--target=tcp://{kvtierd.data_addr}", "--bs=64k", "--size=2m", "--name=w", "--rw=write",
                "--name=r", "--rw=randread", f"--plot={png}", "--output-format=json", f"--output={report}"])
    assert code == EXIT_OK
    assert capsys.readouterr().out == ""
    assert [j["jobname"] for j in json.loads(report.read_text())["jobs"]] == ["w", "r"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_console_script_runs(kvtierd, tmp_path):
    import subprocess
    job = tmp_path / "j.fio"
    job.write_text(f"[w]\ntarget=tcp://{kvtierd.data_addr}\nrw=write\nbs=64k\nsize=1m\n")
    proc = subprocess.run([sys.executable, "-m", "kvtier.tools.kvperf", str(job), "--gate=write_bw>=1e15"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_GATE_FAILED, proc.stderr
    assert "FAIL" in proc.stdout and proc.stderr == ""


def test_ttft_four_modes_on_a_tiny_llama(kvtierd, capsys, tmp_path):
    pytest.importorskip("transformers")
    png = tmp_path / "ttft.png"
    code, doc, err = kvperf_json(capsys, f"--target=tcp://{kvtierd.data_addr}", "--name=ttft", "--rw=ttft",
                                 "--model=random-llama-tiny", "--prompt_tokens=72", "--cached_tokens=60",
                                 "--block_tokens=16", "--concurrency=1,2", "--ttft_prompts=2", "--verify=1",
                                 f"--plot={png}", "--gate=ttft.kvtier_ms.N>=4")
    assert code == EXIT_OK, err
    (job,) = doc["jobs"]
    t = job["ttft"]
    assert job["verify_errors"] == 0 and t["logits_max_abs_diff"] == 0.0  # raw codec: bit-exact
    assert t["cached_tokens"] == 48 and t["prompt_tokens"] == 72  # 60 rounds down to 3 blocks of 16
    for mode in ("recompute_ms", "inmemory_ms", "load_ms", "kvtier_ms"):
        assert t[mode]["N"] == 4 and "99.000000" in t[mode]["percentile"] and t[mode]["mean"] > 0
    rec, mem, load, kv = (t[m]["mean"] for m in ("recompute_ms", "inmemory_ms", "load_ms", "kvtier_ms"))
    assert t["reduction"] == pytest.approx(1 - kv / rec)
    assert t["overhead_vs_inmemory"] == pytest.approx(kv / mem - 1)
    assert t["exposed_load_ms"] == pytest.approx(kv - mem)  # may be negative on a noisy machine
    assert t["load_vs_inmemory"] == pytest.approx(load / mem)
    assert t["exposed_vs_load"] == pytest.approx((kv - mem) / load)
    assert t["kvtier_vs_bound"] == pytest.approx(kv / max(mem, load))
    assert [lv["concurrency"] for lv in t["by_concurrency"]] == [1, 2]
    for lv in t["by_concurrency"]:
        assert all(lv[m]["prompts_per_s"] > 0 for m in ("recompute", "inmemory", "load", "kvtier"))
        lv_mem, lv_load, lv_kv = (lv[m]["ttft_ms_mean"] for m in ("inmemory", "load", "kvtier"))
        assert lv["exposed_load_ms"] == pytest.approx(lv_kv - lv_mem)
        assert lv["exposed_vs_load"] == pytest.approx((lv_kv - lv_mem) / lv_load)
        assert lv["kvtier_vs_bound"] == pytest.approx(lv_kv / max(lv_mem, lv_load))
    # every load and kvtier prompt (4 each, and one warm-up of each) got its 3 blocks from the daemon
    assert t["warm_tier"]["hits"] >= 3 * (4 + 1) * 2
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_ttft_at_concurrency_one_runs_each_prompts_modes_back_to_back(kvtierd, capsys, monkeypatch):
    """So that a slower spell of the machine falls on every mode alike, not on the kvtier pass alone."""
    pytest.importorskip("transformers")
    from kvtier.tools.kvperf import ttftjob

    calls, real = [], ttftjob.TtftBench._one

    def recorded(self, mode, i):
        calls.append((mode, i))
        return real(self, mode, i)
    monkeypatch.setattr(ttftjob.TtftBench, "_one", recorded)
    code, doc, err = kvperf_json(capsys, f"--target=tcp://{kvtierd.data_addr}", "--name=ttft", "--rw=ttft",
                                 "--model=random-llama-tiny", "--prompt_tokens=72", "--cached_tokens=60",
                                 "--block_tokens=16", "--concurrency=1", "--ttft_prompts=3")
    assert code == EXIT_OK, err
    modes = list(ttftjob.MODES)
    timed = calls[len(modes) * ttftjob.WARMUP_PROMPTS:]  # after the untimed warm-up of each mode
    assert timed == [(mode, i) for i in range(3) for mode in modes]


def test_ttft_threads_sets_the_models_threads_for_that_job_only(kvtierd, capsys):
    pytest.importorskip("transformers")
    import torch

    before = torch.get_num_threads()
    code, doc, err = kvperf_json(capsys, f"--target=tcp://{kvtierd.data_addr}", "--rw=ttft", "--model=random-llama-tiny",
                                 "--prompt_tokens=40", "--cached_tokens=32", "--block_tokens=16", "--concurrency=1",
                                 "--ttft_prompts=1", "--name=one", "--ttft_threads=1", "--name=default")
    assert code == EXIT_OK, err
    one, default = doc["jobs"]
    assert one["ttft"]["torch_threads"] == 1 and default["ttft"]["torch_threads"] == before
    assert torch.get_num_threads() == before


def test_ttft_gates_on_the_load_figures_and_text_report(kvtierd, capsys):
    pytest.importorskip("transformers")
    code = run([f"--target=tcp://{kvtierd.data_addr}", "--name=t", "--rw=ttft", "--model=random-llama-tiny",
                "--prompt_tokens=40", "--cached_tokens=32", "--concurrency=1", "--ttft_prompts=1",
                "--gate=ttft.load_ms.N>=1", "--gate=ttft_exposed_vs_load<1e9", "--gate=ttft_kvtier_vs_bound>0"])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "load: mean=" in out and "load alone vs in-memory:" in out and "gates: 3 passed, 0 failed" in out


def test_ttft_directory_that_is_no_checkpoint_is_a_usage_error(tmp_path):
    pytest.importorskip("transformers")
    from kvtier.tools.kvperf.options import JobOptions
    from kvtier.tools.kvperf.ttftjob import build_model
    from kvtier.tools.kvperf.units import UsageError

    with pytest.raises(UsageError, match=f"model={tmp_path}: cannot load a local checkpoint directory"):
        build_model(JobOptions(name="t", rw="ttft", model=str(tmp_path)))


def test_smoke_job_file(kvtierd, capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_TARGET", f"tcp://{kvtierd.data_addr}")
    job = Path(__file__).resolve().parent.parent / "perf" / "jobs" / "smoke.fio"
    code, doc, err = kvperf_json(capsys, str(job), "--size=2m", "--runtime=0.5")
    assert code == EXIT_OK, err
    assert [j["jobname"] for j in doc["jobs"]] == ["write", "randread", "mixed", "lookup"]
    assert sum(j["verify_errors"] for j in doc["jobs"]) == 0
    assert doc["jobs"][1]["read"]["io_bytes"] == 2 << 20


def _run_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """Run kvperf with stderr on a pseudo-terminal; returns (exit code, what the terminal got)."""
    import os
    import pty
    import subprocess
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.tools.kvperf", *argv], stdout=subprocess.PIPE,
                            stderr=slave, env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    proc.stdout.read()
    code = proc.wait(120)
    os.close(master)
    return code, seen.decode(errors="replace")


PROGRESS_ARGS = ["--name=progress", "--rw=randrw", "--bs=64k", "--size=2m", "--runtime=1.5", "--time_based"]


def test_progress_line_on_a_terminal(kvtierd):
    code, tty = _run_on_a_terminal([f"--target=tcp://{kvtierd.data_addr}", *PROGRESS_ARGS])
    assert code == EXIT_OK
    assert "progress" in tty and "%" in tty


class _FakeTerminal(__import__("io").StringIO):
    def isatty(self) -> bool:
        return True


def test_no_progress_line_in_json_mode_even_on_a_terminal(kvtierd, capsys, monkeypatch):
    term = _FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    code = run(["--output-format=json", f"--target=tcp://{kvtierd.data_addr}", *PROGRESS_ARGS])
    assert code == EXIT_OK
    assert json.loads(capsys.readouterr().out)["jobs"][0]["jobname"] == "progress"
    assert term.getvalue() == ""
    assert run([f"--target=tcp://{kvtierd.data_addr}", *PROGRESS_ARGS]) == EXIT_OK  # the control:
    assert "progress" in term.getvalue()  # the same run in normal mode does draw on that terminal


def test_token_file_and_wrong_token(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("s3cret-kvperf-token\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    daemon = start_kvtierd(tmp_path / "d", "--token-file", str(token))
    try:
        base = [f"--target=tcp://{daemon.data_addr}", "--name=w", "--rw=write", "--bs=64k", "--size=1m"]
        assert run([*base, f"--token_file={token}"]) == EXIT_OK
        capsys.readouterr()
        for extra in ([f"--token_file={wrong}"], []):
            assert run([*base, *extra]) == 2
            err = capsys.readouterr().err
            assert f"cannot use target tcp://{daemon.data_addr}" in err
            assert "s3cret" not in err
    finally:
        daemon.stop()


def test_daemon_killed_mid_run_exits_2(tmp_path, capsys):
    import threading
    daemon = start_kvtierd(tmp_path / "d")
    killer = threading.Timer(1.0, daemon.kill)
    killer.start()
    try:
        code = run([f"--target=tcp://{daemon.data_addr}", "--name=long", "--rw=randrw", "--bs=64k", "--size=2m",
                    "--runtime=30", "--time_based"])
    finally:
        killer.cancel()
        daemon.kill()
    assert code == 2
    assert "the daemon failed the run" in capsys.readouterr().err


def test_batches_ramp_and_durable(kvtierd, capsys):
    t = f"--target=tcp://{kvtierd.data_addr}"
    code, doc, err = kvperf_json(capsys, t, "--bs=64k", "--size=4m", "--batch=4", "--verify=1", "--keyspace=batch",
                                 "--name=w", "--rw=write", "--durable=1", "--name=r", "--rw=randread",
                                 "--name=ramp", "--rw=randread", "--runtime=1", "--ramp_time=0.5", "--time_based")
    assert code == EXIT_OK, err
    w, r, ramp = doc["jobs"]
    assert w["write"]["total_ios"] == 16 and w["write"]["io_bytes"] == 4 << 20  # 64 blocks in batches of 4
    assert r["read"]["total_ios"] == 16 and r["read"]["io_bytes"] == 4 << 20 and r["verify_errors"] == 0
    assert 900 <= ramp["job_runtime"] <= 3000  # measured after the ramp: about runtime, not runtime + ramp
    assert ramp["read"]["total_ios"] > 0


def test_text_report_to_an_output_file(kvtierd, capsys, tmp_path):
    report = tmp_path / "report.txt"
    code = run([f"--target=tcp://{kvtierd.data_addr}", "--bs=64k", "--size=1m", "--name=w", "--rw=write",
                f"--output={report}", "--gate=write_bw>=1"])
    assert code == EXIT_OK and capsys.readouterr().out == ""
    text = report.read_text()
    assert text.startswith("w: (g=0): rw=write") and "w: (groupid=0, jobs=1): err= 0" in text
    assert "gates: 1 passed, 0 failed" in text


def test_ttft_on_a_missing_gpu_is_a_usage_error(kvtierd, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the error path cannot be shown here")
    code = run([f"--target=tcp://{kvtierd.data_addr}", "--name=t", "--rw=ttft", "--model=random-llama-tiny",
                "--prompt_tokens=40", "--cached_tokens=32", "--ttft_device=cuda"])
    assert code == 2
    assert "ttft_device=cuda: torch sees no CUDA device here" in capsys.readouterr().err


def test_name_in_a_job_section_names_the_job(kvtierd, capsys, tmp_path):
    job = tmp_path / "named.fio"
    job.write_text(f"[global]\ntarget=tcp://{kvtierd.data_addr}\nbs=64k\nsize=1m\n"
                   "[seqwrite]\nname=put\nrw=write\ngate=write.bw_bytes>=1\n[get]\nrw=read\n")
    code, doc, err = kvperf_json(capsys, str(job), "--gate=put:write_bw>=1")
    assert code == EXIT_OK, err
    assert [j["jobname"] for j in doc["jobs"]] == ["put", "get"]
    assert [(g["job"], g["pass"]) for g in doc["gates"]] == [("put", True), ("put", True)]
    code, doc, err = kvperf_json(capsys, str(job), "--section=seqwrite")  # fio's --section takes the header
    assert code == EXIT_OK, err
    assert [j["jobname"] for j in doc["jobs"]] == ["put"]


@pytest.mark.parametrize("rw", ["write", "read", "randread"])
def test_a_partial_last_batch_is_run(kvtierd, capsys, rw):
    blocks, batch = 10, 4  # two full batches and a tail of two blocks
    code, doc, err = kvperf_json(capsys, f"--target=tcp://{kvtierd.data_addr}", "--bs=64k", f"--size={blocks * 64}k",
                                 f"--batch={batch}", "--verify=1", f"--name={rw}", f"--rw={rw}")
    assert code == EXIT_OK, err
    (job,) = doc["jobs"]
    direction = job["write" if rw == "write" else "read"]
    assert direction["total_ios"] == -(-blocks // batch)
    assert direction["io_bytes"] == blocks * (64 << 10)
    assert job["verified_blocks"] == (blocks if rw == "write" else 0)
