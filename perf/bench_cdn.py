"""The LLM CDN (issue 16) end to end: a trace of chat requests over 4 edge kvtierds and one
region, edge hit ratio with and without pre-placement and prompt normalization (4 runs, fresh
stores each), cold fetches, second requests for cold-fetched prefixes served warm, and the
time to load a prefix from each tier across a shaped WAN.

    .venv/bin/python perf/bench_cdn.py                        # 10k requests, the WAN tiers (root for netns)
    .venv/bin/python perf/bench_cdn.py --requests 400 --no-ttft

Progress goes to stderr; the figures to ``--json`` and a plot to ``--plot``; a markdown summary
is printed at the end. Trace: ``perf/cdn_trace.py``; daemons: ``perf/cdn_cluster.py``;
engines: ``perf/cdn_replay.py``; tiers across the WAN: ``perf/cdn_ttft.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cdn_cluster import DEVICE_ARGS, REGION_TOKEN, PreplaceSettings, admin_stats, start_cdn  # noqa: E402
from cdn_replay import LAYOUT, EdgeTally, replay  # noqa: E402
from cdn_trace import TraceConfig, build_trace  # noqa: E402

RUNS = ((False, False), (True, False), (False, True), (True, True))  # (pre-placement, normalization)
RESULTS = Path(__file__).resolve().parent / "results" / "2026-12-01"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def run_once(requests, workdir: Path, edges: int, preplace: PreplaceSettings | None, normalize: bool,
             edge_device_args: tuple[str, ...], label: str, concurrent: bool = True) -> dict:
    cdn = start_cdn(workdir, edges, preplace, edge_device_args)
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        elapsed = time.perf_counter() - started
        log(f"  {label}: {done}/{total} requests, {done / elapsed if elapsed else 0:.0f} req/s, {elapsed:.0f} s")

    try:
        tallies, stats = replay(requests, cdn.edge_addresses, cdn.region.data_addr, REGION_TOKEN, normalize, progress,
                                concurrent=concurrent)
        wall_s = time.perf_counter() - started
        edge_stats = [admin_stats(e) for e in cdn.edges]
        upstream = [s["upstream"] for s in edge_stats]
        evicted = sum(s["engine"]["evicted_blocks"] for s in edge_stats)
        region = admin_stats(cdn.region, REGION_TOKEN)
    finally:
        cdn.stop()
    doc = summarize(tallies, stats, upstream, region.get("preplace"), wall_s, preplace is not None, normalize)
    doc["edge_evicted_blocks"] = evicted
    return doc


def summarize(tallies: list[EdgeTally], stats: list, upstream: list[dict], preplace: dict | None, wall_s: float,
              preplaced: bool, normalized: bool) -> dict:
    total = EdgeTally()
    for t in tallies:
        total.merge(t)
    loads = sorted(total.load_s)
    doc = {
        "preplacement": preplaced, "normalization": normalized, "requests": total.requests,
        "wall_s": round(wall_s, 1), "requests_per_s": round(total.requests / wall_s, 1),
        "blocks_asked": total.blocks_asked, "blocks_shareable": total.blocks_shareable,
        "blocks_edge": total.blocks_edge, "blocks_cold": total.blocks_cold, "blocks_computed": total.blocks_computed,
        "edge_hit_ratio": ratio(total.blocks_edge, total.blocks_asked),
        "edge_hit_ratio_of_shareable": ratio(total.blocks_edge, total.blocks_shareable),
        "any_tier_hit_ratio_of_shareable": ratio(total.blocks_edge + total.blocks_cold, total.blocks_shareable),
        "cold_fetches_kvcache": sum(s.cold.hits for s in stats),  # KVCache.statistics().cold, all edge engines
        "warm_hits_kvcache": sum(s.warm.hits for s in stats),
        "cold_fetches_edges_upstream": sum(u["blocks_fetched"] for u in upstream),  # the edges' own count
        "upstream_requests": sum(u["requests"] for u in upstream),
        "upstream_negative_hits": sum(u["negative_hits"] for u in upstream),
        "upstream_failures": sum(sum(u["failures"].values()) for u in upstream),
        "upstream_store_dropped_blocks": sum(u["store"]["dropped_blocks"] + u["store"]["failed_blocks"]
                                             for u in upstream),
        "second_requests": total.second_requests, "second_requests_warm": total.second_warm,
        "second_warm_fraction": ratio(total.second_warm, total.second_requests),
        "blocks_stored_edge": total.blocks_stored_edge, "blocks_stored_region": total.blocks_stored_region,
        "load_ms_p50": round(1000 * loads[len(loads) // 2], 3) if loads else None,
        "load_ms_p99": round(1000 * loads[min(len(loads) - 1, int(0.99 * len(loads)))], 3) if loads else None,
        "per_edge_requests": [t.requests for t in tallies],
    }
    if preplace is not None:
        edges = preplace["edges"].values()
        doc["preplace"] = {"rounds": preplace["rounds"], "heads_tracked": preplace["heads_tracked"],
                           "preplaced_blocks": sum(e["preplaced_blocks"] for e in edges),
                           "preplaced_bytes": sum(e["preplaced_bytes"] for e in edges),
                           "soft_pinned_bytes_now": sum(e["soft_pinned_bytes"] for e in edges),
                           "push_failures": sum(e["failures"] for e in edges)}
    return doc


def percentile_ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def ttft_summary(ttft: dict) -> dict:
    out = {}
    for tier, samples in ttft["samples_s"].items():
        out[tier] = {"median_ms": percentile_ms(samples, 0.5), "p90_ms": percentile_ms(samples, 0.9),
                     "samples": len(samples)}
    reference = out["region_direct_over_wan"]["median_ms"]
    for tier in out:
        out[tier]["over_region_direct"] = round(out[tier]["median_ms"] / reference, 3)
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_ttft = "ttft" in doc
    fig, axes = plt.subplots(1, 2 if has_ttft else 1, figsize=(12 if has_ttft else 6.5, 4.6), squeeze=False)
    ax = axes[0][0]
    runs = doc["runs"]
    names = [f"{'pre-placed' if r['preplacement'] else 'no pre-place'}\n"
             f"{'normalized' if r['normalization'] else 'raw prompts'}" for r in runs]
    edge = [r["blocks_edge"] / r["blocks_shareable"] for r in runs]
    cold = [r["blocks_cold"] / r["blocks_shareable"] for r in runs]
    ax.bar(names, edge, label="served by the edge (warm)", color="#2b8a3e")
    ax.bar(names, cold, bottom=edge, label="fetched from the region (cold)", color="#4dabf7")
    for i, value in enumerate(edge):
        ax.text(i, value / 2, f"{value:.3f}", ha="center", color="white", fontsize=9)
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("share of shareable prompt blocks")
    ax.set_title(f"{runs[0]['requests']} requests, {len(runs[0]['per_edge_requests'])} edges "
                 f"(4 x {doc['edge_device_size']} devices each) + 1 region", fontsize=10)
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    if has_ttft:
        ax = axes[0][1]
        tiers = [t for t in ("hot", "warm", "cold", "region_direct_over_wan", "recompute") if t in doc["ttft"]["tiers"]]
        medians = [doc["ttft"]["tiers"][t]["median_ms"] for t in tiers]
        bars = ax.bar([t.replace("region_direct_over_wan", "region\ndirect") for t in tiers], medians,
                      color=["#e03131", "#2b8a3e", "#4dabf7", "#868e96", "#f08c00"][:len(tiers)])
        for bar, value in zip(bars, medians):
            ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.1f} ms", ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("median time to load the prefix (ms, log)")
        t = doc["ttft"]
        ax.set_title(f"{t['blocks']} blocks x {t['block_raw_bytes'] // 1024} KiB, WAN 1 Gbit/s + 20 ms", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(doc: dict) -> str:
    lines = ["| pre-placement | normalization | edge hit (of shareable) | edge + cold (of shareable) | edge hit (all blocks) "
             "| cold fetches (KVCache / edges) | 2nd request warm | computed blocks | evicted at edges | req/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in doc["runs"]:
        lines.append(f"| {'on' if r['preplacement'] else 'off'} | {'on' if r['normalization'] else 'off'} "
                     f"| {r['edge_hit_ratio_of_shareable']} | {r['any_tier_hit_ratio_of_shareable']} "
                     f"| {r['edge_hit_ratio']} | {r['cold_fetches_kvcache']} / {r['cold_fetches_edges_upstream']} "
                     f"| {r['second_requests_warm']}/{r['second_requests']} = {r['second_warm_fraction']} "
                     f"| {r['blocks_computed']} | {r.get('edge_evicted_blocks', '-')} | {r['requests_per_s']} |")
    if "ttft" in doc:
        lines += ["", "| tier | median ms | p90 ms | / region direct |", "| --- | --- | --- | --- |"]
        for tier, t in doc["ttft"]["tiers"].items():
            lines.append(f"| {tier} | {t['median_ms']} | {t['p90_ms']} | {t['over_region_direct']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--edges", type=int, default=4)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--edge-device-size", default=DEVICE_ARGS[1], help="each edge's device size (k/m/g)")
    ap.add_argument("--preplace-bytes", default="1m", help="per edge: the most the region keeps soft-pinned there")
    ap.add_argument("--preplace-interval-s", type=float, default=1.0)
    ap.add_argument("--ttft-blocks", type=int, default=64)
    ap.add_argument("--ttft-reps", type=int, default=10)
    ap.add_argument("--no-ttft", action="store_true", help="skip the load times across the WAN")
    ap.add_argument("--no-recompute", action="store_true", help="skip the prefill estimate")
    ap.add_argument("--runs", default="all", help="which of the 4 runs, e.g. 1,3 (1: neither, 2: pre-placement, "
                    "3: normalization, 4: both)")
    ap.add_argument("--json", type=Path, default=RESULTS / "cdn.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "cdn.png")
    args = ap.parse_args(argv)
    trace_cfg = TraceConfig(requests=args.requests, seed=args.seed)
    requests = build_trace(trace_cfg)
    edge_device_args = ("--device-size", args.edge_device_size, *DEVICE_ARGS[2:])
    preplace = PreplaceSettings(bytes_per_edge=args.preplace_bytes, interval_s=args.preplace_interval_s)
    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "load_average_at_start": os.getloadavg(), "trace": asdict(trace_cfg),
                 "block": {"tokens": LAYOUT.block_tokens, "raw_bytes": LAYOUT.block_raw_bytes, "codec": "raw",
                           "layout": asdict(LAYOUT)},
                 "edge_device_size": args.edge_device_size, "preplace": asdict(preplace), "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-cdn-") as tmp:
        chosen = range(1, len(RUNS) + 1) if args.runs == "all" else [int(n) for n in args.runs.split(",")]
        for n, (preplaced, normalized) in enumerate(RUNS, 1):
            if n not in chosen:
                continue
            label = f"run {n}/{len(RUNS)} (pre-placement {'on' if preplaced else 'off'}, " \
                    f"normalization {'on' if normalized else 'off'})"
            log(label)
            result = run_once(requests, Path(tmp) / f"run{n}", args.edges, preplace if preplaced else None,
                              normalized, edge_device_args, label)
            log(f"  {label}: edge hit {result['edge_hit_ratio_of_shareable']} of shareable blocks, "
                f"cold {result['blocks_cold']}, 2nd warm {result['second_warm_fraction']}, {result['wall_s']} s")
            doc["runs"].append(result)
        if not args.no_ttft:
            from cdn_ttft import measure_tiers
            log(f"ttft: {args.ttft_reps} prefixes of {args.ttft_blocks} blocks per tier")
            ttft = measure_tiers(Path(tmp) / "ttft", args.ttft_blocks, args.ttft_reps, not args.no_recompute, log)
            doc["ttft"] = {k: v for k, v in ttft.items() if k != "samples_s"}
            doc["ttft"]["tiers"] = ttft_summary(ttft)
            doc["ttft"]["samples_ms"] = {k: [round(1000 * s, 2) for s in v] for k, v in ttft["samples_s"].items()}
    doc["load_average_at_end"] = os.getloadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, args.plot)
    log(f"wrote {args.json} and {args.plot}")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
