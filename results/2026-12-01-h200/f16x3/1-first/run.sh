#!/usr/bin/env bash
# "highest" in the float16 split form (default) against the 3xTF32 wgmma form
# (FLASHOPM_TC_FORM=wgmma_tf32) on one build; the tests; then the issue figures next to the peers.
set -u
out=${1:?}; mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export MAX_JOBS=16 PYTHONUNBUFFERED=1 FLASHOPM_CACHE_DIR=/tmp/fcache PYTHONPATH=$PWD/src
py=python3
{ nvidia-smi; } > "$out/env.txt" 2>&1
$py -c "import flashopm._build as b; b.load()" >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "built ($SECONDS s)"
$py -m flashopm info >> "$out/env.txt" 2>&1
timeout 200 $py -m pytest -q -rfE tests/test_cuda.py >"$out/tests_cuda.log" 2>&1
echo "test_cuda: $(tail -1 "$out/tests_cuda.log")"; grep -E "^FAILED|^ERROR|Error" "$out/tests_cuda.log" | head -30
timeout 130 $py -m pytest -q -rfE tests/test_modules.py tests/test_autograd.py tests/test_conventions.py tests/test_rows.py >"$out/tests_other.log" 2>&1
echo "modules, autograd, conventions, rows: $(tail -1 "$out/tests_other.log")"; grep -E "^FAILED|^ERROR" "$out/tests_other.log" | head
echo "tests done ($SECONDS s)"
for round in 1 2; do
  for form in f16x3 tf32x3; do
    [ $form = tf32x3 ] && export FLASHOPM_TC_FORM=wgmma_tf32 || unset FLASHOPM_TC_FORM
    timeout 60 $py scripts/ab_time.py $form 1,512,1536,256,32,128 1,512,768,256,32,128 1,128,256,256,32,128 \
      1,1024,256,64,32,128 1,32,1536,256,32,128 --dtype float32 --precision highest 2>&1 | grep -v Warn | tee -a "$out/ab.log"
  done
done
unset FLASHOPM_TC_FORM
echo "ab done ($SECONDS s)"
b() { local name=$1 t=$2; shift 2; timeout $t $py -m flashopm bench "$@" --out "$out/$name" >"$out/bench_$name.log" 2>&1;
      echo "== $name ($SECONDS s)"; grep -E "H200|^B[0-9]" "$out/bench_$name.log" | tail -${TAILN:-6}; }
b n1536 100 --shapes "1,512,1536,256,32,128" --impls eager,compile,flashopm,flashopm-tf32 --calls 3 --fp64-max-n 0
TAILN=10 b af 80 --shapes "1,128,256,256,32,128;1,1024,256,64,32,128;1,512,768,256,32,128" --impls eager,flashopm,flashopm-tf32 --calls 5 --fp64-max-n 256
b training 50 --mode training --shapes "2,8,32,64,32,64;1,128,256,256,32,128" --impls eager,flashopm --calls 30
echo "done ($SECONDS s)"
