"""TTFT bars from perf/bench_ttft.py's JSON: full prefill, the in-memory ideal and
kvtier (TCP, direct, hot), medians with every sample as a dot.

    .venv/bin/python perf/plot_ttft.py perf/out/ttft.json perf/out/ttft.png
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"full": "full prefill", "ideal": "prefix in memory\n(ideal)", "kvtier_tcp": "kvtier TCP",
          "kvtier_direct": "kvtier direct", "kvtier_hot": "kvtier hot pool"}


def main(src: str, dst: str) -> None:
    doc = json.load(open(src))
    modes = [m for m in LABELS if m in doc["ttft_s_median"]]
    medians_ms = [doc["ttft_s_median"][m] * 1e3 for m in modes]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.bar(range(len(modes)), medians_ms, color=["#888"] * 2 + ["#2a7"] * (len(modes) - 2))
    for i, m in enumerate(modes):
        samples = [s * 1e3 for s in doc["ttft_s_samples"][m]]
        ax.scatter([i] * len(samples), samples, s=8, color="k", zorder=3)
    for bar, value, m in zip(bars, medians_ms, modes):
        top = max(doc["ttft_s_samples"][m]) * 1e3
        ax.annotate(f"{value:.0f} ms", (bar.get_x() + bar.get_width() / 2, top), ha="center", va="bottom",
                    xytext=(0, 4), textcoords="offset points")
    ax.set_xticks(range(len(modes)), [LABELS[m] for m in modes])
    ax.set_ylabel("time to first token (ms)")
    model = doc["model"]
    ax.set_title(f"TTFT, {doc['prompt_tokens']}-token prompts with {doc['stored_tokens']} stored; "
                 f"Llama {model['layers']}L x {model['hidden']} ({model['dtype']}, CPU)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
