"""``--plot FILE.png``: bandwidth over time and latency CDF per job and
direction; for ttft jobs, TTFT (and the load alone) by concurrency for each mode.
matplotlib with the Agg backend (no display needed)."""
from __future__ import annotations

import numpy as np

from .options import JobOptions
from .result import JobResult
from .stats import bw_series
from .ttftjob import MODES as TTFT_MODES
from .units import UsageError

PLOT_DPI = 110
CDF_POINTS_MAX = 2000  # a CDF line needs no more points than the plot has pixels


def _cdf(lat_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values = np.sort(lat_ns) / 1e6
    frac = np.arange(1, values.size + 1) / values.size
    if values.size > CDF_POINTS_MAX:
        pick = np.linspace(0, values.size - 1, CDF_POINTS_MAX).astype(int)
        values, frac = values[pick], frac[pick]
    return values, frac


def write_plot(path: str, jobs: list[JobOptions], results: list[JobResult], reports: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft = [(j, r) for j, r in zip(jobs, reports) if "ttft" in r]
    io = any(len(r.read) or len(r.write) or len(r.lookup) for r in results)
    rows = int(io) + int(bool(ttft))
    if rows == 0:
        raise UsageError(f"--plot={path}: the jobs moved no blocks and ran no ttft: nothing to plot")
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.2 * rows), squeeze=False)
    if io:
        _plot_io(axes[0], jobs, results)
    if ttft:
        _plot_ttft(axes[-1], ttft)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=PLOT_DPI)
    except OSError as e:
        raise UsageError(f"--plot={path}: {e.strerror}") from None
    finally:
        plt.close(fig)


def _plot_io(axes, jobs: list[JobOptions], results: list[JobResult]) -> None:
    ax_bw, ax_cdf = axes
    for job, result in zip(jobs, results):
        for direction in ("read", "write", "lookup"):
            ops = getattr(result, direction)
            if not len(ops):
                continue
            if direction != "lookup":  # a lookup moves keys, not blocks: its latency is what matters
                t, bw = bw_series(ops, result.runtime_ns)
                # each sample is the mean over the window that ends at its time
                ax_bw.step(np.concatenate([[0.0], t]), np.concatenate([bw[:1], bw]) / 2**20, where="pre",
                           label=f"{job.name} {direction}")
            x, y = _cdf(ops.lat_ns)
            ax_cdf.plot(x, y, label=f"{job.name} {direction}")
    ax_bw.set(title="bandwidth over time", xlabel="time (s)", ylabel="MiB/s")
    ax_cdf.set(title="latency CDF", xlabel="completion latency (ms)", ylabel="fraction of requests")
    if ax_cdf.lines:
        ax_cdf.set_xscale("log")
    for ax in (ax_bw, ax_cdf):
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")


def _plot_ttft(axes, ttft) -> None:
    ax_t, ax_p = axes
    levels_seen: set[int] = set()
    for job, report in ttft:
        levels = report["ttft"]["by_concurrency"]
        conc = [lv["concurrency"] for lv in levels]
        levels_seen.update(conc)
        for mode in TTFT_MODES:
            style = dict(marker="o", label=f"{job.name} {mode}" + (" alone (no model)" if mode == "load" else ""),
                         linestyle="--" if mode == "load" else "-")
            ax_t.plot(conc, [lv[mode]["ttft_ms_mean"] for lv in levels], **style)
            ax_p.plot(conc, [lv[mode]["prompts_per_s"] for lv in levels], **style)
    ax_t.set(title="TTFT (and the load alone) by concurrency", xlabel="concurrent prompts", ylabel="mean (ms)")
    ax_p.set(title="throughput by concurrency", xlabel="concurrent prompts", ylabel="prompts/s")
    for ax in (ax_t, ax_p):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        if len(levels_seen) > 1 and max(levels_seen) / min(levels_seen) >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels_seen), [str(c) for c in sorted(levels_seen)])
