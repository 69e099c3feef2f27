#!/usr/bin/env bash
# W rounded once on the host side (v1), plus six W stages (cur), against main (old).
set -u
out=${1:?}; mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export MAX_JOBS=16 PYTHONUNBUFFERED=1
py=python3
nvidia-smi > "$out/env.txt" 2>&1
for n in cur v1 old; do
  rm -rf /tmp/ab-$n; mkdir -p /tmp/ab-$n; cp -r src /tmp/ab-$n/
  [ $n != cur ] && cp ab/$n/* /tmp/ab-$n/src/flashopm/csrc/
  ( FLASHOPM_CACHE_DIR=/tmp/ab-cache-$n PYTHONPATH=/tmp/ab-$n/src $py -c "import flashopm._build as b; b.load()" >"$out/build_$n.log" 2>&1 ) &
done
wait
echo "built ($SECONDS s)"; tail -2 "$out"/build_*.log | grep -i error
export FLASHOPM_CACHE_DIR=/tmp/ab-cache-cur PYTHONPATH=/tmp/ab-cur/src
timeout 200 $py -m pytest -q -rfE tests/test_cuda.py >"$out/tests_cuda.log" 2>&1
echo "test_cuda: $(tail -1 "$out/tests_cuda.log")"; grep -E "^FAILED|^ERROR" "$out/tests_cuda.log" | head
timeout 90 $py -m pytest -q -rfE tests/test_modules.py tests/test_autograd.py >"$out/tests_other.log" 2>&1
echo "modules, autograd: $(tail -1 "$out/tests_other.log")"
echo "tests done ($SECONDS s)"
for round in 1 2; do
  for n in cur v1 old; do
    FLASHOPM_CACHE_DIR=/tmp/ab-cache-$n PYTHONPATH=/tmp/ab-$n/src timeout 60 $py scripts/ab_time.py $n \
      1,32,1536,256,32,128 1,512,1536,256,32,128 1,512,768,256,32,128 --dtype float32 --precision high 2>&1 |
      grep -v Warn | tee -a "$out/ab.log"
  done
done
echo "ab done ($SECONDS s)"
timeout 80 $py -m flashopm bench --shapes "1,512,1536,256,32,128" --impls eager,compile,flashopm-tf32,flashopm \
  --calls 3 --fp64-max-n 0 --out "$out/n1536" >"$out/bench_n1536.log" 2>&1
grep -E "H200|B1_S512" "$out/bench_n1536.log" | tail -5
timeout 70 $py -m flashopm bench --dtype bfloat16 --shapes "1,512,1536,256,32,128" --impls eager,flashopm,compile \
  --calls 3 --fp64-max-n 0 --out "$out/bf16" >"$out/bench_bf16.log" 2>&1
grep -E "B1_S512" "$out/bench_bf16.log" | tail -3
echo "done ($SECONDS s)"
