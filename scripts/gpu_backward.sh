#!/usr/bin/env bash
# The backward on one GPU: build, its tests and the autograd tests, then training-step and
# backward timings next to eager PyTorch at the spec shape and a training crop, training steps past
# S = 256 (ATen blocks), of bfloat16 models and under "high", and where a training step's GPU time
# goes (kernel tables).
#   usage: scripts/gpu_backward.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/gpu_backward.sh OUTDIR}
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh" "$out" || exit 1
$py -m pytest -q -rfEs tests/test_backward.py tests/test_ln_backward.py tests/test_autograd.py 2>&1 | tee "$out/tests.log" | tail -15
$py scripts/backward_times.py 1,128,256,32,128 1,512,768,32,128 2,8,32,32,64 2>&1 | tee "$out/backward_times.log"
$py -m flashopm bench --mode training --shapes "2,8,32,64,32,64;1,128,256,256,32,128" --impls eager,flashopm \
  --calls 30 --out "$out/training" 2>&1 | tail -8
$py -m flashopm bench --mode backward --shapes "2,8,32,64,32,64;1,128,256,256,32,128" --impls eager,flashopm \
  --calls 30 --out "$out/backward" 2>&1 | tail -8
$py scripts/kernel_times.py training float32 2,8,32,64,32,64 1,128,256,256,32,128 2>&1 | tee "$out/kernel_times.log"
$py -m flashopm bench --mode training --shapes "1,512,768,256,32,128" --impls eager,flashopm \
  --calls 5 --out "$out/training_s512" 2>&1 | tail -4
$py -m flashopm bench --mode training --dtype bfloat16 --shapes "1,128,256,256,32,128;1,512,768,256,32,128" \
  --impls eager,flashopm --calls 10 --out "$out/training_bf16" 2>&1 | tail -5
$py -m flashopm bench --mode training --shapes "1,128,256,256,32,128;1,512,768,256,32,128" \
  --impls eager-tf32,flashopm-tf32 --calls 10 --out "$out/training_tf32" 2>&1 | tail -5
$py scripts/kernel_times.py training bfloat16 1,128,256,256,32,128 1,512,768,256,32,128 2>&1 |
  tee "$out/kernel_times_bf16.log"
