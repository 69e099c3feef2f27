#!/usr/bin/env bash
# Sets up and runs every test. The CUDA tests run where a GPU is visible and skip elsewhere; the
# extension is compiled wherever nvcc and a CUDA build of torch are found.
set -euo pipefail
. "$(dirname "$0")/setup.sh"
python -m pytest -q tests "$@"
