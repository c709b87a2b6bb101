#!/usr/bin/env bash
# Every benchmark in one go, one after another (they share the machine's cores, so
# never in parallel), each writing JSON under perf/out/; then a copy of the JSON and
# plots into perf/results/DATE/ for perf/RESULTS.md to cite.
#
# usage: perf/run_all.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
quick=()
[[ "${1:-}" == "--quick" ]] && quick=(--quick)
mkdir -p perf/out
step() { echo "[run_all] $(date -u +%H:%M:%S) $*"; "$@"; }
step "$PY" perf/bench_engine.py "${quick[@]}"
step "$PY" perf/bench_tcp.py "${quick[@]}"
step "$PY" perf/plot_tcp.py perf/out/tcp.png perf/out/tcp.json
step "$PY" perf/bench_index.py
step "$PY" perf/bench_codecs.py "${quick[@]}"
step "$PY" perf/codec_quality.py "${quick[@]}"
step "$PY" perf/bench_ttft.py "${quick[@]}"
step "$PY" perf/plot_ttft.py perf/out/ttft.json perf/out/ttft.png
step "$PY" perf/run_comparison.py "${quick[@]}"
dest="perf/results/$(date -u +%F)"
mkdir -p "$dest"
cp perf/out/*.json perf/out/*.png "$dest"/ 2>/dev/null || true
echo "[run_all] $(date -u +%H:%M:%S) done; copies in $dest"
