"""Bandwidth bars from one or more perf/bench_tcp.py runs: kvtier GET and PUT next to the
references measured in the same runs (fio on the same devices, iperf3, redis-py +
redis-server); bar = median over the runs, dots = each run.

    .venv/bin/python perf/plot_tcp.py perf/out/tcp.png perf/out/tcp*.json
"""
from __future__ import annotations

import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GiB = 1 << 30


def figures(run: dict) -> dict[str, dict[str, float]]:
    """{operation: {system: GiB/s}} of one run."""
    k, fio, rd = run["kvtierd"], run["fio"], run["redis"]
    iperf = run["iperf3"]["iperf3_bytes_per_s"]
    return {
        "GET": {"kvtier": max(k["get_bytes_per_s"], k["get_views_bytes_per_s"]) / GiB,
                "fio read": fio["fio_read_bytes_per_s"] / GiB, "iperf3": iperf / GiB,
                "redis-py": rd["redis_get_bytes_per_s"] / GiB},
        "PUT": {"kvtier": k["put_bytes_per_s"] / GiB, "fio write": fio["fio_write_bytes_per_s"] / GiB,
                "iperf3": iperf / GiB, "redis-py": rd["redis_set_bytes_per_s"] / GiB},
    }


def main(dst: str, sources: list[str]) -> None:
    runs = [figures(json.load(open(src))) for src in sources]
    colors = {"kvtier": "#2a7", "fio read": "#888", "fio write": "#888", "iperf3": "#bbb", "redis-py": "#c44"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, op in zip(axes, ("GET", "PUT")):
        systems = list(runs[0][op])
        for i, name in enumerate(systems):
            values = [r[op][name] for r in runs]
            median = statistics.median(values)
            ax.bar(i, median, color=colors[name])
            ax.scatter([i] * len(values), values, s=10, color="k", zorder=3)
            ax.annotate(f"{median:.2f}", (i, median), ha="center", va="bottom", fontsize=9,
                        xytext=(0, 3), textcoords="offset points")
        redis = statistics.median(r[op]["redis-py"] for r in runs)
        ax.axhline(1.5 * redis, color="#c44", linestyle="--", linewidth=1)
        ax.text(len(systems) - 0.5, 1.5 * redis, "1.5x redis", color="#c44", ha="right", va="bottom", fontsize=8)
        ax.set_xticks(range(len(systems)), systems)
        ax.set_title(f"{op}, 2 MiB blocks, 4 connections, loopback")
    axes[0].set_ylabel("GiB/s (median of runs; dots: each run)")
    fig.suptitle(f"kvtierd against same-run references, {len(runs)} run(s)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
