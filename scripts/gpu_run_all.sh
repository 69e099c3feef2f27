#!/usr/bin/env bash
# One GPU run: build, every test (the backward's and the distributed ones last), the sharded
# OPM's scaling over the machine's GPUs (when it has several), the spec shape's paths and host
# overhead, and the benchmarks (forward at the spec shape, float32 under each precision and
# bfloat16 models at the tensor-core issue's shapes, the 16-bit kernel's forms, training steps,
# backward) and the three conventions at N = 1536, the conventions' epilogue cost and the op's
# host time by stage (the op's, the entry against torch.ops, the backward's stages and its two forms,
# a training step's parts);
# logs and results packed into OUTDIR/results.tgz.  Steps past the time budget (BUDGET_S, default
# 540 s from the start) are skipped so that the results are always packed; steps named in SKIP
# (space-separated, e.g. SKIP="tests tests_backward") are skipped too.
#   usage: scripts/gpu_run_all.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/gpu_run_all.sh OUTDIR}
start=$SECONDS budget=${BUDGET_S:-540}
mkdir -p "$out/res"
pack() { tar -C "$out" -czf "$out/results.tgz" res && rm -rf "$out/res"; }
trap pack EXIT
. "$(dirname "$0")/gpu_env.sh" "$out/res" || exit 1
# step NAME CMD...: runs CMD with its output in res/NAME.log, cut off at the budget
step() {
  local name=$1 left=$((budget - (SECONDS - start))); shift
  if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "skipped $name: in SKIP" >>"$out/res/skipped.log"; return; fi
  if ((left < 10)); then echo "skipped $name: out of time" | tee -a "$out/res/skipped.log"; return; fi
  echo "== $name ($((SECONDS - start)) s)"
  timeout "$left" "$@" >"$out/res/$name.log" 2>&1; echo "rc=$?" >>"$out/res/$name.log"
  tail -n "${TAIL:-6}" "$out/res/$name.log"
}
# the forward's tests first; the backward's and the distributed ones (about 220 s) after the benchmarks
slow_tests="tests/test_backward.py tests/test_ln_backward.py tests/test_distributed.py"
TAIL=12 step tests bash -c "$py -m pytest -q -rfEs tests/test_cuda.py; $py -m pytest -q -rfEs tests --ignore tests/test_cuda.py $(printf -- '--ignore %s ' $slow_tests)"
ngpu=$($py -c "import torch; print(torch.cuda.device_count())")
if ((ngpu >= 2)); then
  worlds=$($py -c "print(','.join(str(p) for p in (1, 2, 4, 8) if p <= $ngpu))")
  TAIL=20 step bench_sharded $py -m flashopm bench-sharded --backend nccl --worlds "$worlds" \
    --sizes 4096,8192 --S 512 --calls 3 --out "$out/res/sharded"
fi
step spec_paths $py scripts/spec_paths.py
step bench_spec $py -m flashopm bench --shapes "2,8,32,64,32,64" --impls eager,flashopm,compile --calls 200 \
  --out "$out/res/spec"
# the tensor-core issue's shapes: float32 under each precision, and bfloat16 models
step bench_n1536_spec $py -m flashopm bench --shapes "1,512,1536,256,32,128" \
  --impls eager,flashopm,compile,flashopm-tf32,flashopm-medium --calls 3 --fp64-max-n 0 --out "$out/res/n1536_spec"
step bench_bf16 $py -m flashopm bench --dtype bfloat16 --shapes "2,8,32,64,32,64;1,512,768,256,32,128;1,512,1536,256,32,128" \
  --impls eager,flashopm,compile --calls 3 --fp64-max-n 0 --out "$out/res/bf16"
# the 16-bit kernel's forms side by side (mma.sync, wgmma phase 1, wgmma both phases)
step tc16_forms $py scripts/tc16_forms.py 1,512,1536,256,32,128
step bench_af $py -m flashopm bench --shapes "1,128,256,256,32,128;1,1024,256,64,32,128;1,512,768,256,32,128;1,5120,384,64,32,128" \
  --impls eager,flashopm,flashopm-tf32,flashopm-medium --calls 5 --fp64-max-n 256 --out "$out/res/af"
step bench_training $py -m flashopm bench --mode training --shapes "2,8,32,64,32,64;1,128,256,256,32,128" \
  --impls eager,flashopm --calls 30 --out "$out/res/training"
step bench_backward $py -m flashopm bench --mode backward --shapes "1,128,256,256,32,128" --impls eager,flashopm \
  --calls 30 --out "$out/res/backward"
step kernel_times bash -c "$py scripts/kernel_times.py training float32 2,8,32,64,32,64 1,128,256,256,32,128; $py scripts/kernel_times.py forward bfloat16 1,512,1536,256,32,128"
step backward_times $py scripts/backward_times.py 1,128,256,32,128 1,512,768,32,128 2,8,32,32,64
step convention_times $py scripts/convention_times.py 384 1536 row openfold boltz
step host_breakdown $py scripts/host_breakdown.py
step host_paired $py scripts/host_paired.py
step host_ops $py scripts/host_ops.py training float32 2,8,32,64,32,64
TAIL=30 step backward_stages $py scripts/backward_stages.py
step direct_vs_old $py scripts/direct_vs_old.py
step step_host $py scripts/step_host.py
for mod in openfold boltz; do
  step bench_n1536_$mod $py -m flashopm bench --module $mod --shapes "1,512,1536,256,32,128" --impls eager,flashopm \
    --calls 3 --fp64-max-n 0 --out "$out/res/n1536_$mod"
done
TAIL=12 step tests_backward $py -m pytest -q -rfEs $slow_tests
