#!/usr/bin/env bash
# Builds the extension, runs every test (CUDA ones included), the KernelBench-style check and the
# benchmark on a GPU machine, in one go.  Logs and results go to the folder given.
#   usage: scripts/gpu_check.sh OUTDIR [extra args for `flashopm bench`]
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [bench args]}
shift
mkdir -p "$out"
status=0
. "$(dirname "$0")/gpu_env.sh" "$out" || status=1
tail -n 3 "$out/build.log"
if [ $status -eq 0 ]; then
  # the GPU tests first, then the rest: a crash in one run leaves the other's report intact
  { $py -m pytest -q -rfEs tests/test_cuda.py; $py -m pytest -q -rfEs tests --ignore tests/test_cuda.py; } 2>&1 \
    | tee "$out/tests.log" | grep -E "passed|failed|FAILED|Error|error" | tail -n 30 || status=1
  $py -m flashopm check 2>&1 | tee "$out/check.log" | tail -n 4 || status=1
  $py -m flashopm bench --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -n 20 || status=1
fi
exit $status
