"""fio-like human output, built from the JSON job objects (one source of truth).

::

    seqread: (groupid=0, jobs=4): err= 0: Sun Nov 29 12:00:00 2026
      read: IOPS=1234, BW=2468MiB/s (2588MB/s)(24.1GiB/10001msec)
        clat (usec): min=120, max=9000, avg=800.12, stdev=40.00
         clat percentiles (usec):
         |  1.00th=[  123],  5.00th=[  135], 10.00th=[  140], 20.00th=[  150],
       bw (  KiB/s): min=..., max=..., per=100.00%, avg=..., stdev=..., samples=20
"""
from __future__ import annotations

from .ttftjob import MODES as TTFT_MODES
from .units import format_bytes_iec, format_bytes_si

PERCENTILES_PER_LINE = 4


def _unit(max_ns: float) -> tuple[str, float]:
    """fio's choice of latency unit by magnitude."""
    if max_ns < 10_000:
        return "nsec", 1.0
    if max_ns < 10_000_000:
        return "usec", 1e3
    return "msec", 1e6


def _iops(iops: float) -> str:
    return f"{iops / 1000:.1f}k" if iops >= 10_000 else f"{iops:.0f}"


def direction_lines(label: str, d: dict) -> list[str]:
    if not d["total_ios"]:
        return []
    bw = d["bw_bytes"]
    lines = [f"  {label}: IOPS={_iops(d['iops'])}, BW={format_bytes_iec(bw)}/s ({format_bytes_si(bw)}/s)"
             f"({format_bytes_iec(d['io_bytes'])}/{d['runtime']}msec)"]
    clat = d["clat_ns"]
    unit, scale = _unit(clat["max"])
    lines.append(f"    clat ({unit}): min={clat['min'] / scale:.0f}, max={clat['max'] / scale:.0f}, "
                 f"avg={clat['mean'] / scale:.2f}, stdev={clat['stddev'] / scale:.2f}")
    lines.append(f"    clat percentiles ({unit}):")
    items = list(clat["percentile"].items())
    for i in range(0, len(items), PERCENTILES_PER_LINE):
        cells = [f"{float(k):5.2f}th=[{v / scale:6.0f}]" for k, v in items[i:i + PERCENTILES_PER_LINE]]
        lines.append("     | " + ", ".join(cells) + ("," if i + PERCENTILES_PER_LINE < len(items) else ""))
    lines.append(f"   bw (  KiB/s): min={d['bw_min']}, max={d['bw_max']}, per={d['bw_agg']:.2f}%, "
                 f"avg={d['bw_mean']:.2f}, stdev={d['bw_dev']:.2f}, samples={d['bw_samples']}")
    if d.get("misses"):
        lines.append(f"    misses: {d['misses']} blocks not found")
    return lines


def job_lines(job: dict, rw: str) -> list[str]:
    lines = [f"{job['jobname']}: (groupid={job['groupid']}, jobs={job['clones']}): err={job['error']:2d}: rw={rw}"]
    if job.get("description"):
        lines.append(f"  Description  : [{job['description']}]")
    for label in ("read", "write"):
        lines += direction_lines(label, job[label])
    if "lookup" in job:
        lk = job["lookup"]
        lines += direction_lines("lookup", lk)
        if "keys" in lk:
            lines.append(f"    keys: {lk['keys']} looked up, {lk['found']} found, {lk['keys_per_s']:,.0f} keys/s")
    if "prefix" in job:
        p = job["prefix"]
        lines.append(f"  prefix: requests={p['requests']}, blocks={p['blocks']}, hit ratio={p['hit_ratio']:.3f}, "
                     f"saved={format_bytes_iec(p['bytes_saved'])} ({p['tokens_saved']} tokens not recomputed), "
                     f"{p['requests_per_s']:.1f} prompts/s")
    if "direct" in job:
        lines.append(f"  direct: {job['direct']['blocks']} blocks read from the devices, "
                     f"{job['direct']['fallbacks']} fell back to TCP")
    if "ttft" in job:
        lines += ttft_lines(job["ttft"])
    if job["laid_out_blocks"]:
        lines.append(f"  layout: {job['laid_out_blocks']} missing blocks written before the run")
    if job["verify_errors"] or job["verified_blocks"]:
        lines.append(f"  verify: {job['verify_errors']} errors, {job['verified_blocks']} blocks read back good")
    for msg in job["verify_messages"]:
        lines.append(f"    verify error: {msg}")
    return lines


def ttft_lines(t: dict) -> list[str]:
    lines = [f"  ttft: model={t['model']}, prompt={t['prompt_tokens']} tokens, cached={t['cached_tokens']} tokens"]
    carried = ", ".join(f"{name} {n}" for name, n in sorted(t.get("transports", {}).items())) or "none"
    lines.append(f"    transport: {t.get('transport', '?')}, timed blocks by transport: {carried}")
    for mode in TTFT_MODES:
        s = t[f"{mode}_ms"]
        lines.append(f"    {mode:>9}: mean={s['mean']:.2f} ms, p50={s['percentile']['50.000000']:.2f} ms, "
                     f"p99={s['percentile']['99.000000']:.2f} ms")
    lines.append(f"    reduction vs recompute: {t['reduction'] * 100:.1f}%, "
                 f"overhead vs in-memory: {t['overhead_vs_inmemory'] * 100:+.1f}%")
    lines.append(f"    load alone vs in-memory: {_times(t['load_vs_inmemory'])}, exposed load: "
                 f"{t['exposed_load_ms']:.2f} ms ({_times(t['exposed_vs_load'])} the load alone), "
                 f"kvtier vs max(in-memory, load): {_times(t['kvtier_vs_bound'])}")
    for level in t["by_concurrency"]:
        lines.append(f"    concurrency {level['concurrency']:>3}: " + ", ".join(
            f"{m} {level[m]['ttft_ms_mean']:.1f} ms / {level[m]['prompts_per_s']:.2f} prompts/s"
            for m in TTFT_MODES))
    return lines


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def group_status(jobs: list[dict]) -> list[str]:
    lines = ["", "Run status (all jobs):"]
    for label in ("read", "write"):
        active = [j[label] for j in jobs if j[label]["total_ios"]]
        if not active:
            continue
        io = sum(d["io_bytes"] for d in active)
        run_ms = max(d["runtime"] for d in active)
        bws = [d["bw_bytes"] for d in active]
        total_ms = sum(d["runtime"] for d in active)  # the jobs run one after another, never at once
        agg = io / (total_ms / 1000) if total_ms else 0
        lines.append(f"  {label.upper():>5}: bw={format_bytes_iec(agg)}/s ({format_bytes_si(agg)}/s), "
                     f"{format_bytes_iec(min(bws))}/s-{format_bytes_iec(max(bws))}/s, "
                     f"io={format_bytes_iec(io)} ({format_bytes_si(io)}), "
                     f"run={min(d['runtime'] for d in active)}-{run_ms}msec")
    return lines


def header_lines(jobs_options) -> list[str]:
    lines = []
    for j in jobs_options:
        lines.append(f"{j.name}: (g=0): rw={j.rw}, bs={format_bytes_iec(j.bs)}, iodepth={j.iodepth}, "
                     f"numjobs={j.numjobs}, target={j.target}")
    return lines
