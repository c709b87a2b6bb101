"""fio-style job files and their command-line twin, parsed into raw sections.

A job file is INI as fio reads it::

    ; comment            # also a comment
    [global]
    target=tcp://127.0.0.1:7410
    bs=2m

    [seqwrite]
    rw=write
    size=${SIZE}         ; environment variables expand, as in fio
    gate=write.bw_bytes>=1e9

A ``[global]`` section applies to the jobs that follow it (a later
``[global]`` adds to it for the jobs after it, as in fio). An option without
``=`` is a flag (``time_based``). ``gate`` may repeat; for every other option the
last value wins. ``name=`` in a job section sets the name the job is reported
under (the section's name otherwise, as in fio); in ``[global]`` it is an error.

On the command line every option is ``--option=value``; ``--name=NAME`` starts
a job, and options before the first ``--name`` are global. Values stay strings
here: :mod:`kvtier.tools.kvperf.options` types and validates them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .units import UsageError

JOB_FILE_BYTES_MAX = 1 << 20  # a job file is a page of text; refuse anything that is not
GLOBAL_SECTION = "global"
NAME_OPTION = "name"  # names the job in a section; starts a job on the command line
REPEATABLE_OPTIONS = frozenset({"gate"})
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_OPTION_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class RawJob:
    """One job: its name and the option strings that apply to it, global first."""

    name: str
    options: tuple[tuple[str, str], ...]
    source: str  # "file:LINE" or "command line", for messages
    own: frozenset[str] = frozenset()  # options set in the job's own section (or after its --name)

    def values(self) -> dict[str, str]:
        """Last value wins for ordinary options."""
        return {k: v for k, v in self.options if k not in REPEATABLE_OPTIONS}

    def repeated(self, option: str) -> list[str]:
        return [v for k, v in self.options if k == option]


@dataclass
class _Builder:
    global_options: list[tuple[str, str]] = field(default_factory=list)
    global_gates: list[str] = field(default_factory=list)
    jobs: list[tuple[str, list[tuple[str, str]], list[tuple[str, str]], str]] = field(default_factory=list)

    def finish(self) -> list[RawJob]:
        return [RawJob(name, tuple(glob) + tuple(own), src, _names(own)) for name, glob, own, src in self.jobs]


def _strip_comment(line: str) -> str:
    """Drop a whole-line comment, or one that starts after whitespace."""
    stripped = line.strip()
    if stripped.startswith((";", "#")):
        return ""
    m = re.search(r"\s[;#]", stripped)
    return stripped[: m.start()].rstrip() if m else stripped


def _expand_env(text: str, where: str) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise UsageError(f"{where}: environment variable ${{{name}}} is not set")
        return os.environ[name]

    return _ENV_RE.sub(sub, text)


def split_option(text: str, where: str) -> tuple[str, str]:
    """``"bs=2m"`` -> ("bs", "2m"); ``"time_based"`` -> ("time_based", "")."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not _OPTION_NAME_RE.match(key):
        raise UsageError(f"{where}: {text!r} is not an option (expected name=value)")
    return key.lower(), _expand_env(value.strip(), where) if sep else ""


def parse_job_text(text: str, source: str = "<job file>", builder: _Builder | None = None) -> list[RawJob]:
    """Parse the text of a job file into jobs."""
    if len(text) > JOB_FILE_BYTES_MAX:
        raise UsageError(f"{source}: job file is over {JOB_FILE_BYTES_MAX} bytes")
    b = builder or _Builder()
    current: list[tuple[str, str]] | None = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        where = f"{source}:{lineno}"
        line = _strip_comment(raw)
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise UsageError(f"{where}: bad section header {line!r}")
            name = line[1:-1].strip()
            if not name:
                raise UsageError(f"{where}: empty section name")
            if name == GLOBAL_SECTION:
                current = b.global_options
            else:
                current = []
                b.jobs.append((name, list(b.global_options), current, where))
            continue
        if current is None:
            raise UsageError(f"{where}: option {line!r} comes before any [section]")
        key, value = split_option(line, where)
        if key == NAME_OPTION and current is b.global_options:
            raise UsageError(f"{where}: name= names one job; put it in a job section, not [{GLOBAL_SECTION}]")
        if key == "gate" and current is b.global_options:
            b.global_gates.append(value)  # a [global] gate judges every job that reports the metric
        else:
            current.append((key, value))
    return b.finish() if builder is None else []


def parse_job_file(path: str, builder: _Builder | None = None) -> list[RawJob]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(JOB_FILE_BYTES_MAX + 1)
    except OSError as e:
        raise UsageError(f"cannot read job file {path}: {e.strerror}") from None
    return parse_job_text(text, path, builder)


@dataclass(frozen=True)
class JobSet:
    jobs: tuple[RawJob, ...]
    global_gates: tuple[str, ...]  # from [global] sections: judged against every job
    global_options: tuple[tuple[str, str], ...] = ()  # for the report's "global options"


def parse_sources(job_files: list[str], cli_options: list[tuple[str, str]]) -> JobSet:
    """Jobs from job files (in order), then jobs named on the command line.

    Command-line options before the first ``--name`` are global: they apply to
    every job, including those from job files, and override the files' values.
    A ``gate`` in a job section judges that job; a ``gate`` in ``[global]``
    judges every job that reports its metric (as ``--gate`` does).
    """
    b = _Builder()
    for path in job_files:
        parse_job_file(path, b)
    cli_global: list[tuple[str, str]] = []
    cli_jobs: list[tuple[str, list[tuple[str, str]]]] = []
    for key, value in cli_options:
        if key == NAME_OPTION:
            if not value:
                raise UsageError("--name needs a value")
            cli_jobs.append((value, []))
        elif cli_jobs:
            cli_jobs[-1][1].append((key, value))
        elif key == "gate":
            b.global_gates.append(value)  # --gate before any --name judges every job
        else:
            cli_global.append((key, value))
    jobs = [RawJob(n, tuple(g) + tuple(own) + tuple(cli_global), src, _names(own)) for n, g, own, src in b.jobs]
    base = list(b.global_options) + cli_global
    jobs += [RawJob(n, tuple(base) + tuple(own), "command line", _names(own)) for n, own in cli_jobs]
    if not jobs:
        raise UsageError("no jobs: give a job file or --name=NAME with options (see kvperf --help)")
    return JobSet(tuple(jobs), tuple(b.global_gates), tuple(base))


def _names(options) -> frozenset[str]:
    return frozenset(key for key, _ in options)
