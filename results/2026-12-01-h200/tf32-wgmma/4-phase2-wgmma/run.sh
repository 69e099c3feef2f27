#!/usr/bin/env bash
# Phase 2 of the float32 kernel on wgmma ("high"): its tests, then the tensor-core issue's benchmarks
# with the peers, on it (or on v0, the previous kernel, where its tests fail), and both side by side.
set -u
out=${1:?}; mkdir -p "$out"
cd "$(dirname "$0")/.."
export MAX_JOBS=16 PYTHONUNBUFFERED=1
py=python3
nvidia-smi > "$out/env.txt" 2>&1
for n in cur v0; do
  rm -rf /tmp/ab-$n; mkdir -p /tmp/ab-$n; cp -r src /tmp/ab-$n/
  [ $n = v0 ] && cp ab/v0/* /tmp/ab-$n/src/flashopm/csrc/
  ( FLASHOPM_CACHE_DIR=/tmp/ab-cache-$n PYTHONPATH=/tmp/ab-$n/src $py -c "import flashopm._build as b; b.load()" > "$out/build_$n.log" 2>&1 ) &
done
wait
echo "built at $SECONDS s"; tail -n1 "$out"/build_*.log
use() { export FLASHOPM_CACHE_DIR=/tmp/ab-cache-$1 PYTHONPATH=/tmp/ab-$1/src; }
use cur
timeout 120 $py -m pytest -q -rfE tests/test_cuda.py > "$out/tests_cuda.log" 2>&1; rc1=$?
echo "test_cuda: $(tail -1 $out/tests_cuda.log)"; grep -E "^FAILED|^ERROR" "$out/tests_cuda.log" | head -8
timeout 100 $py -m pytest -q -rfE tests/test_conventions.py tests/test_modules.py tests/test_rows.py tests/test_autograd.py > "$out/tests_other.log" 2>&1; rc2=$?
echo "other: $(tail -1 $out/tests_other.log)"; grep -E "^FAILED|^ERROR" "$out/tests_other.log" | head -8
v=cur; if [ $rc1 != 0 ] || [ $rc2 != 0 ]; then v=v0; fi
echo "benchmarks on $v ($SECONDS s)"; echo $v > "$out/benchmarked_variant.txt"
use $v
timeout 60 $py -m flashopm bench --shapes "1,512,1536,256,32,128" --impls eager,flashopm,compile,flashopm-tf32,flashopm-medium \
  --calls 3 --fp64-max-n 0 --out "$out/n1536_spec" > "$out/bench_n1536_spec.log" 2>&1; tail -6 "$out/bench_n1536_spec.log" | grep -v wrote
timeout 60 $py -m flashopm bench --shapes "1,128,256,256,32,128;1,1024,256,64,32,128;1,512,768,256,32,128" \
  --impls eager,flashopm,flashopm-tf32 --calls 5 --fp64-max-n 256 --out "$out/af" > "$out/bench_af.log" 2>&1; tail -10 "$out/bench_af.log" | grep -v wrote
timeout 60 $py -m flashopm bench --dtype bfloat16 --shapes "1,512,1536,256,32,128" --impls eager,flashopm,compile --calls 3 \
  --fp64-max-n 0 --out "$out/bf16" > "$out/bench_bf16.log" 2>&1; tail -4 "$out/bench_bf16.log" | grep -v wrote
echo "($SECONDS s)"
for n in cur v0; do
  use $n
  timeout 40 $py scripts/ab_time.py "$n-high" 1,512,1536,256,32,128 1,32,1536,256,32,128 --dtype float32 --precision high 2>&1 | grep -v Warn | tee -a "$out/ab.log"
done
echo "done ($SECONDS s)"
