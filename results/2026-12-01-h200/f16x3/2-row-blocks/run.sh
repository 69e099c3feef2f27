#!/usr/bin/env bash
# The tests on the float16 split form, then every figure of the open issues next to the peers.
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
timeout 130 $py -m pytest -q -rfE tests/test_modules.py tests/test_autograd.py tests/test_conventions.py tests/test_rows.py tests/test_validation.py >"$out/tests_other.log" 2>&1
echo "modules, autograd, conventions, rows, validation: $(tail -1 "$out/tests_other.log")"; grep -E "^FAILED|^ERROR" "$out/tests_other.log" | head
echo "tests done ($SECONDS s)"
b() { local name=$1 t=$2; shift 2; timeout $t $py -m flashopm bench "$@" --out "$out/$name" >"$out/bench_$name.log" 2>&1;
      echo "== $name ($SECONDS s)"; grep -E "H200|^B[0-9]" "$out/bench_$name.log" | tail -${TAILN:-6}; }
b n1536 110 --shapes "1,512,1536,256,32,128" --impls eager,compile,flashopm,flashopm-tf32,flashopm-medium --calls 3 --fp64-max-n 0
TAILN=13 b af 120 --shapes "1,128,256,256,32,128;1,1024,256,64,32,128;1,512,768,256,32,128;1,5120,384,64,32,128" --impls eager,flashopm,flashopm-tf32 --calls 5 --fp64-max-n 256
b bf16 70 --dtype bfloat16 --shapes "1,512,1536,256,32,128" --impls eager,flashopm,compile --calls 3 --fp64-max-n 0
b spec 50 --shapes "2,8,32,64,32,64" --impls eager,flashopm,compile --calls 200
b training 50 --mode training --shapes "2,8,32,64,32,64;1,128,256,256,32,128" --impls eager,flashopm --calls 30
for mod in openfold boltz; do
  b n1536_$mod 60 --module $mod --shapes "1,512,1536,256,32,128" --impls eager,flashopm --calls 3 --fp64-max-n 0
done
for form in f16x3 tf32x3; do
  [ $form = tf32x3 ] && export FLASHOPM_TC_FORM=wgmma_tf32 || unset FLASHOPM_TC_FORM
  timeout 60 $py scripts/ab_time.py $form 1,32,1536,256,32,128 1,128,256,256,32,128 --dtype float32 --precision highest 2>&1 | grep -v Warn | tee -a "$out/ab.log"
done
unset FLASHOPM_TC_FORM
timeout 90 $py scripts/ab_time.py f16x3 1,512,8192,256,32,128 --dtype float32 --precision highest 2>&1 | grep -v Warn | tee -a "$out/ab.log"
timeout 60 $py -c "
import torch, flashopm
from flashopm.testing import Shape, make_problem
s = Shape(1, 512, 8192, 256, 32, 128)
x, m, p = make_problem(Shape(1, 512, 8192, 256, 32, 128), 'masked_positions', seed=3)
xc, mc = x.cuda(), m.cuda(); pc = {k: v.cuda() for k, v in p.items()}
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
out = flashopm.outer_product_mean(xc, mc, pc['ln_weight'], pc['ln_bias'], pc['w_a'], pc['b_a'], pc['w_b'], pc['b_b'], pc['w_out'], pc['b_out'])
torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
print(f'N=8192 float32 highest: finite {bool(out.isfinite().all())}, peak extra {peak/2**30:.2f} GiB = {peak/(out.numel()*4):.3f}x output')
" 2>&1 | grep -v Warn | tee -a "$out/ab.log"
echo "done ($SECONDS s)"
