#!/usr/bin/env bash
# "highest" phase 2 on wgmma (cur) against main (base): tests, A/B times, and the issue's shapes
# next to the peers on cur.
set -u
out=${1:?}; mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export MAX_JOBS=16 PYTHONUNBUFFERED=1
py=python3
for n in cur base; do
  rm -rf /tmp/ab-$n; mkdir -p /tmp/ab-$n; cp -r src /tmp/ab-$n/
  [ $n != cur ] && cp ab/$n/* /tmp/ab-$n/src/flashopm/csrc/
  ( FLASHOPM_CACHE_DIR=/tmp/ab-cache-$n PYTHONPATH=/tmp/ab-$n/src $py -c "import flashopm._build as b; b.load()" >"$out/build_$n.log" 2>&1 ) &
done
wait
echo "built ($SECONDS s)"; grep -il "error" "$out"/build_*.log
export FLASHOPM_CACHE_DIR=/tmp/ab-cache-cur PYTHONPATH=/tmp/ab-cur/src
timeout 150 $py -m pytest -q -rfE tests/test_cuda.py >"$out/tests_cuda.log" 2>&1
echo "test_cuda: $(tail -1 "$out/tests_cuda.log")"; grep -E "^FAILED|^ERROR" "$out/tests_cuda.log" | head -20
timeout 130 $py -m pytest -q -rfE tests/test_modules.py tests/test_autograd.py tests/test_conventions.py tests/test_rows.py >"$out/tests_other.log" 2>&1
echo "modules, autograd, conventions, rows: $(tail -1 "$out/tests_other.log")"; grep -E "^FAILED|^ERROR" "$out/tests_other.log" | head
echo "tests done ($SECONDS s)"
for round in 1 2; do
  for n in cur base; do
    FLASHOPM_CACHE_DIR=/tmp/ab-cache-$n PYTHONPATH=/tmp/ab-$n/src timeout 60 $py scripts/ab_time.py $n \
      1,32,1536,256,32,128 1,512,1536,256,32,128 1,512,768,256,32,128 1,128,256,256,32,128 1,1024,256,64,32,128 \
      --dtype float32 --precision highest 2>&1 | grep -v Warn | tee -a "$out/ab.log"
  done
done
echo "ab done ($SECONDS s)"
b() { local name=$1 t=$2; shift 2; timeout $t $py -m flashopm bench "$@" --out "$out/$name" >"$out/bench_$name.log" 2>&1;
      echo "== $name ($SECONDS s)"; grep -E "H200|^B[0-9]" "$out/bench_$name.log" | tail -${TAILN:-6}; }
b n1536 100 --shapes "1,512,1536,256,32,128" --impls eager,compile,flashopm,flashopm-tf32 --calls 3 --fp64-max-n 0
TAILN=10 b af 80 --shapes "1,128,256,256,32,128;1,1024,256,64,32,128;1,512,768,256,32,128" --impls eager,flashopm,flashopm-tf32 --calls 5 --fp64-max-n 256
echo "done ($SECONDS s)"
