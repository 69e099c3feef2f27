#!/usr/bin/env bash
# The main job: ModelNew against the reference (KernelBench protocol) and its speed next to eager
# PyTorch on a GPU; on a machine without a GPU, the CPU path.
set -euo pipefail
. "$(dirname "$0")/setup.sh"
python -m flashopm check "$@"
