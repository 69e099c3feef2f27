#!/usr/bin/env bash
# The backward's, LayerNorm backward's and distributed tests on the final code (they take ~220 s).
set -u
out=${1:?}; mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/gpu_env.sh "$out" || exit 1
echo "built ($SECONDS s)"
timeout 420 $py -m pytest -q -rfEs tests/test_backward.py tests/test_ln_backward.py tests/test_distributed.py >"$out/tests_slow.log" 2>&1
echo "slow tests: $(tail -1 "$out/tests_slow.log")"; grep -E "^FAILED|^ERROR" "$out/tests_slow.log" | head
echo "done ($SECONDS s)"
