#!/usr/bin/env bash
# Creates .venv with torch (a CUDA build), ninja and pytest, and installs flashopm into it.
# Sourced by run.sh and test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$root/.venv/bin/python" ]; then
  python3 -m venv "$root/.venv"
fi
# shellcheck disable=SC1091
. "$root/.venv/bin/activate"
python -c "import torch" 2>/dev/null || pip install -q "torch==2.14.1"
pip install -q ninja pytest numpy
pip install -q --no-deps --no-build-isolation -e "$root"
# The CUDA toolkit: the standard folder unless CUDA_HOME says otherwise.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
# Without a GPU the extension can still be compiled, for Hopper by default.
if ! nvidia-smi >/dev/null 2>&1; then export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"; fi
