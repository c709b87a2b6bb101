#!/usr/bin/env bash
# Build the two engine test venvs (.venv-vllm, .venv-sglang) from the pinned lists in
# ../shared/engines/ (see that README), then install kvtier into them (editable, no deps)
# with the few packages kvtier's client, its daemon and the tests need.
#
# Idempotent, in two stages, each with a stamp file in the venv:
#   .kvtier-stamp-engine  torch + the pinned list   (minutes; redone when the list changes)
#   .kvtier-stamp-kvtier  kvtier + EXTRA_PKGS        (seconds; redone when pyproject.toml or
#                                                     EXTRA_PKGS change)
#
# usage: tests_engines/setup_venvs.sh [vllm|sglang ...]   (default: both)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENGINES_DIR="${KVTIER_ENGINES_DIR:-$ROOT/../shared/engines}"
origin="$(git -C "$ROOT" config --get remote.origin.url 2>/dev/null || true)"
if [ ! -d "$ENGINES_DIR" ] && [ -n "$origin" ] && [ -d "$origin/../shared/engines" ]; then
    ENGINES_DIR="$origin/../shared/engines"  # a clone elsewhere (mktemp -d) of a checkout next to shared/
fi
PYTHON="${PYTHON:-python3}"
# Where the venvs live: the checkout by default; CI points this at a lasting folder so that
# a fresh clone does not rebuild 8 GB of frameworks every run.
VENVS_DIR="${KVTIER_ENGINE_VENVS:-$ROOT}"
cd "$ROOT"

# Packages kvtier's client, daemon and the tests need that the pinned lists lack.
# Installed with dependency resolution (pip keeps already-satisfied pins).
EXTRA_PKGS=(crc32c ml_dtypes lz4 "pytest>=8" "pytest-timeout>=2.3"
            "uvicorn>=0.29" "prometheus-client>=0.20" "fastapi>=0.110,<0.165")

digest() { sha256sum | cut -c1-16; }

build_one() {
    local name="$1" torch_pkgs list venv want_engine want_kvtier t0=$SECONDS
    case "$name" in
        vllm)   torch_pkgs="torch==2.13.0"; list="$ENGINES_DIR/vllm-0.33-cpu-nodeps.txt" ;;
        sglang) torch_pkgs="torch==2.14.1 torchvision==0.29.1"
                list="$ENGINES_DIR/sglang-0.5.23-cpu-nodeps.txt" ;;
        *) echo "unknown engine venv: $name" >&2; return 2 ;;
    esac
    venv="$VENVS_DIR/.venv-$name"
    want_engine="$( (echo "$torch_pkgs"; cat "$list") | digest)"
    want_kvtier="$( (echo "$ROOT ${EXTRA_PKGS[*]}"; cat "$ROOT/pyproject.toml") | digest)"
    local pip=("$venv/bin/python" -m pip install --quiet)

    if [[ "$(cat "$venv/.kvtier-stamp-engine" 2>/dev/null)" != "$want_engine" ]]; then
        echo "[setup_venvs] $name: building $venv (a few minutes)"
        rm -rf "$venv"
        "$PYTHON" -m venv "$venv"
        # shellcheck disable=SC2086
        "${pip[@]}" $torch_pkgs
        "${pip[@]}" --no-deps -r "$list"
        echo "$want_engine" > "$venv/.kvtier-stamp-engine"
    fi
    if [[ "$(cat "$venv/.kvtier-stamp-kvtier" 2>/dev/null)" != "$want_kvtier" ]]; then
        echo "[setup_venvs] $name: installing kvtier and its test packages"
        "${pip[@]}" "${EXTRA_PKGS[@]}"
        "${pip[@]}" --no-deps -e "$ROOT"
        echo "$want_kvtier" > "$venv/.kvtier-stamp-kvtier"
    fi
    echo "[setup_venvs] $name: ready ($venv, $((SECONDS - t0)) s)"
}

engines=("$@")
[[ ${#engines[@]} -eq 0 ]] && engines=(vllm sglang)
for e in "${engines[@]}"; do build_one "$e"; done
