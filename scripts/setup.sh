#!/usr/bin/env bash
# Set up schedspec on a fresh machine: a virtual environment in .venv with the
# project (dev + runner + plots + cli extras) and vLLM 0.33.0 CPU-only for the differential
# tests. Idempotent; about 2-3 minutes the first time.
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
echo "setup.sh: ready: $venv/bin/schedspec" >&2
