"""``kvperf``: fio-style benchmark and gate tool for a kvtier deployment.

    kvperf [TOOL OPTIONS] [JOBFILE...] [--OPTION=VALUE...] [--name=JOB --OPTION=VALUE...]...

Exit status: 0 all jobs ran clean and every gate passed; 1 a gate failed or a
job found bad data (verify); 2 a usage error (bad job file, option or gate)
or a daemon that cannot be reached or that failed the run.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace

from .executor import JobFailed, preflight, run_job
from .gates import Gate, evaluate, format_table, parse_gate
from .jobfile import JobSet, parse_sources
from .options import build_jobs, option_help
from .report_json import KVPERF_VERSION, full_report, job_report
from .report_text import group_status, header_lines, job_lines
from .result import ConnectError
from .units import UsageError

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_USAGE = 2
OUTPUT_FORMATS = ("normal", "json")
TOOL_OPTIONS_WITH_VALUE = ("output-format", "output", "gate", "plot", "section")

USAGE = """usage: kvperf [--output-format=normal|json] [--output=FILE] [--gate=EXPR]... [--plot=FILE.png]
              [--parse-only] [--cmdhelp] [--version] [JOBFILE...] [--OPTION=VALUE...] [--name=JOB ...]

  JOBFILE             fio-style job file: [global] and one [section] per job
  --OPTION=VALUE      any job option; before the first --name it is global
  --name=JOB          start a job on the command line
  --gate=EXPR         [JOB:]PATH OP VALUE, e.g. read.bw_bytes>=1.5e9 (repeatable)
  --section=JOB       run only this job of the job files (repeatable), as fio's --section
  --output-format=F   normal (fio-like text) or json (fio's keys)
  --output=FILE       write the report to FILE instead of stdout
  --plot=FILE.png     bandwidth over time and latency CDF per job; TTFT by concurrency
  --parse-only        check the jobs and gates, run nothing
  --cmdhelp           list the job options

exit status: 0 pass, 1 a gate failed or verify found bad data, 2 usage or connection error
"""


@dataclass
class Args:
    job_files: list[str] = field(default_factory=list)
    job_options: list[tuple[str, str]] = field(default_factory=list)
    output_format: str = "normal"
    output: str = ""
    plot: str = ""
    sections: list[str] = field(default_factory=list)
    parse_only: bool = False
    help: bool = False
    cmdhelp: bool = False
    version: bool = False


def parse_argv(argv: list[str]) -> Args:
    args = Args()
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-") or arg == "-":
            args.job_files.append(arg)
            continue
        if arg in ("-h", "--help"):
            args.help = True
            continue
        if not arg.startswith("--"):
            raise UsageError(f"unknown argument {arg!r}; options are --name=value (see kvperf --help)")
        key, sep, value = arg[2:].partition("=")
        if key in TOOL_OPTIONS_WITH_VALUE:
            if not sep:
                if i >= len(argv):
                    raise UsageError(f"--{key} needs a value")
                value = argv[i]
                i += 1
            if key == "output-format":
                if value not in OUTPUT_FORMATS:
                    raise UsageError(f"--output-format={value!r}: choose one of {', '.join(OUTPUT_FORMATS)}")
                args.output_format = value
            elif key == "output":
                args.output = value
            elif key == "section":
                args.sections.append(value)
            elif key == "plot":
                if not value.lower().endswith((".png", ".svg", ".pdf")):
                    raise UsageError(f"--plot={value!r}: give a .png (or .svg/.pdf) file name")
                args.plot = value
            else:
                args.job_options.append(("gate", value))  # global before --name, the job's after it
        elif key in ("parse-only", "cmdhelp", "version"):
            setattr(args, key.replace("-", "_"), True)
        else:
            args.job_options.append((key.replace("-", "_").lower(), value))
    return args


def _select(jobset: JobSet, sections: list[str]) -> JobSet:
    if not sections:
        return jobset
    names = {j.name for j in jobset.jobs}
    unknown = [s for s in sections if s not in names]
    if unknown:
        raise UsageError(f"--section={unknown[0]}: no such job (jobs: {', '.join(sorted(names))})")
    return replace(jobset, jobs=tuple(j for j in jobset.jobs if j.name in sections))


def _collect_gates(jobset, jobs) -> list[Gate]:
    gates = [parse_gate(g) for g in jobset.global_gates]
    for job in jobs:
        gates += [parse_gate(g, job=job.name) for g in job.gates]
    return gates


def _print_cmdhelp(out) -> None:
    for name, default, text in option_help():
        print(f"{name:<20} {text} (default: {default})", file=out)


def run(argv: list[str], stdout=None, stderr=None) -> int:
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        args = parse_argv(argv)
        if args.help:
            print(USAGE, file=stdout)
            return EXIT_OK
        if args.version:
            print(KVPERF_VERSION, file=stdout)
            return EXIT_OK
        if args.cmdhelp:
            _print_cmdhelp(stdout)
            return EXIT_OK
        jobset = _select(parse_sources(args.job_files, args.job_options), args.sections)
        jobs = build_jobs(list(jobset.jobs))
        gates = _collect_gates(jobset, jobs)
        for job in jobs:
            preflight(job)
            if job.unused:
                print(f"kvperf: job {job.name!r}: {', '.join(job.unused)} (inherited) ha"
                      f"{'s' if len(job.unused) == 1 else 've'} no effect on rw={job.rw}", file=stderr)
        if args.parse_only:
            for line in header_lines(jobs):
                print(line, file=stdout)
            print(f"{len(jobs)} job(s), {len(gates)} gate(s): OK", file=stdout)
            return EXIT_OK
        return _run_jobs(args, jobset, jobs, gates, stdout, stderr)
    except (UsageError, ConnectError, JobFailed) as e:
        print(f"kvperf: {e}", file=stderr)
        return EXIT_USAGE


def _run_jobs(args: Args, jobset, jobs, gates, stdout, stderr) -> int:
    json_mode = args.output_format == "json"
    text = _TextOutput(args, stdout)
    if not json_mode:
        text.emit(header_lines(jobs) + [KVPERF_VERSION, f"Starting {len(jobs)} job(s)", ""])
    reports, results = [], []
    for index, (job, raw) in enumerate(zip(jobs, jobset.jobs)):
        result = run_job(job, show_progress=not json_mode)
        results.append(result)
        reports.append(job_report(index, job, raw, result))
    gate_results = evaluate(gates, reports)
    failed_gates = [r for r in gate_results if not r.passed]
    bad_jobs = [r for r in reports if r["error"]]
    if json_mode:
        doc = full_report(dict(jobset.global_options), reports, gate_results)
        _write(args, stdout, json.dumps(doc, indent=2) + "\n")
        if gate_results:
            print(format_table(gate_results), file=stderr)
    else:
        lines = []
        for report, job in zip(reports, jobs):
            lines += job_lines(report, job.rw) + [""]
        lines += group_status(reports)
        if gate_results:
            lines += ["", format_table(gate_results)]
        text.emit(lines)
        text.finish()
    if args.plot:
        from .plot import write_plot
        write_plot(args.plot, jobs, results, reports)
    for r in bad_jobs:
        print(f"kvperf: job {r['jobname']!r}: {r['verify_errors']} verify error(s)", file=stderr)
    return EXIT_GATE_FAILED if failed_gates or bad_jobs else EXIT_OK


class _TextOutput:
    """Text goes to stdout as it comes; with --output it is written once at the end."""

    def __init__(self, args: Args, stdout):
        self.args = args
        self.stdout = stdout
        self.lines: list[str] = []

    def emit(self, lines: list[str]) -> None:
        if self.args.output:
            self.lines.extend(lines)
        else:
            print("\n".join(lines), file=self.stdout, flush=True)

    def finish(self) -> None:
        if self.args.output:
            _write(self.args, self.stdout, "\n".join(self.lines) + "\n")


def _write(args: Args, stdout, text: str) -> None:
    if not args.output:
        stdout.write(text)
        stdout.flush()
        return
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"--output={args.output}: {e.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    code = run(sys.argv[1:] if argv is None else argv)
    if argv is None:
        sys.exit(code)
    return code
