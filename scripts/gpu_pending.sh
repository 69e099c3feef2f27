# What has been built but not yet run on a GPU (NOTES.md, "Next GPU run", steps 0o and 0n), as
# one device call each, logs under OUTDIR/r (also packed into OUTDIR/r.tgz after every step, so
# that a call cut short still returns what it did).
#   usage: bash scripts/gpu_pending.sh OUTDIR default   # the default build: 0o's tests and 0n's (1)
#          bash scripts/gpu_pending.sh OUTDIR ab        # 0n's (2)-(4): the on-request settings timed
#          bash scripts/gpu_pending.sh OUTDIR sm80      # a build of sm_80 PTX only: an A100's code
#          bash scripts/gpu_pending.sh OUTDIR all       # the other test files on the default build
#          bash scripts/gpu_pending.sh OUTDIR rest      # the files of 'all' after test_cuda, and the
#                                                       # outer kernel's time against S (deep MSAs)
#          bash scripts/gpu_pending.sh OUTDIR fused     # FLASHOPM_FUSED_PROJECTION=1: tests, times
#          bash scripts/gpu_pending.sh OUTDIR fused_peers  # the same beside the default and eager
#          bash scripts/gpu_pending.sh OUTDIR waves  # the waves form: tests, times beside the default and eager
#          bash scripts/gpu_pending.sh OUTDIR waves_rest  # the test files of the kernels it touched
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR waves_short  # both in one short call
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR waves_tc  # the waves form's tests, bench and steps
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR waves_min  # its tests and bench alone (~3 min)
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR bars  # every figure of issues 4 and 6 in one call
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR checks  # the forward test files on this code
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR trace  # where the waves form's time goes
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR final  # bars, then the forward test files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR modules_all  # every figure of issue 6 per convention
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR own_rows  # (branch waves-own-rows) its tests and times,
#                                                       # the conventions' bfloat16 kernels
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR bf16  # the streamed projection and the pair counts:
#                                                       # tests, paired, by kernel, the bfloat16 rows
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR clusters  # the 16-bit kernel in clusters of two and
#                                                       # four (FLASHOPM_TC16_CLUSTER): tests, paired, L2
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR bf16_clusters  # both of the above in one call:
#                                                       # tests, paired, the bfloat16 rows in clusters
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR waves_final  # the rows the waves form and the pair
#                                                       # counts take part in, and their tests
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR producer  # the 16-bit kernel's tensor-copy forms
#                                                       # with a producer warp: tests, paired, rows
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR regs  # the tensor-copy forms with setmaxnreg:
#                                                       # tests, clusters of 1 and 2 paired, Nsight
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR proj  # the waves form's projection and barriers:
#                                                       # tests, trace, the bounded rows
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR pairs  # the pair counts on tensor cores: tests,
#                                                       # the kernel's time against the FMA form
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR proj16  # the register-resident projection for
#                                                       # 16-bit x: tests, its time against the old
#                                                       # forms', the bfloat16 rows
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR stack  # the three above in one call: tests, each
#                                                       # kernel against its old form, the rows
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR trace16  # where the 16-bit contraction's tile
#                                                       # time goes, per form (clock traces)
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR defer  # the tensor-copy forms storing a tile's
#                                                       # last round beside the next tile's MMAs:
#                                                       # tests, traces, paired, the bfloat16 rows
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR ksplit  # W's first chunks issued in phase 1, the
#                                                       # epilogue's bias loaded early, phase 2 split over
#                                                       # k (FLASHOPM_TC16_KSPLIT, since removed): tests,
#                                                       # traces, paired, the bfloat16 rows, test files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR final16  # clusters of two the default: the 16-bit
#                                                       # kernel's tests, traces, its forms paired, issue
#                                                       # 6's bfloat16 rows, the forward test files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR final17  # the autograd tests, clusters of four
#                                                       # against two, the other test files, Nsight
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR rest17  # the other GPU test files, one step each
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR stm17  # NOTES 0zc (3): O by stmatrix, tests,
#                                                       # traces, paired, OpenFold's row
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR wtrace17  # the wide forms traced; a lone
#                                                       # call's host time and runtime calls
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR wide18  # NOTES 0zd: every GPU test file on
#                                                       # the wide default, traced, paired, a row
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR rest18  # the other GPU test files, one step each
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR rate20  # the MMAs' rate by width; the forward
#                                                       # files, traces with W's waits, a pair, a row
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR n96  # the wide phase 2 as one m64n96k16: tests,
#                                                       # traces, a pair, three rows, forward files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR ls22  # the tile loop's counters in shared
#                                                       # memory: tests, traces, rows, files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR sw21  # the wide forms' stores by the producer
#                                                       # warpgroup: tests, a pair, traces, rows, files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR nc23  # the wide form under Nsight Compute with
#                                                       # its SASS lines' stalls; a lone call's timeline
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR pw24  # the tensor-copy forms' leaner producer:
#                                                       # tests, traces, rows, files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR pc25  # the producer's b in one copy a stage and
#                                                       # its parity without a product: tests,
#                                                       # traces, a pair, rows, files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR wt26  # W's chunks 2-3 by the third consumer
#                                                       # warpgroup, over pc25's producer: tests,
#                                                       # traces, pairs, rows, files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR nd27  # test_distributed, then Nsight of the
#                                                       # default form
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR os28  # the wide O stores alone compiled:
#                                                       # tests, trace, OpenFold's row, files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR nd29  # test_distributed, the trace, OpenFold's
#                                                       # row, Nsight of the default form
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR bl30  # the wide round's bias loaded late:
#                                                       # tests, trace, OpenFold's row, files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR sc31  # the MMAs' rate under bulk copies
#                                                       # (before the build), then as nd29
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR sr32  # the copies' program, then the rows
#                                                       # staged by the store warps: tests, trace,
#                                                       # OpenFold's row, files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR pu33  # phase 2's chunks unrolled: tests,
#                                                       # trace, OpenFold's row, files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR h34   # main's bfloat16 rows, the trace,
#                                                       # the files pu33's call left out
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR r38   # main's rows first, trace, every file
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR i6    # issue 6's figures (modules_all and the
#                                                       # spec's bfloat16 row), then the test files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR i5    # issue 5's figures (training steps beside
#                                                       # eager and torch.compile, the forward's host
#                                                       # time, the spec's wall), then the autograd
#                                                       # test files and the others
#          REQUIRE_GPU=H200 DEST=$OUT bash scripts/gpu_pending.sh OUTDIR h5  # issue 6's bfloat16
#                                                       # rows and i5's figures, then the files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR wl40  # the rows first, then W's copies
#                                                       # per block (W_LOCAL): bits, trace, pair,
#                                                       # every file
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR wl41  # wl40 for a card other than
#                                                       # issue 6's: W_LOCAL's bits, trace and pair
#                                                       # first, then OpenFold's row and the files
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR h37   # td35, rows first, main's kernels
#                                                       # (alt/src) for the rows if the bits fail
#          DEST=$OUT bash scripts/gpu_pending.sh OUTDIR td35  # W's parity and the tile's
#                                                       # coordinates without reloads or divisions:
#                                                       # tests, trace, rows, every file
# (DEST: a folder that r.tgz is also copied to after every step; REQUIRE_GPU=H200: nothing runs on
# another card)
# Each phase fits one call of under ten minutes, the build (~2 min) included.
# steps.txt lists each step's exit status; a failing test step stops the call.
OUT=$1
PHASE=${2:-default}
PHASES="default ab sm80 all rest fused fused_peers waves waves_rest waves_short waves_tc waves_min bars checks trace final waves_final proj modules_all own_rows bf16 clusters bf16_clusters ncu_clusters land producer regs pairs proj16 stack stack_rows trace16 defer ksplit final16 final17 rest17 stm17 wtrace17 wide18 rest18 rate20 n96 sw21 ls22 nc23 pw24 pc25 wt26 nd27 os28 nd29 bl30 sc31 sr32 pu33 h34 td35 q36 h37 r38 i6 crop20 wl40 wl41 i5 h5"
case " $PHASES " in *" $PHASE "*) ;; *) echo "phase must be one of: $PHASES; got '$PHASE'" >&2; exit 2 ;; esac
R=$OUT/r
mkdir -p "$R"
# REQUIRE_GPU=NAME: run nothing unless the GPU's name holds NAME (figures that must come from one
# kind of card, e.g. H200)
if [ -n "$REQUIRE_GPU" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "$REQUIRE_GPU"; then
  echo "not a $REQUIRE_GPU ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)): nothing run" | tee "$R/steps.txt"
  exit 0
fi
pack() { tar -C "$OUT" -czf "$OUT/r.tgz" r; [ -n "$DEST" ] && cp "$OUT/r.tgz" "$DEST/"; }
export FLASHOPM_SPLIT_COMPILE=1
if [ "$PHASE" = sm80 ]; then
  # the driver compiles the PTX at first use; its cache must hold every kernel between processes
  export FLASHOPM_CUDA_ARCH_LIST="8.0+PTX" CUDA_CACHE_MAXSIZE=4294967296
fi
if [ "$PHASE" = sc31 ] || [ "$PHASE" = sr32 ]; then
  # before the build (a program of its own, ~30 s): the MMAs' rate under bulk copies into shared
  # memory at several rates (scripts/smem_contention.cu)
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  (time bash -c "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
    -I src/flashopm/csrc -o /tmp/smem_contention scripts/smem_contention.cu && /tmp/smem_contention") \
    >"$R/smem_contention.log" 2>&1
  echo "smem_contention rc=$?" >>"$R/steps.txt"
  pack
fi
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "$R" || { pack; exit 1; }
export PYTHONPATH="$PYTHONPATH:$PWD/scripts"
T() {
  local n=$1 t=$2
  shift 2
  (time timeout "$t" "$@") >"$R/$n.log" 2>&1
  local rc=$?
  echo "$n rc=$rc" >>"$R/steps.txt"
  pack
  return $rc
}
device_code="import flashopm, torch; flashopm.load(); print(torch.ops.flashopm._device_code(torch.empty(0, device='cuda')))"

# The bench CLI's rows of issues 4 and 6, each beside its peers in one process.  The deep MSAs take
# 20 calls: their bounded wall spread 2.2-2.9 ms over 5 calls (run 313).
bench_deep() {
  T bench_deep 120 $py -m flashopm bench --shapes "1,1024,256,64,32,128;1,5120,384,64,32,128" \
    --impls eager,flashopm,compile,flashopm-bounded --calls 20 --out "$R/bench_deep"
}
bench_f32() {
  T bench_f32 200 $py -m flashopm bench --shapes "1,128,256,256,32,128;1,512,768,256,32,128;1,512,1536,256,32,128" \
    --impls eager,flashopm,compile,flashopm-bounded,flashopm-tf32,flashopm-tf32-bounded --calls 5 --out "$R/bench_f32"
}
bench_bf16() {
  T bench_bf16 90 $py -m flashopm bench --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
    --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/bench_bf16"
}
# The 16-bit forms' bits (test_cuda.py's wide, cluster and default forms), stopping at the first
# failure; step NAME (t_wide by default).
wide_bits() {
  T "${1:-t_wide}" 150 $py -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "wide_form or cluster_form or default_form"
}
# VAR=VALUE paired against the default at the bfloat16 row of (1,512,1536,256,32,128) (step ab_NAME).
ab_pair() {
  T "ab_$1" 60 $py scripts/ab_env.py "$2" 1,512,1536,256,32,128 --dtype bfloat16 --mode forward --calls 6
}
# VAR=1 paired against the default at the bfloat16 row (step ab_NAME), and kept on for the steps
# after where it is faster.
pair_and_keep() {
  local var=$1 name=$2 r
  ab_pair "$name" "$var=1"
  r=$(grep -o "paired (without / with) [0-9.]*" "$R/ab_$name.log" | awk '{print $NF}' | head -1)
  if [ -n "$r" ] && awk "BEGIN { exit !($r > 1.0) }"; then export "$var=1"; fi
  echo "from here $var=${!var:-0} (paired $r)" >>"$R/steps.txt"
}
# The bfloat16 module rows of issue 6 (OpenFold's, then Boltz's), each beside its peers.
mod_row() {
  T mod_$1_bf16 120 $py -m flashopm bench --module $1 --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_$1_bf16"
}
# The forward test files first, then Boltz's and the spec's rows and every other test file (after
# OpenFold's row and the traces of the phases below).
forward_files() {
  T t_cuda 150 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
  T t_conv 150 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py tests/test_projection16.py
}
rows_and_files() {
  mod_row boltz
  bench_bf16
  for f in waves peak_plan autograd; do
    T t_$f 120 $py -m pytest -q -p no:cacheprovider tests/test_$f.py
  done
  rest_files
}
# The tensor-copy forms given (FLASHOPM_TC16_CLUSTER sizes), each paired against the default form at
# (1,512,1536,256,32,128) in bfloat16; CL: the fastest (0 where none is faster; CLUSTER overrides).
pair_clusters() {
  local best=0 best_r=1.0 cl r
  for cl in "$@"; do
    ab_pair "cluster$cl" "FLASHOPM_TC16_CLUSTER=$cl"
    r=$(grep -o "paired (without / with) [0-9.]*" "$R/ab_cluster$cl.log" | awk '{print $NF}' | head -1)
    [ -n "$r" ] && awk "BEGIN { exit !($r > $best_r) }" && best=$cl best_r=$r
  done
  CL=${CLUSTER:-$best}
  echo "form for the rows: FLASHOPM_TC16_CLUSTER=$CL (paired $best_r)" >>"$R/steps.txt"
}
# A script of two bfloat16 calls at (1,512,1536,256,32,128), for Nsight Compute's second launch.
tc16_one() {
  cat > "$R/tc16_one.py" <<'PY'
import torch, flashopm
from flashopm.testing import PARAM_ORDER, Shape, make_problem
x, m, p = make_problem(Shape(1, 512, 1536, 256, 32, 128), "masked_positions", seed=1)
x, m = x.cuda().bfloat16(), m.cuda().bfloat16()
p = {k: None if v is None else v.cuda().bfloat16() for k, v in p.items()}
for _ in range(2):
    flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer")
torch.cuda.synchronize()
PY
}
# The 16-bit contraction's second launch in tc16_one.py under Nsight Compute, once per cluster size
# given (0: the form without tensor copies): throughput, L2 and shared-memory traffic, stalls, launch
# and occupancy.
ncu_tc16() {
  tc16_one
  for cl in "$@"; do
    T "ncu_cluster$cl" 150 env FLASHOPM_TC16_CLUSTER=$cl \
      ncu --clock-control none -k regex:opm_outer_tc16 --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section Occupancy $py "$R/tc16_one.py"
  done
}
# A module's rows beside eager and under the memory bound, in one step (results under its name):
#   module_rows MODULE STEP SHAPES CALLS [TIMEOUT_S]
module_rows() {
  T "$2" "${5:-60}" $py -m flashopm bench --module "$1" --shapes "$3" \
    --impls eager,flashopm,flashopm-bounded --calls "$4" --out "$R/$2"
}
# the modules' deep MSA over 20 calls too (its bounded wall is the closest to its bar)
bench_modules() {
  for mod in openfold boltz; do
    module_rows $mod "bench_$mod" "1,128,256,256,32,128;1,512,1536,256,32,128" 5
    module_rows $mod "bench_${mod}_deep" "1,1024,256,64,32,128" 20
  done
}
# The forward-side test files past test_waves.py that the waves form, the bound's kernels and the
# shared epilogue touch, each run whatever the one before gave (a record of every file, not a gate).
other_forward_tests() {
  T t_fused 60 $py -m pytest -q -p no:cacheprovider tests/test_fused_projection.py
  T t_cuda 150 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
  T t_conv 150 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py
  T t_auto 120 $py -m pytest -q -p no:cacheprovider tests/test_autograd.py
}
bench_8192() {
  T bench_8192 90 $py -m flashopm bench --shapes "1,512,8192,256,32,128" --impls flashopm-bounded --calls 2 \
    --fp64-max-n 0 --out "$R/bench_8192"
}

if [ "$PHASE" = sm80 ]; then
  T code80 300 $py -c "$device_code" || exit 1
  T t80 500 $py -m pytest -x -q tests/test_build.py -k "kernels_use" tests/test_smaller_gpus.py tests/test_conventions.py
  exit 0
fi

if [ "$PHASE" = all ]; then
  # the backward groups, the smaller GPUs' and the swap's files ran in the other phases
  T t_all 400 $py -m pytest -q -p no:cacheprovider tests/ --ignore=tests/test_autograd.py \
    --ignore=tests/test_backward.py --ignore=tests/test_ln_backward.py --ignore=tests/test_smaller_gpus.py \
    --ignore=tests/test_replace.py
  exit 0
fi

if [ "$PHASE" = fused ]; then
  # a and b formed inside the contraction (sketch "a and b projected inside the contraction"):
  # tests, the kernels' times with each step of a stage left out in turn, the bench CLI
  DEEP=1,1024,256,64,32,128
  FLASHOPM_FUSED_PROJECTION=1 T kt_fused 45 $py scripts/kernel_times.py forward float32 $DEEP
  T t_fused 150 $py -m pytest -x -q -p no:cacheprovider tests/test_fused_projection.py || exit 1
  for skip in 1 4 8; do
    FLASHOPM_FUSED_PROJECTION=1 FLASHOPM_FUSED_SKIP=$skip T kt_skip$skip 30 $py scripts/kernel_times.py forward float32 $DEEP
  done
  FLASHOPM_FUSED_PROJECTION=1 T bench_fused 60 $py -m flashopm bench --shapes "$DEEP" \
    --impls eager,flashopm --calls 10 --out "$R/bench_fused"
  exit 0
fi

if [ "$PHASE" = fused_peers ]; then
  # the fused projection's tests, then both deep MSAs timed beside the default (in alternation)
  # and eager (bench CLI), then the default path's test file on this build
  T t_fused 150 $py -m pytest -x -q -p no:cacheprovider tests/test_fused_projection.py || exit 1
  DEEP="1,1024,256,64,32,128 1,5120,384,64,32,128"
  T ab_fused 80 $py scripts/ab_env.py FLASHOPM_FUSED_PROJECTION=1 $DEEP --mode forward --calls 10
  FLASHOPM_FUSED_PROJECTION=1 T bench_fused 100 $py -m flashopm bench --shapes "1,1024,256,64,32,128;1,5120,384,64,32,128" \
    --impls eager,flashopm --calls 10 --out "$R/bench_fused"
  T t_cuda 240 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py
  exit 0
fi

if [ "$PHASE" = waves ]; then
  # one small case first (a grid barrier that hangs stops here), both deep MSAs beside the default
  # (in alternation), the tests, then the bench CLI beside eager and the files the change touches
  T t_smoke 60 $py -m pytest -x -q -p no:cacheprovider tests/test_waves.py -k "ones or bool" || exit 1
  DEEP="1,1024,256,64,32,128 1,5120,384,64,32,128"
  T ab_waves 90 $py scripts/ab_env.py FLASHOPM_WAVES=1 $DEEP --mode forward --calls 10
  T t_waves 200 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  # where the time goes: each step left out in turn (timing aid), then the parts: a workspace that
  # holds every wave's a and b in one or two parts, and the workspace alone (no rows of the output)
  for v in FLASHOPM_WAVES_SKIP=1 FLASHOPM_WAVES_SKIP=2 FLASHOPM_WAVES_SKIP=4 FLASHOPM_WAVES_SKIP=5 \
    FLASHOPM_WAVES_SKIP=7 FLASHOPM_WAVES_WS=200000000 FLASHOPM_WAVES_OUT=0; do
    n=${v#FLASHOPM_WAVES_}
    T "ab_${n//=/_}" 40 $py scripts/ab_env.py FLASHOPM_WAVES=1,$v 1,1024,256,64,32,128 --mode forward --calls 10
  done
  # flashopm-bounded (peak_memory_bound(1.1)) takes the waves form at both shapes by itself
  T bench_waves 150 $py -m flashopm bench --shapes "1,1024,256,64,32,128;1,5120,384,64,32,128" \
    --impls eager,flashopm,flashopm-bounded --calls 10 --out "$R/bench_waves"
  exit 0
fi
if [ "$PHASE" = waves_rest ]; then
  # the files whose kernels the change touched: the fused projection's first kernel, the tile body
  T t_fused 100 $py -m pytest -q -p no:cacheprovider tests/test_fused_projection.py
  T t_cuda 300 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py
  T t_conv 200 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_rows.py tests/test_modules.py
  exit 0
fi

if [ "$PHASE" = waves_short ]; then
  # most needed first: the tests, the files the change touched, the bench beside eager, then
  # where the time goes (steps left out, the parts' cost), then the conventions' and modules' files
  T t_waves 60 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  T t_cuda 60 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
  T t_fused 40 $py -m pytest -q -p no:cacheprovider tests/test_fused_projection.py
  T bench_waves 60 $py -m flashopm bench --shapes "1,1024,256,64,32,128;1,5120,384,64,32,128" \
    --impls eager,flashopm,flashopm-bounded --calls 10 --out "$R/bench_waves"
  for v in SKIP=1 SKIP=2 SKIP=4 WS=200000000 OUT=0; do
    T "ab_${v//=/_}" 25 $py scripts/ab_env.py FLASHOPM_WAVES=1,FLASHOPM_WAVES_$v 1,1024,256,64,32,128 --mode forward --calls 6
  done
  T t_conv 90 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py
  exit 0
fi

if [ "$PHASE" = checks ]; then
  # the forward-side test files
  T t_waves 90 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  other_forward_tests
  exit 0
fi

if [ "$PHASE" = bars ]; then
  # The figures of issues 4 and 6 in one call, each beside its peers in one process (the bench
  # CLI), the newest bar first: float32 "highest" at the deep MSAs, the crop and N = 768 / 1536 with
  # eager, torch.compile, the default and the bounded path ("high" at N = 1536 through
  # flashopm-tf32); bfloat16 at N = 1536; the OpenFold and Boltz modules; N = 8192 under the bound.
  T t_waves 60 $py -m pytest -q -p no:cacheprovider tests/test_waves.py || exit 1
  bench_deep
  bench_f32
  bench_bf16
  bench_modules
  bench_8192
  exit 0
fi

if [ "$PHASE" = proj ]; then
  # the waves form's projection (x's rows copied warp by warp, projected rows stored whole) and its
  # one-buffer stores waiting on an arrival made right after the part before was read: its tests,
  # the trace, the deep MSAs and the modules under the bound, kept a against none, the modules'
  # tests (~5 min with the build)
  T t_waves 80 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  T trace_auto 40 $py scripts/waves_trace.py 1,1024,256,64,32,128 1,5120,384,64,32,128 --out "$R/trace_auto"
  bench_deep
  bench_modules
  T ab_keep0 30 env FLASHOPM_WAVES=1 $py scripts/ab_env.py FLASHOPM_WAVES_KEEP=0 1,1024,256,64,32,128 --mode forward --calls 6
  T t_conv 60 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py
  exit 0
fi

if [ "$PHASE" = waves_final ]; then
  # every row of issues 4 and 6 that the waves form (under the bound: the deep MSAs, the crop, N =
  # 768) or the pair counts (the OpenFold and Boltz modules) take part in, with their tests; the
  # trace (~6 min with the build)
  T t_waves 60 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  bench_deep
  bench_modules
  T t_conv 60 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py
  bench_f32
  T trace_auto 40 $py scripts/waves_trace.py 1,1024,256,64,32,128 --out "$R/trace_auto"
  exit 0
fi

if [ "$PHASE" = own_rows ]; then
  # (branch waves-own-rows) the last band's part buffers in its own rows: the tests, the trace
  # beside FLASHOPM_WAVES_OWN=0, paired, the deep MSAs and the modules' deep row (~5 min)
  T t_waves 90 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  T ab_own0 40 env FLASHOPM_WAVES=1 $py scripts/ab_env.py FLASHOPM_WAVES_OWN=0 1,1024,256,64,32,128 1,5120,384,64,32,128 --mode forward --calls 8
  T conv_bf16 90 $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  T trace_own 40 $py scripts/waves_trace.py 1,1024,256,64,32,128 --out "$R/trace_own"
  T trace_ws 40 $py scripts/waves_trace.py 1,1024,256,64,32,128 --env FLASHOPM_WAVES_OWN=0 --out "$R/trace_ws"
  bench_deep
  for mod in openfold boltz; do
    module_rows $mod "bench_${mod}_deep" "1,1024,256,64,32,128" 20
  done
  exit 0
fi

# Every figure of issue 6 for each convention beside its peers (eager, torch.compile of the
# convention's einsum module): float32 at the crop, N = 768 and 1536 ("highest", bounded, TF32
# bounded), the deep MSA over 20 calls, bfloat16 at N = 1536, N = 8192 under the bound; the spec's
# module at N = 1536 for the epilogue's cost (~5 min)
modules_all_rows() {
  for mod in openfold boltz; do
    T "mod_${mod}_f32" 150 $py -m flashopm bench --module $mod \
      --shapes "1,128,256,256,32,128;1,512,768,256,32,128;1,512,1536,256,32,128" \
      --impls eager,flashopm,compile,flashopm-bounded,flashopm-tf32-bounded --calls 5 --out "$R/mod_${mod}_f32"
    T "mod_${mod}_deep" 90 $py -m flashopm bench --module $mod --shapes "1,1024,256,64,32,128" \
      --impls eager,flashopm,compile,flashopm-bounded --calls 20 --out "$R/mod_${mod}_deep"
    T "mod_${mod}_bf16" 90 $py -m flashopm bench --module $mod --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
      --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_${mod}_bf16"
    T "mod_${mod}_8192" 90 $py -m flashopm bench --module $mod --shapes "1,512,8192,256,32,128" \
      --impls flashopm-bounded --calls 2 --fp64-max-n 0 --out "$R/mod_${mod}_8192"
  done
  T spec_1536 90 $py -m flashopm bench --shapes "1,512,1536,256,32,128" --impls eager,flashopm,flashopm-bounded \
    --calls 5 --out "$R/spec_1536"
}
if [ "$PHASE" = modules_all ]; then
  modules_all_rows  # (~6 min with the build)
  exit 0
fi

if [ "$PHASE" = pairs ]; then
  # the pair counts on tensor cores (opm_pair_count_mma_kernel): their tests (a failure stops the
  # call), the kernel's time per mask kind against the FMA form (FLASHOPM_PAIR_COUNT_MMA=0) at
  # (1,512,1536) and (1,512,768), the conventions' bfloat16 time by kernel with each form, then the
  # other tests of the conventions and modules (~7 min with the build)
  T t_pairs 300 $py -m pytest -x -q -p no:cacheprovider tests/test_conventions.py -k "pair_count" || exit 1
  T pair_times 120 $py scripts/pair_count_times.py 1,512,1536 1,512,768
  T conv_bf16_mma 90 $py scripts/convention_times.py 1536 openfold boltz bfloat16 kernels
  T conv_bf16_fma 90 env FLASHOPM_PAIR_COUNT_MMA=0 $py scripts/convention_times.py 1536 openfold boltz bfloat16 kernels
  T t_conv 200 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py -k "not pair_count"
  exit 0
fi

if [ "$PHASE" = bf16 ]; then
  # the streamed projection (16-bit x) and the pair counts' 4 x 4 sums: their tests, the projection
  # paired against FLASHOPM_PROJECT_STREAM=1, each convention's bfloat16 time by kernel, the
  # bfloat16 rows of issues 4 and 6 beside their peers, then the contraction under Nsight Compute
  # (~7 min with the build)
  T t_stream 120 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "streamed_projection or block_rows or tiled_projection or half_precision"
  T t_conv 200 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py
  T ab_stream 60 $py scripts/ab_env.py FLASHOPM_PROJECT_STREAM=1 1,512,1536,256,32,128 1,512,768,256,32,128 --dtype bfloat16 --mode forward --calls 8
  T conv_bf16 90 $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  bench_bf16
  for mod in openfold boltz; do
    T "mod_${mod}_bf16" 90 $py -m flashopm bench --module $mod --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
      --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_${mod}_bf16"
  done
  tc16_one
  T ncu_tc16 150 ncu --clock-control none -k regex:opm_outer_tc16 --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section Occupancy $py "$R/tc16_one.py"
  exit 0
fi

if [ "$PHASE" = bf16_clusters ]; then
  # the streamed projection and the clustered forms in one call: the conventions' tests and the
  # bounds' (the epilogue's rows staged early, the bands' pair counts: a failure stops the call),
  # the streamed projection's (on request since run 326) and the clustered forms' (a failure or
  # hang leaves them out); clusters of four paired against none (two where four lose,
  # none where both do, unless CLUSTER names the size), then issue 6's bfloat16 rows beside eager
  # and torch.compile in the clusters that won, each convention's time by kernel under the memory
  # bound and without, and the other pairings (~10-12 min with the build: the call's limit cuts
  # what comes last)
  CL=${CLUSTER:-4}
  T t_conventions 90 $py -m pytest -x -q -p no:cacheprovider tests/test_conventions.py || exit 1
  T t_bounds 120 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "peak_bound or peak_memory_bound" || exit 1
  T t_stream 120 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "streamed_projection or block_rows"
  T t_clusters 180 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "cluster_form or tc16_conventions" ||
    CL=1
  # paired ratio (without / with) of an ab_env log: above 1 where the switch is faster
  paired() { grep -o "paired (without / with) [0-9.]*" "$R/$1.log" | awk '{print $NF}' | head -1; }
  faster() { local r; r=$(paired "$1"); [ -n "$r" ] && awk "BEGIN { exit !($r > 1.0) }"; }
  ab_c() { ab_pair "cluster$1" "FLASHOPM_TC16_CLUSTER=$1"; }
  if [ "$CL" != 1 ]; then
    ab_c 4
    if [ -z "$CLUSTER" ] && ! faster ab_cluster4; then
      ab_c 2
      if faster ab_cluster2; then CL=2; else CL=1; fi
    fi
  fi
  echo "clusters for the rows: $CL" >>"$R/steps.txt"
  T bench_bf16_clusters 90 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
    --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/bench_bf16_clusters"
  for mod in openfold boltz; do
    T "mod_${mod}_bf16_clusters" 90 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --module $mod --shapes "1,512,1536,256,32,128" \
      --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_${mod}_bf16_clusters"
  done
  T conv_bounded 90 env FLASHOPM_TC16_CLUSTER=$CL FLASHOPM_PLAN_LOG=1 $py scripts/convention_times.py 1536 row openfold bfloat16 kernels bounded
  T conv_clusters 90 env FLASHOPM_TC16_CLUSTER=$CL $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  ab_pair stream FLASHOPM_PROJECT_STREAM=1
  [ "$CL" != 1 ] && [ ! -f "$R/ab_cluster2.log" ] && ab_c 2
  exit 0
fi

if [ "$PHASE" = stm17 ]; then
  # NOTES 0zc (3): O stored by stmatrix in the tensor-copy forms (FLASHOPM_TC16_STMATRIX=1, off by
  # default): the kernel's form tests (a failure stops the call), both traced, paired, and if it is
  # faster the bfloat16 rows with it (~6 min with the build)
  T t_tc16 200 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "cluster_form or tc16_conventions or default_form_variants" || exit 1
  T trace16 120 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_STMATRIX=1"
  pair_and_keep FLASHOPM_TC16_STMATRIX stmatrix
  T mod_openfold_bf16 120 $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_openfold_bf16"
  T conv_stm 90 $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  # where a lone call's wall goes beyond its kernels (run 335: OpenFold's wall 265 us above its graph)
  T lone_parts 120 $py scripts/lone_call_parts.py --module openfold --dtype bfloat16
  for f in rows peak_plan replace python_entry; do
    T t_$f 90 $py -m pytest -q -p no:cacheprovider tests/test_$f.py
  done
  exit 0
fi

if [ "$PHASE" = wtrace17 ]; then
  # where the wide forms' tiles go (run 341: level with the two-warpgroup forms though a quarter
  # fewer bytes are taken in a pair), traced next to the default; a lone call's host time and its
  # runtime calls (run 341: 186 us of OpenFold's wall before or between its kernels) (~5 min)
  T trace16 150 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2+FLASHOPM_TC16_WIDE=0,2,1"
  T lone_parts 150 $py scripts/lone_call_parts.py --module openfold --dtype bfloat16
  T lone_spec 150 $py scripts/lone_call_parts.py --module spec --dtype bfloat16 --calls 5
  T t_tc16 200 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "cluster_form or tc16_conventions or wide_form"
  exit 0
fi

# The forward test files and the autograd tests; the wide forms traced (each W chunk's wait too) and paired
# against two warpgroups (FLASHOPM_TC16_WIDE=0), and OpenFold's bfloat16 row.
forward_and_autograd_files() {
  forward_files
  T t_auto 150 $py -m pytest -q -p no:cacheprovider tests/test_autograd.py
}
wide_against_two() {
  T trace16 120 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_WIDE=0"
  ab_pair two FLASHOPM_TC16_WIDE=0
  T mod_openfold_bf16 120 $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_openfold_bf16"
}

if [ "$PHASE" = wide18 ]; then
  # NOTES 0zd: the forward and autograd test files on the wide forms as the default (run 344 ran
  # the forward files with FLASHOPM_TC16_WIDE=1 set; the default was switched after it), then
  # the wide forms against two warpgroups (~7 min with the build); rest18 runs the other files
  forward_and_autograd_files
  wide_against_two
  exit 0
fi

if [ "$PHASE" = rate20 ]; then
  # the tensor cores' rate for each MMA width the 16-bit contraction uses, operands resident
  # (scripts/wgmma_rate.cu); then as wide18
  T wgmma_rate 120 bash -c "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src/flashopm/csrc \
    -o /tmp/wgmma_rate scripts/wgmma_rate.cu && /tmp/wgmma_rate"
  forward_and_autograd_files
  wide_against_two
  exit 0
fi

# the other GPU test files, one step each (test_build compiles the extension again: CI covers it)
rest_files() {
  for f in backward smaller_gpus rows replace python_entry fused_projection launch ln_backward distributed waves peak_plan; do
    T t_$f 120 $py -m pytest -q -p no:cacheprovider tests/test_$f.py
  done
}

# A change to the wide forms: their bits (stop at the first failure), the trace of the forms in $1
# (cycles a tile), OpenFold's row, then every test file and the other rows, as far as the call goes.
wide_change() {
  wide_bits || return 1
  T trace16 60 $py scripts/tc16_trace.py --out "$R/trace16" --forms "$1"
  mod_row openfold
  forward_and_autograd_files
  mod_row boltz
  bench_bf16
  rest_files
}

if [ "$PHASE" = n96 ]; then
  # the wide forms' phase 2 as one m64n96k16 a k step (O and phase 1's stages in slices of two
  # chunks, W's whole halves in A, B and used slices): the 16-bit forms' bits (stop at the first
  # failure), then against two warpgroups, the specification's and Boltz's rows, the forward files
  wide_bits || exit 0
  wide_against_two
  T mod_boltz_bf16 120 $py -m flashopm bench --module boltz --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_boltz_bf16"
  bench_bf16
  forward_and_autograd_files
  # the other test files only where this form is ahead of main's wide form (paired against two
  # warpgroups 0.973-0.975, default over FLASHOPM_TC16_WIDE=0)
  r=$(grep -o "paired (without / with) [0-9.]*" "$R/ab_two.log" | awk '{print $NF}' | head -1)
  if [ -n "$r" ] && awk "BEGIN { exit !($r < 0.970) }"; then rest_files; fi
  exit 0
fi

if [ "$PHASE" = os28 ]; then
  # the wide forms' O stores compiled alone in their kernels (fewer spills): the 16-bit forms'
  # bits (stop at the first failure), the trace (cycles a tile, against run 354's 51218), OpenFold's
  # row (~2 min with the build), then every other test file
  wide_change "2"
  exit 0
fi

if [ "$PHASE" = wt26 ]; then
  # W's chunks 2-3 of each tile stored by the wide forms' third consumer warpgroup from its
  # registers (FLASHOPM_TC16_W_THIRD, on by default; run 353: they waited 860 and 743 cycles a
  # tile) over pc25's producer (b's two groups a copy, the parity without a product): the 16-bit
  # forms' bits (with W_THIRD=0 where the default fails), the traces (cycles a tile, against run
  # 353's 52522), the pairs, OpenFold's row, the forward files, the other rows, every test file
  if ! wide_bits; then
    export FLASHOPM_TC16_W_THIRD=0
    echo "from here FLASHOPM_TC16_W_THIRD=0 (t_wide failed)" >>"$R/steps.txt"
    wide_bits t_wide_w0 || exit 0
  fi
  T trace16 90 $py scripts/tc16_trace.py --out "$R/trace16" \
    --forms "2,2+FLASHOPM_TC16_W_THIRD=0,2+FLASHOPM_TC16_B_PAIRS=0,2+FLASHOPM_TC16_WIDE=0"
  ab_pair w_third FLASHOPM_TC16_W_THIRD=0
  ab_pair b_pairs FLASHOPM_TC16_B_PAIRS=0
  mod_row openfold
  T t_cuda 150 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
  T t_conv 150 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py tests/test_projection16.py
  mod_row boltz
  bench_bf16
  for f in autograd waves peak_plan backward smaller_gpus rows replace python_entry fused_projection launch ln_backward distributed; do
    T t_$f 120 $py -m pytest -q -p no:cacheprovider tests/test_$f.py
  done
  exit 0
fi

if [ "$PHASE" = pc25 ]; then
  # the wide producer's b in one copy of two groups a stage (FLASHOPM_TC16_B_PAIRS, on by default
  # where N·hidden is a multiple of 64) and each stage's wait parity without a product: the 16-bit
  # forms' bits with and without (stop at the first failure), the traces (cycles a tile, against
  # run 353's 52522), the pair against one copy a group, OpenFold's row, then the forward files,
  # the other rows and every test file
  wide_bits || exit 0
  T trace16 90 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_B_PAIRS=0,2+FLASHOPM_TC16_WIDE=0"
  ab_pair b_pairs FLASHOPM_TC16_B_PAIRS=0
  mod_row openfold
  forward_files
  rows_and_files
  exit 0
fi

if [ "$PHASE" = pw24 ]; then
  # the tensor-copy forms' producer without a division, a rank or a loop over halves per copy
  # (run 352's Nsight: its one lane's issue bounds phase 1), and each consumer warpgroup copying
  # its own rows of a (FLASHOPM_TC16_CONSUMER_A=1, off by default): the 16-bit forms' bits (stop
  # at the first failure), the traces (cycles a tile, against runs 350-351's 55031 and 55599),
  # OpenFold's row; then the consumers' copies: their bits, trace, pair, and OpenFold's row with
  # them where the pair is below 1; then the rows and every test file
  T t_wide 120 $py -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "(wide_form or cluster_form or default_form) and not consumer_a" || exit 0
  T trace16 90 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_WIDE=0"
  mod_row openfold
  if T t_consumer_a 120 $py -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k consumer_a; then
    T trace16_ca 60 $py scripts/tc16_trace.py --out "$R/trace16_ca" --forms "2+FLASHOPM_TC16_CONSUMER_A=1"
    pair_and_keep FLASHOPM_TC16_CONSUMER_A consumer_a
    if [ "${FLASHOPM_TC16_CONSUMER_A:-0}" = 1 ]; then
      T mod_openfold_ca 120 $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
        --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_openfold_ca"
    fi
  fi
  T t_cuda 150 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "not consumer_a"
  T t_conv 150 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py tests/test_projection16.py
  rows_and_files
  exit 0
fi

# The default (wide) form of the 16-bit contraction under Nsight Compute: every section, and the
# stall samples and shared-memory traffic of each SASS line (source.csv.gz).
ncu_default_form() {
  tc16_one
  T ncu_wide 240 ncu --clock-control none -k regex:opm_outer_tc16 --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section SchedulerStats --section WarpStateStats \
    --section InstructionStats --section SourceCounters --section LaunchStats --section Occupancy \
    --import-source no -o "$R/wide" -f $py "$R/tc16_one.py"
  T ncu_source 120 bash -c "set -o pipefail; ncu -i '$R/wide.ncu-rep' --page source --csv --print-source sass | gzip -9 > '$R/source.csv.gz' ||
    ncu -i '$R/wide.ncu-rep' --page details --print-details all | gzip -9 > '$R/details.txt.gz'"
  rm -f "$R/wide.ncu-rep"
  pack
}

if [ "$PHASE" = wl41 ]; then
  # wl40's steps with FLASHOPM_TC16_W_LOCAL's first, for a card whose rows are not issue 6's
  T t_wlocal 150 $py -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "w_local" || exit 0
  T trace16 90 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_W_LOCAL=1,2+FLASHOPM_TC16_W_LOCAL=1+FLASHOPM_TC16_W_THIRD=2"
  ab_pair wlocal FLASHOPM_TC16_W_LOCAL=1
  wide_bits || exit 0
  mod_row openfold
  forward_and_autograd_files
  rest_files
  exit 0
fi

if [ "$PHASE" = wl40 ]; then
  # The three bfloat16 rows first (issue 6's figures, on the default form), then W's chunks copied
  # by each block of a cluster into its own shared memory (FLASHOPM_TC16_W_LOCAL=1): the 16-bit
  # bits and its own, every test file, then the trace of both forms (each W chunk's wait
  # in the block behind and the block ahead) and the pair at the bfloat16 row
  mod_row openfold
  mod_row boltz
  bench_bf16
  wide_bits || exit 0
  T t_wlocal 150 $py -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "w_local"
  forward_and_autograd_files
  rest_files
  T trace16 90 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_W_LOCAL=1,2+FLASHOPM_TC16_W_LOCAL=1+FLASHOPM_TC16_W_THIRD=2"
  ab_pair wlocal FLASHOPM_TC16_W_LOCAL=1
  exit 0
fi

if [ "$PHASE" = r38 ]; then
  # main's kernels on the GPU the call got: the three bfloat16 rows first (issue 6's figures),
  # the trace, then the 16-bit bits and every test file, as far as the call goes
  mod_row openfold
  mod_row boltz
  bench_bf16
  T trace16 60 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2"
  wide_bits
  forward_and_autograd_files
  rest_files
  exit 0
fi

if [ "$PHASE" = crop20 ]; then
  # each convention's module at the crop over 20 calls, beside eager in one process: the bounded
  # row's spread (run 363: OpenFold 1.95x eager by medians, 2.31x paired, over 5 calls)
  for mod in openfold boltz; do
    module_rows $mod "mod_${mod}_crop" "1,128,256,256,32,128" 20 120
  done
  exit 0
fi
# Issue 5's figures: training steps (forward and every gradient) at the spec shape and the training
# crop beside eager and torch.compile, with peak memory; the forward's host time against an empty
# extension call; the spec's forward wall timed as issue 2 asks.
issue5_rows() {
  T train 240 $py -m flashopm bench --mode training --shapes "2,8,32,64,32,64;1,128,256,256,32,128" \
    --impls eager,flashopm,compile --calls 30 --out "$R/train"
  T host_paired 90 $py scripts/host_paired.py
  T spec_wall 60 $py -m flashopm bench --no-l2-flush --shapes "2,8,32,64,32,64" --impls eager,flashopm \
    --calls 200 --out "$R/spec_wall"
}
if [ "$PHASE" = h5 ]; then
  # for the card issues 5 and 6 name (REQUIRE_GPU=H200): issue 6's three bfloat16 rows, issue 5's
  # figures, then the test files as far as the call goes
  mod_row openfold
  mod_row boltz
  bench_bf16
  issue5_rows
  forward_and_autograd_files
  rest_files
  exit 0
fi
if [ "$PHASE" = i5 ]; then
  # issue 5's figures in one call on main's kernels, then the autograd test files first and every
  # other file, as far as the call goes
  issue5_rows
  for f in autograd backward ln_backward python_entry; do
    T t_$f 120 $py -m pytest -q -p no:cacheprovider tests/test_$f.py
  done
  forward_files
  for f in smaller_gpus rows replace fused_projection launch distributed waves peak_plan; do
    T t_$f 120 $py -m pytest -q -p no:cacheprovider tests/test_$f.py
  done
  exit 0
fi
if [ "$PHASE" = i6 ]; then
  # issue 6's figures all in one call on main's kernels: every convention's rows (modules_all_rows),
  # the spec's bfloat16 row, then the 16-bit forms' bits and every test file as far as the call
  # goes (~8 min with the build)
  modules_all_rows
  bench_bf16
  wide_bits
  forward_and_autograd_files
  rest_files
  exit 0
fi

if [ "$PHASE" = h37 ]; then
  # td35's order with the rows first and a fallback: if this branch's bits fail, main's kernels
  # (a copy of main's src/ in alt/, its own cache) give the rows instead, so that the call still
  # measures issue 6's figures on the GPU it got
  if wide_bits; then
    mod_row openfold
    T trace16 90 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_W_THIRD=2"
    T t_third2 150 $py -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "w_third_two"
    mod_row boltz
    bench_bf16
    forward_and_autograd_files
    rest_files
  elif [ -d alt/src ]; then
    export PYTHONPATH="$PWD/alt/src:$PWD/scripts" FLASHOPM_CACHE_DIR="$PWD/.cache/alt"
    T build_alt 300 $py -c "import flashopm._build as b; print(b.load())"
    mod_row openfold
    T trace16 60 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2"
    mod_row boltz
    bench_bf16
  fi
  exit 0
fi

if [ "$PHASE" = q36 ]; then
  # td35's measurements first, for a short call: the trace of both forms, OpenFold's row, then the
  # bits of each
  T trace16 90 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_W_THIRD=2"
  mod_row openfold
  wide_bits
  T t_third2 150 $py -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "w_third_two"
  exit 0
fi

if [ "$PHASE" = td35 ]; then
  # branch tile-divs (W's parity from the tile's count, no reload before chunk 0; the tile's
  # coordinates by the launch's divisors, no division chain between tiles): the bits, the trace
  # against run 359's 42936 cycles a tile (w0_wait 719, gap 938), the three bfloat16 rows, then
  # every test file
  # (branch third-wg-more adds W's chunks 5-6 by the third warpgroup, FLASHOPM_TC16_W_THIRD=2:
  # its bits and its trace beside the default's)
  wide_bits || exit 0
  T t_third2 150 $py -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "w_third_two"
  T trace16 90 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_W_THIRD=2"
  mod_row openfold
  mod_row boltz
  bench_bf16
  forward_and_autograd_files
  rest_files
  exit 0
fi

if [ "$PHASE" = h34 ]; then
  # main's kernels (run 359's): the bfloat16 rows at N = 1536 first (issue 6's figures), the
  # trace, the test files run 359's limit left out, then the forward and autograd files again
  mod_row openfold
  mod_row boltz
  bench_bf16
  T trace16 60 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2"
  for f in rows replace python_entry fused_projection launch ln_backward distributed waves peak_plan; do
    T t_$f 120 $py -m pytest -q -p no:cacheprovider tests/test_$f.py
  done
  wide_bits
  forward_and_autograd_files
  exit 0
fi

if [ "$PHASE" = pu33 ]; then
  # the wide forms' phase 2 with its 16 chunks unrolled (branch p2-unrolled: constant slots,
  # descriptors and barriers; ~30 instructions a chunk against ~110): the bits, the trace against
  # run 358's phase 2 (14424 cycles a tile on an H100, 13839 on run 357's H200), OpenFold's row,
  # every file
  wide_change "2,2+FLASHOPM_TC16_W_THIRD=0"
  exit 0
fi

if [ "$PHASE" = sr32 ]; then
  # (after the copies' program) the wide forms' rows staged by the store warps (branch
  # store-warps-rows): the bits (with and without the store warps), the trace (against run 357's
  # 47756 cycles a tile, o_store0 2207), OpenFold's row, every file
  wide_change "2,2+FLASHOPM_TC16_STORE_WARPS=0"
  exit 0
fi

if [ "$PHASE" = bl30 ]; then
  # the wide forms' round bias loaded only where the consumers store the rows (run 356: w0_wait
  # 1548 cycles a tile, a spilled bias value's store waiting for its load): the 16-bit forms'
  # bits (stop at the first failure), the trace (against run 356's 48806), OpenFold's row, then
  # every test file and the other rows as far as the call goes
  wide_change "2,2+FLASHOPM_TC16_STORE_WARPS=0"
  exit 0
fi

if [ "$PHASE" = nd29 ] || [ "$PHASE" = sc31 ]; then
  # os28's build merged: the test file os28 did not reach, the trace and OpenFold's row on this
  # machine, then the default (wide) form under Nsight Compute (sc31: after the copies' program)
  T t_distributed 120 $py -m pytest -q -p no:cacheprovider tests/test_distributed.py
  T trace16 60 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2"
  mod_row openfold
  ncu_default_form
  exit 0
fi

if [ "$PHASE" = nd27 ]; then
  # the test file run 354 did not reach, then the default (wide) form with W's chunks 2-3 by the
  # third warpgroup under Nsight Compute, as nc23 (without the timelines)
  T t_distributed 120 $py -m pytest -q -p no:cacheprovider tests/test_distributed.py
  ncu_default_form
  exit 0
fi

if [ "$PHASE" = nc23 ]; then
  # the default (wide) form of the 16-bit contraction under Nsight Compute: every section, and
  # the stall samples and shared-memory traffic of each SASS line (source.csv.gz); then where a
  # lone call's host time goes against its kernels (OpenFold's and the spec's conventions)
  ncu_default_form
  T timeline_openfold 90 $py scripts/lone_call_timeline.py --module openfold
  T timeline_spec 90 $py scripts/lone_call_timeline.py --module spec
  exit 0
fi

if [ "$PHASE" = ls22 ]; then
  # the tensor-copy forms' tile loop with its counters in shared memory and phase 1's loop bound
  # from the parameters (no local loads between tiles), and the wide tile's first stages beside
  # the tile before's last chunks (FLASHOPM_TC16_EARLY_STAGES=1, off by default): the 16-bit
  # forms' bits with and without (stop at the first failure), the traces (cycles a tile, against
  # run 350's 55031), the pair, the rows (early stages on where the pair is below 1), then the
  # test files
  wide_bits || exit 0
  T trace16 120 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_EARLY_STAGES=1,2+FLASHOPM_TC16_WIDE=0"
  pair_and_keep FLASHOPM_TC16_EARLY_STAGES early
  mod_row openfold
  forward_files
  rows_and_files
  exit 0
fi

if [ "$PHASE" = sw21 ]; then
  # the wide forms' outputs stored by the producer warpgroup's other warps beside the next tile's
  # phase 1 (FLASHOPM_TC16_STORE_WARPS, on by default): the 16-bit forms' bits with and without
  # (stop at the first failure), both traced and paired, the bfloat16 rows; where they are slower,
  # the rest with them off; then the test files (~9 min with the build; the first five steps ~2 min)
  wide_bits || exit 0
  ab_pair store_warps FLASHOPM_TC16_STORE_WARPS=0
  r=$(grep -o "paired (without / with) [0-9.]*" "$R/ab_store_warps.log" | awk '{print $NF}' | head -1)
  if [ -z "$r" ] || awk "BEGIN { exit !($r >= 1.0) }"; then export FLASHOPM_TC16_STORE_WARPS=0; fi
  echo "from here FLASHOPM_TC16_STORE_WARPS=${FLASHOPM_TC16_STORE_WARPS:-1} (paired $r)" >>"$R/steps.txt"
  mod_row openfold
  forward_files
  T trace16 120 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,2+FLASHOPM_TC16_STORE_WARPS=0"
  rows_and_files
  exit 0
fi

if [ "$PHASE" = rest18 ]; then
  rest_files
  exit 0
fi

if [ "$PHASE" = rest17 ]; then
  # the GPU test files not yet run on this code, one step each (test_build compiles the extension
  # again: CI covers it; test_backward ran in final17)
  for f in smaller_gpus ln_backward distributed launch waves fused_projection rows peak_plan replace python_entry; do
    T t_$f 90 $py -m pytest -q -p no:cacheprovider tests/test_$f.py
  done
  exit 0
fi

if [ "$PHASE" = final17 ]; then
  # the autograd tests with the LayerNorm parameters' bar from the seeds of run 337; clusters of
  # four paired against two and both traced; the test files not run on this code yet; Nsight
  # Compute's memory tables for clusters of two (L2's throughput against the SMs') (~7 min)
  T t_auto 150 $py -m pytest -q -p no:cacheprovider tests/test_autograd.py
  ab_pair cluster4 FLASHOPM_TC16_CLUSTER=4
  T trace16 120 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,4"
  T t_rest 240 $py -m pytest -q -p no:cacheprovider tests --ignore=tests/test_cuda.py --ignore=tests/test_conventions.py \
    --ignore=tests/test_modules.py --ignore=tests/test_projection16.py --ignore=tests/test_autograd.py
  tc16_one
  T ncu_cluster2 120 ncu --clock-control none -k regex:opm_outer_tc16 --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section ComputeWorkloadAnalysis $py "$R/tc16_one.py"
  exit 0
fi

if [ "$PHASE" = final16 ]; then
  # clusters of two as the 16-bit kernel's default form, 16-byte output stores, the first round's
  # rows staged in phase 1, the form without tensor copies as resident blocks: the tests of the
  # kernel's forms (a failure stops the call); the tiles' phases traced; the default paired against
  # the form without tensor copies (resident or not) and against 4-byte stores; issue 6's bfloat16
  # rows (OpenFold, Boltz, spec) beside eager and torch.compile; each convention by kernel; then the
  # forward test files whole and the autograd tests (~9.5 min with the build: the limit cuts the last)
  T t_tc16 150 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "cluster_form or tc16_conventions or default_form_variants" || exit 1
  T trace16 150 $py scripts/tc16_trace.py --out "$R/trace16" --forms "2,0,0+FLASHOPM_TC16_RESIDENT=0,2+FLASHOPM_TC16_WIDE_STORES=0"
  ab_pair resident FLASHOPM_TC16_CLUSTER=0
  T ab_old 60 $py scripts/ab_env.py FLASHOPM_TC16_CLUSTER=0,FLASHOPM_TC16_RESIDENT=0 1,512,1536,256,32,128 \
    --dtype bfloat16 --mode forward --calls 6
  ab_pair wide FLASHOPM_TC16_WIDE_STORES=0
  T mod_openfold_bf16 120 $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_openfold_bf16"
  T mod_boltz_bf16 120 $py -m flashopm bench --module boltz --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_boltz_bf16"
  T bench_bf16 90 $py -m flashopm bench --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
    --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/bench_bf16"
  T conv_final 90 $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  T t_cuda 200 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
  T t_conv 200 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py tests/test_projection16.py
  T t_auto 150 $py -m pytest -q -p no:cacheprovider tests/test_autograd.py
  exit 0
fi

if [ "$PHASE" = ksplit ]; then
  # W's first chunks issued in phase 1 (FLASHOPM_TC16_W_EARLY, since removed), the epilogue's bias loaded at the
  # round's start, phase 2 as O·Wᵀ, the warpgroups splitting each W chunk's k (FLASHOPM_TC16_KSPLIT):
  # the tests of the 16-bit kernel's forms (a failure stops the call); the tiles' phases traced;
  # each switch paired against its other side; issue 6's bfloat16 rows and each convention by
  # kernel on the fastest form; then the forward test files of this kernel whole (~9 min)
  T t_tc16 150 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py \
    -k "cluster_form or tc16_conventions or early_w_chunks or phase2_forms" || exit 1
  T trace16 150 $py scripts/tc16_trace.py --out "$R/trace16" \
    --forms "0,0+FLASHOPM_TC16_KSPLIT=0,0+FLASHOPM_TC16_W_EARLY=0,2,2+FLASHOPM_TC16_KSPLIT=0"
  for v in KSPLIT W_EARLY; do
    T "ab_${v,,}" 60 env FLASHOPM_TC16_CLUSTER=0 $py scripts/ab_env.py FLASHOPM_TC16_$v=0 1,512,1536,256,32,128 \
      --dtype bfloat16 --mode forward --calls 6
  done
  pair_clusters 2
  T ab_defer2 60 env FLASHOPM_TC16_CLUSTER=2 $py scripts/ab_env.py FLASHOPM_TC16_DEFER=0 1,512,1536,256,32,128 \
    --dtype bfloat16 --mode forward --calls 6
  T mod_openfold_bf16 120 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_openfold_bf16"
  T conv_ksplit 90 env FLASHOPM_TC16_CLUSTER=$CL $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  T bench_bf16 90 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
    --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/bench_bf16"
  T t_cuda 200 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
  T t_conv 200 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py tests/test_projection16.py
  exit 0
fi

if [ "$PHASE" = defer ]; then
  # the tensor-copy forms with each tile's last round stored beside the next tile's first MMAs
  # (FLASHOPM_TC16_DEFER) and stage buffer 0 clear of phase 2's operands (FLASHOPM_TC16_CLEAR0,
  # since removed: run 333 found it 2% slower): their tests (a failure stops the call); the tiles' phases traced for the
  # default form and clusters of 1 and 2, with and without; paired against the default form and
  # against DEFER=0; the OpenFold and spec bfloat16 rows on the fastest form (~6 min with the build)
  T t_tma 120 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "cluster_form or tc16_conventions" || exit 1
  T trace16 150 $py scripts/tc16_trace.py --out "$R/trace16" \
    --forms "0,1,2,2+FLASHOPM_TC16_DEFER=0,2+FLASHOPM_TC16_CLEAR0=0,2+FLASHOPM_TC16_DEFER=0+FLASHOPM_TC16_CLEAR0=0"
  pair_clusters 2 1
  for cl in 2 1; do
    T "ab_defer$cl" 60 env FLASHOPM_TC16_CLUSTER=$cl $py scripts/ab_env.py FLASHOPM_TC16_DEFER=0 1,512,1536,256,32,128 \
      --dtype bfloat16 --mode forward --calls 6
    T "ab_clear$cl" 60 env FLASHOPM_TC16_CLUSTER=$cl $py scripts/ab_env.py FLASHOPM_TC16_CLEAR0=0 1,512,1536,256,32,128 \
      --dtype bfloat16 --mode forward --calls 6
  done
  T mod_openfold_bf16 120 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_openfold_bf16"
  T conv_defer 90 env FLASHOPM_TC16_CLUSTER=$CL $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  T bench_bf16 90 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
    --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/bench_bf16"
  exit 0
fi

if [ "$PHASE" = trace16 ]; then
  # each phase of the 16-bit contraction's tiles in clock cycles, for the default form and the
  # tensor-copy forms in clusters of 1 and 2, at (1,512,1536,256,32,128) in bfloat16 (~3 min with the build)
  T trace16 120 $py scripts/tc16_trace.py --forms 0,1,2 --out "$R/trace16"
  exit 0
fi

if [ "$PHASE" = stack ] || [ "$PHASE" = stack_rows ]; then
  # the tensor-copy forms without serialised MMAs, the pair counts on tensor cores and the
  # register-resident projection together: each one's tests (a failure of the first stops the call), each kernel
  # against its old form in one process, the contraction's forms paired at N = 1536 in bfloat16,
  # each convention's time by kernel, issue 6's bfloat16 rows beside eager and torch.compile (with
  # the fastest contraction form) (~8 min with the build)
  if [ "$PHASE" = stack ]; then  # (stack_rows: these two ran on this device code, run 331)
    T t_tma 120 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "cluster_form or tc16_conventions" || exit 1
    T t_proj16 150 $py -m pytest -x -q -p no:cacheprovider tests/test_projection16.py
  fi
  T t_pairs 150 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py -k "pair_count"
  pair_clusters 2 1 4
  T mod_openfold_bf16 120 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_openfold_bf16"
  T conv_stack 90 env FLASHOPM_TC16_CLUSTER=$CL $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  T proj16_times 90 $py scripts/projection16_times.py 1,512,1536,256,32,128 --dtype bfloat16
  T pair_times 60 $py scripts/pair_count_times.py 1,512,1536
  T bench_bf16 90 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
    --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/bench_bf16"
  exit 0
fi

if [ "$PHASE" = proj16 ]; then
  # the register-resident projection for 16-bit x (opm_project_regs_kernel; FLASHOPM_PROJECT_REGS=0
  # the row-tiled kernel): its tests; the projection kernel's time in each form at
  # (1,512,1536,256,32,128) and N = 768 in bfloat16, the forms taking turns in one process; the
  # whole forward paired against FLASHOPM_PROJECT_REGS=0; both kernels under Nsight Compute; issue
  # 6's bfloat16 OpenFold row beside eager and torch.compile; each convention's bfloat16 time by
  # kernel; then test_cuda's tests of the projection's other forms and of 16-bit inputs on the
  # outer-first path (~9 min with the build: the call's limit cuts what comes last)
  T t_proj16 240 $py -m pytest -x -q -p no:cacheprovider tests/test_projection16.py || exit 1
  T proj16_times 120 $py scripts/projection16_times.py 1,512,1536,256,32,128 1,512,768,256,32,128 --dtype bfloat16
  ab_pair regs FLASHOPM_PROJECT_REGS=0
  tc16_one
  for regs in 1 0; do
    T "ncu_proj_regs$regs" 90 env FLASHOPM_PROJECT_REGS=$regs \
      ncu --clock-control none -k regex:opm_project_ --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section Occupancy $py "$R/tc16_one.py"
  done
  T mod_openfold_bf16 120 $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_openfold_bf16"
  T conv_regs 90 $py scripts/convention_times.py 1536 row openfold bfloat16 kernels
  T t_proj_old 200 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    -k "streamed_projection or projection_block_rows or tiled_projection or tc16_conventions or (half_precision_inputs and outer)"
  exit 0
fi

if [ "$PHASE" = producer ]; then
  # the 16-bit kernel's tensor-copy forms with a producer warp (FLASHOPM_TC16_CLUSTER=1, 2, 4):
  # their bits against the form without (a hang shows as the step's timeout), each paired against
  # it at N = 1536 in bfloat16 (resident clusters taking groups of tiles in turn; the fastest also
  # with one cluster per group); then, with the fastest (CLUSTER overrides), each convention's time
  # by kernel, issue 6's OpenFold and spec bfloat16 rows beside eager and torch.compile, and both
  # forms under Nsight Compute (~10 min with the build: the call's limit cuts what comes last)
  T t_tma 240 $py -m pytest -x -v -p no:cacheprovider tests/test_cuda.py -k "cluster_form or tc16_conventions" || exit 1
  pair_clusters 1 2 4
  [ "$CL" != 0 ] && T "ab_cluster${CL}_p0" 60 $py scripts/ab_env.py FLASHOPM_TC16_CLUSTER=$CL,FLASHOPM_TC16_PERSISTENT=0 \
    1,512,1536,256,32,128 --dtype bfloat16 --mode forward --calls 6
  T conv_tma 90 env FLASHOPM_TC16_CLUSTER=$CL $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  T mod_openfold_bf16 90 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_openfold_bf16"
  T bench_bf16 90 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
    --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/bench_bf16"
  ncu_tc16 0 "$CL"
  exit 0
fi

if [ "$PHASE" = regs ]; then
  # the tensor-copy forms with a producer warpgroup and setmaxnreg: their bits against the default
  # form (a hang shows as the step's timeout), clusters of two and one paired against it at N =
  # 1536 in bfloat16, then clusters of two under Nsight Compute with source counters (~7 min)
  T t_tma 240 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "cluster_form or tc16_conventions" || exit 1
  pair_clusters 2 1 4
  T conv_regs 90 env FLASHOPM_TC16_CLUSTER=$CL $py scripts/convention_times.py 1536 row openfold bfloat16 kernels
  T mod_openfold_bf16 90 env FLASHOPM_TC16_CLUSTER=$CL $py -m flashopm bench --module openfold --shapes "1,512,1536,256,32,128" \
    --dtype bfloat16 --impls eager,flashopm,compile --calls 5 --out "$R/mod_openfold_bf16"
  tc16_one
  T ncu_cluster2_src 150 env FLASHOPM_TC16_CLUSTER=2 \
    ncu --clock-control none -k regex:opm_outer_tc16 --launch-skip 1 --launch-count 1 -f -o "$R/cluster2" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section SourceCounters --section LaunchStats --section Occupancy $py "$R/tc16_one.py"
  T ncu_cluster2_details 60 ncu --import "$R/cluster2.ncu-rep" --page details
  # stall samples by SASS line, to place the barrier waits
  T ncu_cluster2_sass 60 ncu --import "$R/cluster2.ncu-rep" --page source --print-source sass --csv
  exit 0
fi

if [ "$PHASE" = clusters ]; then
  # the 16-bit kernel's clustered forms (FLASHOPM_TC16_CLUSTER=2, 4): their bits against the
  # default form's (a hang shows as the step's timeout), each paired against it at N = 1536 and
  # 768 in bfloat16, each convention's time by kernel in clusters of four, then the default form
  # and clusters of four under Nsight Compute: L2 traffic and throughput, the tensor pipe, stalls
  # (~9 min with the build)
  T t_clusters 180 $py -m pytest -x -q -p no:cacheprovider tests/test_cuda.py -k "cluster_form or tc16_conventions" || exit 1  # (a hang: stop here)
  T ab_cluster4 90 $py scripts/ab_env.py FLASHOPM_TC16_CLUSTER=4 1,512,1536,256,32,128 1,512,768,256,32,128 --dtype bfloat16 --mode forward --calls 8
  T ab_cluster2 90 $py scripts/ab_env.py FLASHOPM_TC16_CLUSTER=2 1,512,1536,256,32,128 1,512,768,256,32,128 --dtype bfloat16 --mode forward --calls 8
  T conv_clusters 90 env FLASHOPM_TC16_CLUSTER=4 $py scripts/convention_times.py 1536 row openfold boltz bfloat16 kernels
  ncu_tc16 1 4
  exit 0
fi

if [ "$PHASE" = land ]; then
  # before landing a stack of branches: every test file, issue 6's bfloat16 rows per convention
  # beside eager and torch.compile, then the default 16-bit form and clusters of four under Nsight
  # Compute (~9 min with the build)
  T t_all 330 $py -m pytest -q -p no:cacheprovider tests
  T bench_bf16 90 $py -m flashopm bench --shapes "1,512,1536,256,32,128" --dtype bfloat16 \
    --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/bench_bf16"
  for mod in openfold boltz; do
    T "mod_${mod}_bf16" 90 $py -m flashopm bench --module $mod --shapes "1,512,1536,256,32,128" \
      --dtype bfloat16 --impls eager,flashopm,compile,flashopm-bounded --calls 5 --out "$R/mod_${mod}_bf16"
  done
  ncu_tc16 1 4
  exit 0
fi

if [ "$PHASE" = ncu_clusters ]; then
  # the default 16-bit form and both clustered sizes under Nsight Compute, nothing else (~6 min
  # with the build)
  ncu_tc16 1 2 4
  exit 0
fi

if [ "$PHASE" = final ]; then
  # every figure of issues 4 and 6 (the deep MSAs over 20 calls), then the forward-side test files,
  # in one call (~8 min with the build; every step runs whatever the one before gave)
  T t_waves 60 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  bench_deep
  bench_f32
  bench_bf16
  bench_modules
  bench_8192
  other_forward_tests
  exit 0
fi

if [ "$PHASE" = trace ]; then
  # the waves form's trace points per part and wave at both deep MSAs, with the automatic buffers and
  # with two; its tests; then the bench of the deep MSAs beside eager
  T trace_auto 90 $py scripts/waves_trace.py 1,1024,256,64,32,128 1,5120,384,64,32,128 --out "$R/trace_auto"
  T t_waves 60 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  T bench_deep 120 $py -m flashopm bench --shapes "1,1024,256,64,32,128;1,5120,384,64,32,128" \
    --impls eager,flashopm,flashopm-bounded --calls 20 --out "$R/bench_deep"
  exit 0
fi

if [ "$PHASE" = waves_min ]; then
  # the shortest check of the waves form: its tests and the fused projection's, the bench beside
  # eager and the default, two buffers against the automatic choice
  T t_waves 60 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  T t_fused 40 $py -m pytest -q -p no:cacheprovider tests/test_fused_projection.py
  T bench_waves 90 $py -m flashopm bench --shapes "1,1024,256,64,32,128;1,5120,384,64,32,128" \
    --impls eager,flashopm,flashopm-bounded --calls 10 --out "$R/bench_waves"
  T ab_BUFS_2 25 $py scripts/ab_env.py FLASHOPM_WAVES=1,FLASHOPM_WAVES_BUFS=2 1,1024,256,64,32,128 --mode forward --calls 6
  exit 0
fi

if [ "$PHASE" = waves_tc ]; then
  # the waves form and the fused projection (which share the projection on mma.sync): their tests,
  # the bench beside eager and the default, each step left out, the parts' cost; then test_cuda
  T t_waves 60 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
  T t_fused 40 $py -m pytest -q -p no:cacheprovider tests/test_fused_projection.py
  T bench_waves 200 $py -m flashopm bench --shapes "1,1024,256,64,32,128;1,5120,384,64,32,128" \
    --impls eager,flashopm,compile,flashopm-bounded --calls 10 --out "$R/bench_waves"
  for v in BUFS=2 BUFS=1 SKIP=1 SKIP=2 WS=200000000 OUT=0; do
    T "ab_${v//=/_}" 25 $py scripts/ab_env.py FLASHOPM_WAVES=1,FLASHOPM_WAVES_$v 1,1024,256,64,32,128 --mode forward --calls 6
  done
  T t_cuda 60 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
  exit 0
fi

if [ "$PHASE" = rest ]; then
  # what phase 1 costs per s and what does not scale with s, at the deep MSAs' width (C = 64)
  T kt_deep 90 $py scripts/kernel_times.py forward float32 1,32,256,64,32,128 1,256,256,64,32,128 \
    1,1024,256,64,32,128 1,2048,256,64,32,128
  # run 300's 'all' ran out of time in test_distributed (everything before it passed)
  T t_rest 300 $py -m pytest -q -p no:cacheprovider tests/test_distributed.py tests/test_launch.py \
    tests/test_modules.py tests/test_peak_plan.py tests/test_python_entry.py tests/test_reference.py \
    tests/test_rows.py tests/test_validation.py
  exit 0
fi

if [ "$PHASE" = default ]; then
  T code 60 $py -c "$device_code" || exit 1
  T t_arch 60 $py -m pytest -x -q tests/test_build.py -k "kernels_use or without_the_toolkit" || exit 1
  T t_smem 240 $py -m pytest -x -q tests/test_smaller_gpus.py
  T t_new 150 $py -m pytest -x -q tests/test_autograd.py -k "g_split_once or strided_grad_out or w_kernel_overlap or dynamic or export"
  T t_replace 90 $py -m pytest -x -q tests/test_replace.py tests/test_autograd.py -k "replace or create_graph or checkpointing"
  exit 0
fi

# 0n's (1) again first: its forms' bits must hold before they are timed
T t_new 150 $py -m pytest -q tests/test_autograd.py -k "g_split_once or strided_grad_out or w_kernel_overlap or dynamic or export"
S="1,128,256,256,32,128 1,512,256,256,32,128"
B=FLASHOPM_SIDE_G_SPLIT=1,FLASHOPM_W_OVERLAP=1
T ab_side 60 $py scripts/ab_env.py FLASHOPM_SIDE_G_SPLIT=1 $S --calls 10
T ab_overlap 60 $py scripts/ab_env.py FLASHOPM_W_OVERLAP=1 $S --calls 10
T ab_both 60 $py scripts/ab_env.py $B $S --calls 10
T ab_both_high 60 $py scripts/ab_env.py $B $S --precision high --calls 10
FLASHOPM_SIDE_G_SPLIT=1 FLASHOPM_W_OVERLAP=1 T kt_both 60 $py scripts/kernel_times.py training float32 1,128,256,256,32,128
T t_bwd 120 $py -m pytest -q tests/test_autograd.py tests/test_backward.py tests/test_ln_backward.py
