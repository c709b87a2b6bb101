#!/usr/bin/env bash
# The engine connector tests against the real frameworks, each in its own venv
# (their pins clash): tests_engines/vllm under .venv-vllm, tests_engines/sglang
# under .venv-sglang. Builds the venvs first when missing (setup_venvs.sh).
#
# usage: tests_engines/run.sh [vllm|sglang ...] [-- extra pytest args]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENVS_DIR="${KVTIER_ENGINE_VENVS:-$ROOT}"

engines=()
while [[ $# -gt 0 && "$1" != "--" ]]; do engines+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
[[ ${#engines[@]} -eq 0 ]] && engines=(vllm sglang)

tests_engines/setup_venvs.sh "${engines[@]}"

status=0
for e in "${engines[@]}"; do
    echo "[run] $e tests under $VENVS_DIR/.venv-$e"
    # -p no:cacheprovider: the venvs share the tree with other test runs
    "$VENVS_DIR/.venv-$e/bin/python" -m pytest "tests_engines/$e" -q -p no:cacheprovider \
        -o "testpaths=tests_engines/$e" --timeout=600 "$@" || status=$?
done
exit $status
