"""kvperf without a daemon: job files, option values, gates, usage errors."""
import json
import socket

import pytest

from kvtier.tools.kvperf.cli import EXIT_USAGE, parse_argv, run
from kvtier.tools.kvperf.gates import evaluate, parse_gate, resolve
from kvtier.tools.kvperf.jobfile import parse_job_text, parse_sources
from kvtier.tools.kvperf.options import build_jobs
from kvtier.tools.kvperf.stats import OpLog, clat_stats, direction_stats
from kvtier.tools.kvperf.targets import parse_targets
from kvtier.tools.kvperf.units import UsageError, parse_size, parse_time_s

T = "target=tcp://127.0.0.1:7410"

# fio's HOWTO example of a job file with two jobs sharing a global section,
# adapted: ioengine/filename/direct become target/keyspace/durable.
FIO_STYLE = """
; -- start job file --
[global]
rw=randread
size=128m
target=tcp://127.0.0.1:7410

[job1]
# the first job
keyspace=job1

[job2]
keyspace=job2
iodepth=16
; -- end job file --
"""


def test_fio_example_two_jobs_share_global():
    jobs = build_jobs(list(parse_job_text(FIO_STYLE, "howto.fio")))
    assert [j.name for j in jobs] == ["job1", "job2"]
    assert all(j.rw == "randread" and j.size == 128 << 20 for j in jobs)
    assert (jobs[0].keyspace, jobs[0].iodepth) == ("job1", 1)
    assert (jobs[1].keyspace, jobs[1].iodepth) == ("job2", 16)


def test_fio_example_four_clones_time_based():
    # fio's "four processes each randomly writing" example, adapted
    text = f"""[random-writers]
{T}
rw=randwrite
bs=32k
size=64m
numjobs=4
runtime=2m
time_based
ramp_time=500ms
"""
    (job,) = build_jobs(list(parse_job_text(text)))
    assert (job.rw, job.bs, job.numjobs, job.size) == ("randwrite", 32768, 4, 64 << 20)
    assert job.runtime == 120.0 and job.time_based and job.ramp_time == 0.5


def test_later_global_applies_only_to_later_jobs_and_last_value_wins():
    text = f"[global]\n{T}\nbs=4k\n[a]\nbs=8k\nbs=16k\n[global]\niodepth=4\n[b]\n"
    a, b = build_jobs(list(parse_job_text(text)))
    assert (a.bs, a.iodepth) == (16384, 1)
    assert (b.bs, b.iodepth) == (4096, 4)


def test_inline_comments_blank_lines_and_env_expansion(monkeypatch):
    monkeypatch.setenv("KVP_SIZE", "8m")
    (job,) = build_jobs(list(parse_job_text(f"[a]   \n\n{T}  ; where\nsize=${{KVP_SIZE}} # env\n")))
    assert job.size == 8 << 20


def test_unset_env_variable_is_named():
    with pytest.raises(UsageError, match=r"\$\{KVP_NOPE\} is not set"):
        parse_job_text("[a]\nsize=${KVP_NOPE}\n", "x.fio")


@pytest.mark.parametrize("text,message", [
    ("bs=4k\n[a]\n", "x.fio:1: option 'bs=4k' comes before any"),
    ("[a\n", "x.fio:1: bad section header"),
    ("[]\n", "x.fio:1: bad section header"),
    ("[a]\n=4\n", "x.fio:2: '=4' is not an option"),
])
def test_malformed_job_files_name_the_line(text, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse_job_text(text, "x.fio")


def test_command_line_jobs_and_globals():
    args = parse_argv(["--rw=write", "--target=tcp://h:1", "--name=a", "--bs=1m", "--name=b", "--time_based",
                       "--runtime=1"])
    js = parse_sources([], args.job_options)
    a, b = build_jobs(list(js.jobs))
    assert (a.name, a.rw, a.bs) == ("a", "write", 1 << 20)
    assert (b.name, b.rw, b.time_based) == ("b", "write", True)


def test_name_in_a_job_section_sets_the_jobs_name():
    a, b = build_jobs(list(parse_job_text(f"[global]\n{T}\n[a]\nname=renamed\n[b]\n")))
    assert (a.name, b.name) == ("renamed", "b")


@pytest.mark.parametrize("text,message", [
    (f"[global]\n{T}\nname=x\n[a]\n", "x.fio:3: name= names one job"),
    (f"[a]\n{T}\nname=\n", "name= needs a value"),
])
def test_name_in_global_or_empty_is_refused(text, message):
    with pytest.raises(UsageError, match=message):
        build_jobs(list(parse_job_text(text, "x.fio")))


@pytest.mark.parametrize("rw,option", [("ttft", "numjobs=4"), ("ttft", "bs=4k"), ("prefix", "batch=8"),
                                       ("lookup", "rwmixread=30")])
def test_an_option_its_workload_does_not_use_is_refused_in_its_section_and_noted_when_inherited(rw, option,
                                                                                                  tmp_path, capsys):
    name = option.partition("=")[0]
    with pytest.raises(UsageError, match=f"job 'a' .*: {name} has no effect on rw={rw} "):
        build_jobs(list(parse_job_text(f"[a]\n{T}\nrw={rw}\n{option}\n", "x.fio")))
    inherited = build_jobs(list(parse_job_text(f"[global]\n{T}\n{option}\n[a]\nrw={rw}\n[b]\nrw=read\n", "x.fio")))
    assert [job.unused for job in inherited] == [(name,), ()]
    path = tmp_path / "j.fio"
    path.write_text(f"[a]\n{T}\nrw={rw}\n")
    assert run([str(path), f"--{option}", "--parse-only"]) == 0
    assert capsys.readouterr().err == f"kvperf: job 'a': {name} (inherited) has no effect on rw={rw}\n"


def test_command_line_globals_override_job_file(tmp_path):
    path = tmp_path / "j.fio"
    path.write_text(f"[a]\n{T}\nbs=4k\n")
    js = parse_sources([str(path)], parse_argv(["--bs=8k"]).job_options)
    assert build_jobs(list(js.jobs))[0].bs == 8192


def test_gates_global_and_per_job(tmp_path):
    path = tmp_path / "j.fio"
    path.write_text(f"[global]\n{T}\ngate=read.bw_bytes>=1\n[a]\ngate=write_bw>=2\ngate=read_p99<=3\n")
    js = parse_sources([str(path)], parse_argv(["--gate", "prefix.hit_ratio>=0.5"]).job_options)
    assert js.global_gates == ("read.bw_bytes>=1", "prefix.hit_ratio>=0.5")
    assert build_jobs(list(js.jobs))[0].gates == ("write_bw>=2", "read_p99<=3")


@pytest.mark.parametrize("text,value", [("4k", 4096), ("2m", 2 << 20), ("1g", 1 << 30), ("4KiB", 4096),
                                         ("1.5m", 1572864), ("512", 512), ("2M", 2 << 20)])
def test_sizes(text, value):
    assert parse_size("bs", text) == value


@pytest.mark.parametrize("text,value", [("10", 10.0), ("500ms", 0.5), ("2m", 120.0), ("250us", 0.00025)])
def test_times(text, value):
    assert parse_time_s("runtime", text) == pytest.approx(value)


@pytest.mark.parametrize("option,message", [
    ("bs=4q", "bs='4q': not a size"),
    ("bs=0", "bs='0': must be at least 1"),
    ("iodepth=5000", "iodepth='5000': must be at most 1024"),
    ("rw=reed", "rw='reed': unknown workload"),
    ("verify=maybe", "verify='maybe': not a boolean"),
    ("ttft_device=tpu", "ttft_device='tpu': use cpu, cuda or cuda:N"),
    ("ioengine=libaio", "ioengine='libaio': choose one of sync, asyncio"),
    ("codec=zstd", "codec='zstd': unknown codec"),
    ("random_distribution=pareto:1", "use zipf:THETA"),
    ("prefix_share=1.5", "prefix_share='1.5': must be at most 1.0"),
    ("blocksize=4k", "unknown option 'blocksize'"),
    ("runtim=4", "unknown option 'runtim' (did you mean runtime?)"),
    ("model=meta-llama/Llama-3-8B", "model='meta-llama/Llama-3-8B': not a built-in model (random-llama, "
     "random-llama-kvheavy, random-llama-tiny) and not a directory; a path must be a local checkpoint directory"),
])
def test_bad_option_values_are_named(option, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        build_jobs(list(parse_job_text(f"[a]\n{T}\n{option}\n", "x.fio")))


@pytest.mark.parametrize("name", ["random-llama", "random-llama-kvheavy", "random-llama-tiny", ""])
def test_builtin_models_and_local_directories_are_accepted(name, tmp_path):
    assert build_jobs(list(parse_job_text(f"[a]\n{T}\nrw=ttft\nmodel={name}\n")))[0].model == name
    (job,) = build_jobs(list(parse_job_text(f"[a]\n{T}\nrw=ttft\nmodel={tmp_path}\n")))
    assert job.model == str(tmp_path)  # a directory goes to from_pretrained(local_files_only=True)


def test_kvheavy_carries_more_kv_per_token_than_the_default():
    from kvtier.tools.kvperf.models import builtin_config

    def kv_bytes_per_token(c):
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4  # K and V, fp32

    heavy, default = builtin_config("random-llama-kvheavy"), builtin_config("")
    assert default is builtin_config("random-llama") and builtin_config("nope") is None
    assert (kv_bytes_per_token(heavy), kv_bytes_per_token(default)) == (64 << 10, 12 << 10)
    assert heavy["num_key_value_heads"] == heavy["num_attention_heads"]  # no GQA: every head has its KV


def test_load_figures_from_the_mode_means():
    from kvtier.tools.kvperf.ttftjob import load_figures
    assert load_figures(inmemory_ms=200.0, load_ms=100.0, kvtier_ms=230.0) == {
        "exposed_load_ms": 30.0, "load_vs_inmemory": 0.5, "exposed_vs_load": 0.3, "kvtier_vs_bound": 1.15}
    # the load the slower of the two: the bound is the load alone
    assert load_figures(100.0, 400.0, 300.0) == {
        "exposed_load_ms": 200.0, "load_vs_inmemory": 4.0, "exposed_vs_load": 0.5, "kvtier_vs_bound": 0.75}
    # no time to divide by: null in the JSON, which no gate passes
    assert load_figures(0.0, 0.0, 5.0) == {
        "exposed_load_ms": 5.0, "load_vs_inmemory": None, "exposed_vs_load": None, "kvtier_vs_bound": None}


def test_gates_on_the_load_figures():
    job = _job("t", ttft={"exposed_vs_load": 0.25, "kvtier_vs_bound": 1.2, "load_vs_inmemory": 0.6,
                          "load_ms": {"mean": 10.0}})
    nulls = _job("n", ttft={"exposed_vs_load": None, "kvtier_vs_bound": None})
    res = evaluate([parse_gate("ttft_exposed_vs_load<=0.3"), parse_gate("ttft_kvtier_vs_bound<=1.1"),
                    parse_gate("ttft.load_vs_inmemory>=30%"), parse_gate("ttft.load_ms.mean>0"),
                    parse_gate("n:ttft.exposed_vs_load<=0.3")], [job, nulls])
    assert [(r.gate.text, r.job, r.measured, r.passed) for r in res] == [
        ("ttft_exposed_vs_load<=0.3", "t", 0.25, True),
        ("ttft_exposed_vs_load<=0.3", "n", None, False),  # a null figure passes no gate
        ("ttft_kvtier_vs_bound<=1.1", "t", 1.2, False),
        ("ttft_kvtier_vs_bound<=1.1", "n", None, False),
        ("ttft.load_vs_inmemory>=30%", "t", 0.6, True),
        ("ttft.load_ms.mean>0", "t", 10.0, True),
        ("n:ttft.exposed_vs_load<=0.3", "n", None, False),
    ]


@pytest.mark.parametrize("options,message", [
    ("", "no target"),
    (f"{T}\nsize=1m\nbs=2m", "smaller than one request"),
    (f"{T}\ntime_based", "time_based needs a runtime"),
    (f"{T}\nruntime=1\nramp_time=2", "ramp_time"),
    (f"{T}\nrw=write\nverify_only", "verify_only needs rw=read"),
    (f"{T}\nrw=ttft\nprompt_tokens=64\ncached_tokens=64", "at least one token is prefilled"),
])
def test_inconsistent_options(options, message):
    with pytest.raises(UsageError, match=message):
        build_jobs(list(parse_job_text(f"[a]\n{options}\n")))


def test_targets():
    t = parse_targets("tcp://127.0.0.1:7410, tcp://[::1]:7411")
    assert [x.addr for x in t.tcp] == ["127.0.0.1:7410", "[::1]:7411"]
    d = parse_targets("direct:dev0=/tmp/a,dev1=/tmp/b@tcp://127.0.0.1:1")
    assert d.direct.for_devices(("dev0", "dev1")) == {"dev0": "/tmp/a", "dev1": "/tmp/b"}
    p = parse_targets("direct:/tmp/a,/tmp/b@tcp://127.0.0.1:1")
    assert p.direct.for_devices(("x", "y")) == {"x": "/tmp/a", "y": "/tmp/b"}
    for bad, msg in [("127.0.0.1:7410", "expected tcp://"), ("tcp://h", "expected tcp://HOST:PORT"),
                     ("tcp://h:70000", "out of range"), ("direct:/a", "needs a device map"),
                     ("tcp://h:1, tcp://h:1", "given more than once")]:
        with pytest.raises(UsageError, match=msg):
            parse_targets(bad)
    with pytest.raises(UsageError, match="1 device paths given but the daemon has 2"):
        p2 = parse_targets("direct:/a@tcp://h:1")
        p2.direct.for_devices(("x", "y"))


# -- gates -------------------------------------------------------------------

def _job(name, **sections):
    return {"jobname": name, **sections}


def test_gate_parsing():
    g = parse_gate("read.bw_bytes>=1.5e9")
    assert (g.path, g.op, g.value, g.job) == (("read", "bw_bytes"), ">=", 1.5e9, None)
    assert parse_gate("read_bw>=4GiB/s").value == 4 * 2**30
    assert parse_gate("ttft_reduction>=25%").value == 0.25
    assert parse_gate("seqread:read.clat_ns.percentile.99.000000<=5e6").job == "seqread"
    assert parse_gate("write_bw > 2m", job="a").job == "a"


@pytest.mark.parametrize("text,message", [
    ("read.bw_bytes=>1", "expected \\[JOB:\\]PATH OP VALUE"),
    ("read.bw_bytes>=fast", "cannot read the value 'fast'"),
    ("bandwidth>=1", "'bandwidth' is not a metric"),
    ("read..bw>=1", "is not a metric"),
])
def test_bad_gates(text, message):
    with pytest.raises(UsageError, match=message):
        parse_gate(text)


def test_gate_paths_with_dotted_percentile_keys():
    doc = {"read": {"clat_ns": {"percentile": {"99.000000": 7, "99.900000": 9}}}}
    assert resolve(doc, ("read", "clat_ns", "percentile", "99", "000000")) == 7
    assert resolve(doc, ("read", "clat_ns", "percentile", "99")) == 7
    assert resolve(doc, ("read", "clat_ns", "percentile", "99", "9")) == 9
    assert resolve(doc, ("read", "nope")) is None


def test_gate_evaluation_scopes():
    jobs = [_job("w", read={"total_ios": 0, "bw_bytes": 0}, write={"total_ios": 5, "bw_bytes": 100}),
            _job("r", read={"total_ios": 5, "bw_bytes": 50}, write={"total_ios": 0, "bw_bytes": 0})]
    res = evaluate([parse_gate("read.bw_bytes>=40"), parse_gate("write.bw_bytes>=200"),
                    parse_gate("w:read.bw_bytes>=1"), parse_gate("ttft.reduction>=0.25"),
                    parse_gate("nojob:read_bw>=1")], jobs)
    assert [(r.gate.text, r.job, r.passed) for r in res] == [
        ("read.bw_bytes>=40", "r", True),          # judges only jobs that did reads
        ("write.bw_bytes>=200", "w", False),
        ("w:read.bw_bytes>=1", "w", False),        # the named job did no reads: fails
        ("ttft.reduction>=0.25", None, False),     # nobody reports it: fails
        ("nojob:read_bw>=1", "nojob", False),
    ]
    assert "no job reports ttft.reduction" in res[3].note


def test_a_global_gate_fails_a_job_that_reports_the_figure_as_null():
    jobs = [_job("a", ttft={"exposed_vs_load": None}), _job("b", ttft={"exposed_vs_load": 0.1}),
            _job("c", read={"total_ios": 5, "bw_bytes": 50})]  # no ttft section: not judged
    res = evaluate([parse_gate("ttft.exposed_vs_load<=0.3")], jobs)
    assert [(r.job, r.measured, r.passed) for r in res] == [("a", None, False), ("b", 0.1, True)]
    assert "as null" in res[0].note


def test_verify_only_without_verify_is_refused():
    js = parse_sources([], [("target", "tcp://127.0.0.1:1"), ("name", "chk"), ("rw", "read"), ("verify_only", "1")])
    with pytest.raises(UsageError, match="verify_only needs verify=1"):
        build_jobs(list(js.jobs))


def test_a_float_option_of_nan_is_refused():
    js = parse_sources([], [("target", "tcp://127.0.0.1:1"), ("name", "p"), ("rw", "prefix"), ("prefix_share", "nan")])
    with pytest.raises(UsageError, match="not a number"):
        build_jobs(list(js.jobs))


def test_the_all_jobs_line_adds_up_jobs_that_ran_one_after_another():
    from kvtier.tools.kvperf.report_text import group_status

    one = {"total_ios": 1, "io_bytes": 1 << 30, "runtime": 1000, "bw_bytes": 1 << 30}  # 1 GiB/s for 1 s each
    idle = {"total_ios": 0}
    lines = group_status([{"read": dict(one), "write": idle}, {"read": dict(one), "write": idle}])
    assert "bw=1.0GiB/s" in lines[2] and "io=2.0GiB" in lines[2], lines


def test_the_progress_clock_starts_with_the_first_work_not_the_layout(monkeypatch):
    import sys

    from kvtier.tools.kvperf import progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    line = progress.ProgressLine(True, "r", None, "bytes", 10.0)  # time_based, runtime 10 s
    seen = {}

    class Bar:  # what the progress line hands to rich, recorded
        def update(self, task, **kw):
            seen.update(kw)
    monkeypatch.setattr(line, "_start", lambda: setattr(line, "_progress", Bar()))
    now[0] = 12.0  # the untimed layout took 12 s; nothing measured yet
    line.update(0)
    now[0] = 15.0
    line.update(1 << 20)
    assert (seen["completed"], seen["total"]) == (3.0, 10.0)


# -- statistics --------------------------------------------------------------

def test_clat_stats_keys_and_values():
    s = clat_stats(__import__("numpy").arange(1, 101, dtype="int64") * 1000)
    assert (s["min"], s["max"], s["N"]) == (1000, 100000, 100)
    assert s["mean"] == pytest.approx(50500)
    assert s["percentile"]["50.000000"] == 50000
    assert s["percentile"]["99.000000"] == 99000
    assert s["percentile"]["99.990000"] == 100000
    assert list(s["percentile"])[:3] == ["1.000000", "5.000000", "10.000000"]


def test_direction_stats_units():
    log = OpLog()
    for i in range(10):  # 10 requests of 1 MiB over 1 s
        log.add(done_ns=i * 100_000_000 + 50_000_000, lat_ns=2_000_000, nbytes=1 << 20)
    d = direction_stats(log.arrays(), runtime_ns=1_000_000_000)
    assert d["io_bytes"] == 10 << 20 and d["total_ios"] == 10
    assert d["bw_bytes"] == 10 << 20 and d["bw"] == 10 * 1024  # bw is KiB/s, as in fio
    assert d["iops"] == pytest.approx(10.0) and d["runtime"] == 1000
    assert d["bw_samples"] == 2 and d["bw_min"] == d["bw_max"] == 10 * 1024


# -- the command line --------------------------------------------------------

def test_usage_errors_exit_2(capsys):
    assert run(["--name=a", "--rw=reed", "--target=tcp://127.0.0.1:1"]) == EXIT_USAGE
    assert "rw='reed': unknown workload" in capsys.readouterr().err
    assert run([]) == EXIT_USAGE
    assert "no jobs" in capsys.readouterr().err
    assert run(["/nonexistent/job.fio"]) == EXIT_USAGE
    assert "cannot read job file /nonexistent/job.fio" in capsys.readouterr().err
    assert run(["--name=a", "--target=tcp://h:1", "--gate=read_bw~1"]) == EXIT_USAGE
    assert "expected [JOB:]PATH OP VALUE" in capsys.readouterr().err
    assert run(["--output-format=xml", "--name=a"]) == EXIT_USAGE
    assert run(["--name=a", "--target=tcp://h:1", "--token_file=/nonexistent"]) == EXIT_USAGE
    assert "token_file /nonexistent" in capsys.readouterr().err
    assert run(["--name=t", "--rw=ttft", "--target=tcp://h:1", "--model=gpt2"]) == EXIT_USAGE  # never the hub
    assert "a path must be a local checkpoint directory" in capsys.readouterr().err


def test_section_selects_jobs(capsys, tmp_path):
    job = tmp_path / "j.fio"
    job.write_text(f"[global]\n{T}\n[put]\nrw=write\n[get]\nrw=read\n")
    assert run([str(job), "--section=get", "--parse-only"]) == 0
    out = capsys.readouterr().out
    assert "get: (g=0): rw=read" in out and "put:" not in out
    assert run([str(job), "--section=nope", "--parse-only"]) == EXIT_USAGE
    assert "--section=nope: no such job (jobs: get, put)" in capsys.readouterr().err


def test_parse_only_and_cmdhelp(capsys, tmp_path):
    job = tmp_path / "j.fio"
    job.write_text(f"[a]\n{T}\ngate=read_bw>=1\n")
    assert run([str(job), "--parse-only"]) == 0
    assert "1 job(s), 1 gate(s): OK" in capsys.readouterr().out
    assert run(["--cmdhelp"]) == 0
    assert "rwmixread" in capsys.readouterr().out


def test_trace_errors_name_the_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps([1, 2, 3]) + "\n" + json.dumps({"tokens": [1, -4]}) + "\n")
    assert run(["--name=p", "--rw=prefix", f"--trace={trace}", "--target=tcp://127.0.0.1:1"]) == EXIT_USAGE
    assert f"trace {trace}:2: token ids must be integers" in capsys.readouterr().err


def test_unreachable_daemon_exits_2(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = run(["--name=r", "--rw=read", "--size=1m", "--bs=64k", f"--target=tcp://127.0.0.1:{port}"])
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"cannot use target tcp://127.0.0.1:{port}" in err


JOB_DIR = __import__("pathlib").Path(__file__).resolve().parent.parent / "perf" / "jobs"


@pytest.mark.parametrize("path", sorted(JOB_DIR.glob("*.fio")), ids=lambda p: p.name)
def test_shipped_job_files_parse(path, monkeypatch, capsys):
    monkeypatch.setenv("KVTIER_TARGET", "tcp://127.0.0.1:7410")
    assert run([str(path), "--parse-only"]) == 0, capsys.readouterr().err
    assert "OK" in capsys.readouterr().out


def test_shipped_job_files_need_the_target_variable(monkeypatch, capsys):
    monkeypatch.delenv("KVTIER_TARGET", raising=False)
    assert run([str(JOB_DIR / "smoke.fio"), "--parse-only"]) == EXIT_USAGE
    assert "${KVTIER_TARGET} is not set" in capsys.readouterr().err


def test_bw_series_folds_a_short_last_window():
    from kvtier.tools.kvperf.stats import bw_series
    log = OpLog()
    for i in range(11):  # 1 MiB every 100 ms, the last at 1.01 s
        log.add(done_ns=min(i * 100_000_000 + 50_000_000, 1_009_000_000), lat_ns=1, nbytes=1 << 20)
    t, bw = bw_series(log.arrays(), runtime_ns=1_010_000_000)
    assert list(t) == [0.5, 1.01]  # the 10 ms tail joined the second window
    assert bw[0] == pytest.approx(5 * 2**20 / 0.5) and bw[1] == pytest.approx(6 * 2**20 / 0.51)


# -- block content (verify) without a daemon ----------------------------------

@pytest.mark.parametrize("verify", [False, True])
def test_block_maker_reuses_buffers_and_matches_encode_block(verify):
    from kvtier.common.blockformat import encode_block, verify_block
    from kvtier.tools.kvperf.content import BlockMaker, block_key, payload_for

    maker = BlockMaker("ks", "opaque", 4096 + 3, verify)
    keys = [block_key(1, "ks", 0, i) for i in range(6)]
    for round_ in range(2):  # the second round builds into released buffers
        blocks = maker.blocks(keys[round_ * 3:round_ * 3 + 3])
        for key, block in zip(keys[round_ * 3:], blocks):
            verify_block(block, expected_key=key)
            payload = payload_for(key, 4096 + 3) if verify else payload_for(maker.ns_id, 4096 + 3)
            assert bytes(block) == encode_block(key, maker.ns_id, maker.codec_id, payload) == maker.block(key)
        maker.release(blocks)


def test_verify_content_follows_the_key():
    from kvtier.common.blockformat import encode_block
    from kvtier.tools.kvperf.content import BlockMaker, block_key, check_block, payload_for

    size = 1 << 16
    a, b = block_key(1, "ks", 0, 0), block_key(1, "ks", 0, 1)
    pa, pb = payload_for(a, size), payload_for(b, size)
    assert len(pa) == size and pa != pb and pa[:16] == a and payload_for(a, size) == pa  # deterministic
    assert payload_for(a, 100) == pa[:16] + payload_for(a, 100)[16:] and len(payload_for(a, 7)) == 7
    ns = BlockMaker("ks", "opaque", size, True).ns_id
    assert check_block(encode_block(a, ns, 0, pa), a, size) is None
    # valid header and CRCs, but content of another key, or one byte changed: caught by the content check
    assert "differs" in check_block(encode_block(a, ns, 0, a + pb[16:]), a, size)
    flipped = bytearray(pa)
    flipped[size - 1] ^= 1
    assert "differs" in check_block(encode_block(a, ns, 0, bytes(flipped)), a, size)
    assert "not the expected" in check_block(encode_block(b, ns, 0, pb), a, size)
    assert "payload is" in check_block(encode_block(a, ns, 0, pa[:-1]), a, size)
    assert "missing" in check_block(None, a, size)


def test_layer_groups_option():
    (job,) = build_jobs(list(parse_job_text("[t]\nrw=ttft\ntarget=tcp://127.0.0.1:1\nlayer_groups=4\n")))
    assert job.layer_groups == 4
    (default,) = build_jobs(list(parse_job_text("[t]\nrw=ttft\ntarget=tcp://127.0.0.1:1\n")))
    assert default.layer_groups == 1
    with pytest.raises(UsageError, match="layer_groups"):
        build_jobs(list(parse_job_text("[t]\nrw=ttft\ntarget=tcp://127.0.0.1:1\nlayer_groups=0\n")))
