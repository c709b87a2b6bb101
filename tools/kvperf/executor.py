"""Runs a job: its ``numjobs`` clones in their own processes (as fio forks
one process per clone), then merges what they send back.

Each clone reports through a queue: ("ok", CloneResult) or ("error", kind,
message). A shared counter per clone feeds the progress line. Jobs run one
after another, in the order given (as if every job had fio's ``stonewall``).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import queue as queue_mod
import traceback

from kvtier.wire.events import ClientError

from .blockjob import Progress, run_block_clone
from .options import JobOptions
from .progress import ProgressLine
from .result import ConnectError, JobResult
from .targets import parse_targets, read_token
from .trace import check_trace
from .units import UsageError

PROGRESS_TICK_S = 0.2  # how often the parent refreshes the progress line while it waits
CLONE_EXIT_GRACE_S = 10.0  # a clone that sent its result must exit within this long
CLONE_SILENCE_S_MAX = 3600.0  # a clone that sends nothing for an hour has hung


class JobFailed(RuntimeError):
    """A clone failed during the run for a reason other than usage or connection."""


def _clone_main(job: JobOptions, clone: int, counter, results, barrier) -> None:
    """Entry point of a clone process."""
    targets = parse_targets(job.target)
    token = read_token(job.token_file)
    progress = Progress(counter)
    try:
        if job.rw == "prefix":
            from .prefixjob import run_prefix_clone
            result = asyncio.run(run_prefix_clone(job, clone, job.numjobs, targets, token, progress, barrier.wait))
        else:
            result = asyncio.run(run_block_clone(job, clone, targets, token, progress, barrier.wait))
        results.put(("ok", clone, result))
    except ConnectError as e:
        results.put(("error", "connect", f"{e}"))
    except ClientError as e:  # the daemon went away or refused a request mid-run
        results.put(("error", "connect", f"clone {clone}: the daemon failed the run: {type(e).__name__}: {e}"))
    except UsageError as e:
        results.put(("error", "usage", f"{e}"))
    except BaseException as e:  # reported to the parent, which raises it: never swallowed
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        results.put(("error", "runtime", f"clone {clone}: {detail}\n{traceback.format_exc()}"))


def _expected_work(job: JobOptions) -> tuple[float | None, str]:
    if job.time_based:
        return None, "bytes"
    if job.rw == "prefix":
        return (None if job.trace else float(job.prefix_requests * job.numjobs)), "prompts"
    if job.rw == "lookup":
        return None, "keys"
    return float(job.blocks * job.bs * job.numjobs), "bytes"


def preflight(job: JobOptions) -> None:
    """Checks that need no daemon: targets, token, trace. UsageError on a problem."""
    parse_targets(job.target)
    read_token(job.token_file)
    if job.trace:
        check_trace(job.trace)


def _run_ttft_job(job: JobOptions, show_progress: bool) -> JobResult:
    """ttft runs in this process: the model and torch's threads stay in one place."""
    from .result import CloneLog
    from .ttftjob import MODES, run_ttft

    total = float(sum(max(job.ttft_prompts, c) for c in job.concurrency) * len(MODES))
    done = [0]
    with ProgressLine(show_progress, job.name, total, "prompts", 0.0) as line:
        def progress(n: int) -> None:
            done[0] += n
            line.update(done[0])

        report, errors, messages, runtime_ns = run_ttft(job, parse_targets(job.target), read_token(job.token_file),
                                                       progress)
    log = CloneLog()
    for m in messages:
        log.verify_error(m)
    log.verify_errors = errors
    base = JobResult.merge([log.finish(runtime_ns)])
    return JobResult(**{**base.__dict__, "ttft": report})


def run_job(job: JobOptions, show_progress: bool) -> JobResult:
    preflight(job)
    if job.rw == "ttft":
        return _run_ttft_job(job, show_progress)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    counters = [ctx.RawValue("q", 0) for _ in range(job.numjobs)]
    barrier = ctx.Barrier(job.numjobs)  # clones start measuring together, after their layout
    procs = [ctx.Process(target=_clone_main, args=(job, c, counters[c], results, barrier), name=f"kvperf-{job.name}-{c}",
                         daemon=True) for c in range(job.numjobs)]
    for p in procs:
        p.start()
    total, unit = _expected_work(job)
    parts = []
    failure: tuple[str, str] | None = None
    silent_s = 0.0
    try:
        with ProgressLine(show_progress, job.name, total, unit, job.runtime + job.ramp_time) as line:
            while len(parts) < job.numjobs and failure is None:
                try:
                    msg = results.get(timeout=PROGRESS_TICK_S)
                except queue_mod.Empty:
                    line.update(sum(c.value for c in counters))
                    silent_s += PROGRESS_TICK_S
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        failure = ("runtime", f"clone process {dead[0].name} died with exit code {dead[0].exitcode}")
                    elif silent_s > CLONE_SILENCE_S_MAX + job.runtime:
                        failure = ("runtime", f"clones sent nothing for {silent_s:.0f} s")
                    continue
                if msg[0] == "ok":
                    parts.append(msg[2])
                else:
                    failure = (msg[1], msg[2])
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.terminate()
            p.join(CLONE_EXIT_GRACE_S)
    if failure is not None:
        kind, message = failure
        if kind == "connect":
            raise ConnectError(f"job {job.name!r}: {message}")
        if kind == "usage":
            raise UsageError(f"job {job.name!r}: {message}")
        raise JobFailed(f"job {job.name!r} failed: {message}")
    return JobResult.merge(parts)
