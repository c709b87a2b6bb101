"""Gates: conditions on a job's JSON report that turn a run into pass/fail.

Syntax: ``[JOB:]PATH OP VALUE``, e.g. ``read.bw_bytes>=1.5e9``,
``ttft.reduction>=25%``, ``seqread:read.clat_ns.percentile.99<=5e6``.

- PATH walks the job's JSON object with dots; a key that itself holds dots
  (``"99.000000"``) is matched whole, and a bare percentile (``99``, ``99.9``)
  means fio's key for it. Short names: ``read_bw``, ``write_bw``,
  ``read_iops``, ``write_iops``, ``read_p99``, ``write_p99``, ``hit_ratio``,
  ``ttft_reduction``, ``ttft_exposed_vs_load``, ``ttft_kvtier_vs_bound``.
- OP is one of ``>= <= > < == !=``.
- VALUE is a number with an optional size suffix (``4g``, ``4GiB``, base 1024),
  ``/s``, or ``%`` (divided by 100).

A gate with ``JOB:`` (or written in a job's section) judges that job and fails
if the job does not report PATH. Any other gate judges every job that reports
PATH, and fails if none does.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from .units import UsageError

GATE_TEXT_MAX = 256  # a gate is one comparison; longer text is a mistake
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
        ">": operator.gt, "<": operator.lt}
_GATE_RE = re.compile(r"^\s*(?:([^:<>=!\s]+):)?\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(>=|<=|==|!=|>|<)\s*(\S+)\s*$")
_VALUE_RE = re.compile(r"^([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)([kKmMgGtT]?)(?:i?[bB])?(/s)?(%)?$")
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
ALIASES = {
    "read_bw": "read.bw_bytes",
    "write_bw": "write.bw_bytes",
    "read_iops": "read.iops",
    "write_iops": "write.iops",
    "read_p99": "read.clat_ns.percentile.99.000000",
    "write_p99": "write.clat_ns.percentile.99.000000",
    "hit_ratio": "prefix.hit_ratio",
    "ttft_reduction": "ttft.reduction",
    "ttft_exposed_vs_load": "ttft.exposed_vs_load",
    "ttft_kvtier_vs_bound": "ttft.kvtier_vs_bound",
}
ROOTS = ("read", "write", "lookup", "prefix", "ttft", "error", "job_runtime", "verify_errors")


@dataclass(frozen=True)
class Gate:
    text: str
    job: str | None  # None: every job that reports the path
    path: tuple[str, ...]
    op: str
    value: float

    def check(self, measured: float) -> bool:
        return bool(_OPS[self.op](measured, self.value))


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    job: str | None
    measured: float | None
    passed: bool
    note: str = ""


def parse_value(text: str, where: str) -> float:
    m = _VALUE_RE.match(text)
    if not m:
        raise UsageError(f"gate {where!r}: cannot read the value {text!r} (a number, optionally with k/m/g, /s or %)")
    number, suffix, _, percent = m.groups()
    value = float(number) * _SCALE[suffix.lower()]
    return value / 100.0 if percent else value


def parse_gate(text: str, job: str | None = None) -> Gate:
    """Parse one gate; ``job`` scopes gates written in a job's section."""
    if len(text) > GATE_TEXT_MAX:
        raise UsageError(f"gate of {len(text)} characters is over the limit {GATE_TEXT_MAX}")
    m = _GATE_RE.match(text)
    if not m:
        raise UsageError(f"gate {text!r}: expected [JOB:]PATH OP VALUE with OP one of >= <= > < == != "
                         f"(e.g. read.bw_bytes>=1.5e9)")
    scope, path, op, value = m.groups()
    path = ALIASES.get(path, path)
    segments = tuple(path.split("."))
    if segments[0] not in ROOTS or any(not s for s in segments):
        raise UsageError(f"gate {text!r}: {path!r} is not a metric; paths start with one of {', '.join(ROOTS)} "
                         f"or are one of {', '.join(ALIASES)}")
    return Gate(text=text.strip(), job=scope or job, path=segments, op=op, value=parse_value(value, text))


def resolve(obj, segments: tuple[str, ...]):
    """Walk ``obj`` by ``segments``, matching keys that contain dots whole.
    Returns None when the path is absent."""
    if not segments:
        return obj
    if not isinstance(obj, dict):
        return None
    for n in range(len(segments), 0, -1):
        key = ".".join(segments[:n])
        candidates = [key]
        try:
            candidates.append(f"{float(key):.6f}")  # a bare percentile: 99 -> "99.000000"
        except ValueError:
            pass
        for k in candidates:
            if k in obj:
                found = resolve(obj[k], segments[n:])
                if found is not None:
                    return found
    return None


def _reports_null(job: dict, path: tuple[str, ...]) -> bool:
    """Whether the job holds ``path`` with the value null (a figure it could not compute)."""
    parent = resolve(job, path[:-1]) if len(path) > 1 else job
    return isinstance(parent, dict) and path[-1] in parent and parent[path[-1]] is None


def _lookup(job: dict, path: tuple[str, ...]):
    """The metric, or None where the job does not report it; a direction
    section without any I/O (``total_ios == 0``) reports nothing."""
    section = job.get(path[0])
    if isinstance(section, dict) and section.get("total_ios") == 0:
        return None
    value = resolve(job, path)
    if value is None or isinstance(value, (dict, list, str, bool)):
        return None
    return value


def evaluate(gates: list[Gate], job_reports: list[dict]) -> list[GateResult]:
    """Judge every gate against the jobs' JSON objects (fio's ``jobs[]``)."""
    results: list[GateResult] = []
    for gate in gates:
        targets = [j for j in job_reports if gate.job is None or j["jobname"] == gate.job]
        if gate.job is not None and not targets:
            results.append(GateResult(gate, gate.job, None, False, f"no job named {gate.job!r}"))
            continue
        judged = 0
        for job in targets:
            value = _lookup(job, gate.path)
            if value is None:
                if gate.job is not None:
                    results.append(GateResult(gate, job["jobname"], None, False,
                                              f"job does not report {'.'.join(gate.path)}"))
                elif _reports_null(job, gate.path):  # reported, but no figure: no gate passes on it
                    judged += 1
                    results.append(GateResult(gate, job["jobname"], None, False,
                                              f"job reports {'.'.join(gate.path)} as null"))
                continue
            judged += 1
            results.append(GateResult(gate, job["jobname"], float(value), gate.check(float(value))))
        if gate.job is None and judged == 0:
            results.append(GateResult(gate, None, None, False, f"no job reports {'.'.join(gate.path)}"))
    return results


def format_table(results: list[GateResult]) -> str:
    """A plain pass/fail table (readable in a log and on a terminal)."""
    rows = [("gate", "job", "measured", "result")]
    for r in results:
        measured = "-" if r.measured is None else f"{r.measured:.6g}"
        verdict = "PASS" if r.passed else "FAIL" + (f" ({r.note})" if r.note else "")
        rows.append((r.gate.text, r.job or "-", measured, verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ------")
    failed = sum(not r.passed for r in results)
    lines.append(f"gates: {len(results) - failed} passed, {failed} failed")
    return "\n".join(lines)
