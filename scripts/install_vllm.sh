#!/usr/bin/env bash
# Install vLLM 0.33.0, CPU-only and pinned, into an existing virtual environment.
#
#   scripts/install_vllm.sh VENV_DIR
#
# The caller makes the venv (python -m venv VENV_DIR) and installs schedspec itself.
# What this installs, and why:
#   1. torch==2.13.0+cpu          the CPU build; vLLM pins torch==2.14.0 (CUDA), which we ignore
#   2. the pure-Python packages the scheduler import chain needs, every one pinned
#      (scripts/vllm-0.33.0-cpu-requirements.txt)
#   3. vllm==0.33.0 and xgrammar==0.2.8 with --no-deps (their deps pull CUDA and triton; the
#      scheduler's import chain works without them)
# then checks that no CUDA package landed and that vLLM's Scheduler imports.
#
# Idempotent: a second run finds everything satisfied and only re-checks.
# Fails loudly: any step that fails stops the script with a message naming it.
#
# Environment:
#   SCHEDSPEC_TORCH_INDEX  index to fall back on when torch==2.13.0+cpu is not found through
#                          pip's own configuration (default https://download.pytorch.org/whl/cpu)
set -euo pipefail

TORCH_VERSION="2.13.0+cpu"
VLLM_VERSION="0.33.0"
XGRAMMAR_VERSION="0.2.8"

die() {
    echo "install_vllm.sh: error: $*" >&2
    exit 1
}

step() {
    echo "install_vllm.sh: $*" >&2
}

[ $# -eq 1 ] || die "usage: $0 VENV_DIR (an existing venv made with python -m venv)"
venv=$1
py="$venv/bin/python"
[ -x "$py" ] || die "$venv is not a virtual environment: no executable $py"
"$py" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' \
    || die "$py is not inside a virtual environment"
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || die "$py is older than Python 3.11"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
reqs="$here/vllm-${VLLM_VERSION}-cpu-requirements.txt"
[ -r "$reqs" ] || die "missing pinned requirements file $reqs"

pip=("$py" -m pip --disable-pip-version-check)
start=$SECONDS

step "1/4 torch==$TORCH_VERSION (CPU build)"
if ! "${pip[@]}" install -q -c "$reqs" "torch==$TORCH_VERSION"; then
    index=${SCHEDSPEC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    step "torch==$TORCH_VERSION not found through pip's configuration; trying $index"
    "${pip[@]}" install -q -c "$reqs" --extra-index-url "$index" "torch==$TORCH_VERSION" \
        || die "could not install torch==$TORCH_VERSION (set SCHEDSPEC_TORCH_INDEX to an index that has it)"
fi

step "2/4 pinned pure-Python dependencies ($reqs)"
"${pip[@]}" install -q -r "$reqs" || die "could not install the pinned dependencies from $reqs"

step "3/4 vllm==$VLLM_VERSION and xgrammar==$XGRAMMAR_VERSION (--no-deps)"
"${pip[@]}" install -q --no-deps "vllm==$VLLM_VERSION" "xgrammar==$XGRAMMAR_VERSION" \
    || die "could not install vllm==$VLLM_VERSION / xgrammar==$XGRAMMAR_VERSION"

step "4/4 checking the result"
# No CUDA: no nvidia-*, triton or cuda-* distribution, and torch built without CUDA.
cuda_pkgs=$("${pip[@]}" list --format=freeze 2>/dev/null | grep -i -E '^(nvidia-|triton|cuda-|cupy)' || true)
[ -z "$cuda_pkgs" ] || die "CUDA packages are installed in $venv:
$cuda_pkgs"
cache_dir=$(mktemp -d)
trap 'rm -rf "$cache_dir"' EXIT
HF_HUB_OFFLINE=1 VLLM_CACHE_ROOT="$cache_dir" "$py" - "$TORCH_VERSION" "$VLLM_VERSION" <<'EOF' \
    || die "the installed vLLM does not import (see the traceback above)"
import sys

import torch

want_torch, want_vllm = sys.argv[1], sys.argv[2]
if torch.__version__ != want_torch:
    sys.exit(f"torch is {torch.__version__}, expected {want_torch}")
if torch.version.cuda is not None:
    sys.exit(f"torch was built with CUDA {torch.version.cuda}")

import vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

if vllm.__version__ != want_vllm:
    sys.exit(f"vllm is {vllm.__version__}, expected {want_vllm}")
print(f"install_vllm.sh: ok: torch {torch.__version__}, vllm {vllm.__version__}", file=sys.stderr)
EOF
step "done in $((SECONDS - start)) s"
