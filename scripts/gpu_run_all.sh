#!/usr/bin/env bash
# One GPU run: build, every test, the spec shape's paths and host overhead, and the benchmarks
# (forward at the spec shape, training steps, N = 8192), the sharded contraction's scaling and the
# conventions' times; logs and results packed into OUTDIR/results.tgz.
#   usage: scripts/gpu_run_all.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/gpu_run_all.sh OUTDIR}
mkdir -p "$out/res"
. "$(dirname "$0")/gpu_env.sh" "$out/res" || exit 1
{ $py -m pytest -q -rfEs tests/test_cuda.py; $py -m pytest -q -rfEs tests --ignore tests/test_cuda.py; } \
  >"$out/res/tests.log" 2>&1
grep -E "passed|failed|FAILED" "$out/res/tests.log" | tail -n 20
$py scripts/spec_paths.py >"$out/res/spec_paths.log" 2>&1; cat "$out/res/spec_paths.log"
$py -m flashopm bench --shapes "2,8,32,64,32,64" --impls eager,flashopm,compile --calls 200 \
  --out "$out/res/spec" >"$out/res/bench_spec.log" 2>&1; tail -n 5 "$out/res/bench_spec.log"
$py -m flashopm bench --mode training --shapes "2,8,32,64,32,64;1,128,256,256,32,128" --impls eager,flashopm \
  --calls 30 --out "$out/res/training" >"$out/res/bench_training.log" 2>&1; tail -n 5 "$out/res/bench_training.log"
$py -m flashopm bench --mode backward --shapes "1,128,256,256,32,128" --impls eager,flashopm \
  --calls 30 --out "$out/res/backward" >"$out/res/bench_backward.log" 2>&1; tail -n 3 "$out/res/bench_backward.log"
$py -m flashopm bench --shapes "1,512,8192,256,32,128" --impls eager,flashopm --calls 2 --fp64-max-n 0 \
  --out "$out/res/n8192" >"$out/res/bench_n8192.log" 2>&1; tail -n 4 "$out/res/bench_n8192.log"
$py scripts/rows_scaling.py >"$out/res/rows_scaling.log" 2>&1; cat "$out/res/rows_scaling.log"
$py scripts/convention_times.py row openfold boltz >"$out/res/convention_times.log" 2>&1
cat "$out/res/convention_times.log"
tar -C "$out" -czf "$out/results.tgz" res && rm -rf "$out/res"
