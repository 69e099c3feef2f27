#!/usr/bin/env bash
# The projection stage on tensor cores: build, the tests that reach it (16-bit x and float32 under
# "high", rows past the tiled kernel's threshold, modules and autograd in half precision), then the
# tensor-core issue's two nearest bars with the peers (bfloat16 and "high" at N = 1536) and where
# the bfloat16 forward's time goes.  About 400 s on one H200.
#   usage: scripts/gpu_projection_mma.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/gpu_projection_mma.sh OUTDIR}
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh" "$out" || exit 1
echo "built ($SECONDS s)"
timeout 120 $py -m pytest -q -rfE tests/test_cuda.py -k "tiled or half or bfloat16 or float16 or precision or tf32" \
  >"$out/tests_cuda.log" 2>&1
echo "test_cuda subset: $(tail -1 "$out/tests_cuda.log")"; grep -E "^FAILED|^ERROR" "$out/tests_cuda.log" | head
timeout 90 $py -m pytest -q -rfE tests/test_modules.py tests/test_autograd.py >"$out/tests_other.log" 2>&1
echo "modules, autograd: $(tail -1 "$out/tests_other.log")"; grep -E "^FAILED|^ERROR" "$out/tests_other.log" | head
timeout 60 $py -m flashopm bench --dtype bfloat16 --shapes "1,512,1536,256,32,128" --impls eager,flashopm,compile \
  --calls 3 --fp64-max-n 0 --out "$out/bf16" >"$out/bench_bf16.log" 2>&1
grep -E "H200|B1_S512" "$out/bench_bf16.log" | tail -4
timeout 60 $py -m flashopm bench --shapes "1,512,1536,256,32,128" --impls eager,compile,flashopm-tf32,flashopm \
  --calls 3 --fp64-max-n 0 --out "$out/n1536" >"$out/bench_n1536.log" 2>&1
grep -E "B1_S512" "$out/bench_n1536.log" | tail -4
timeout 60 $py scripts/kernel_times.py forward bfloat16 1,512,1536,256,32,128 >"$out/kernel_times.log" 2>&1
grep -E "flashopm|project|tc16" "$out/kernel_times.log" | head -6
echo "done ($SECONDS s)"
