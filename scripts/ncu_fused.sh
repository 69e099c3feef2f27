#!/usr/bin/env bash
# A deep-MSA form's contraction under Nsight Compute at (1,1024,256,64,32,128): throughput against
# the ceilings, memory traffic by level, warp stalls and the instructions they sit on.  FORM: fused
# (FLASHOPM_FUSED_PROJECTION=1, the default) or waves (FLASHOPM_WAVES=1, the memory bound's form).
#   usage: scripts/ncu_fused.sh OUTDIR [fused|waves]
OUT=${1:?usage: scripts/ncu_fused.sh OUTDIR [fused|waves]}
FORM=${2:-fused}
case "$FORM" in fused) SETTING=FLASHOPM_FUSED_PROJECTION=1 ;; waves) SETTING=FLASHOPM_WAVES=1 ;;
  *) echo "FORM must be fused or waves, got '$FORM'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src MAX_JOBS=16 FLASHOPM_CACHE_DIR=$PWD/.cache/flashopm FLASHOPM_SPLIT_COMPILE=1
mkdir -p "$OUT"
python -c "import flashopm._build as b; print(b.load())" > "$OUT/build.log" 2>&1
cat > /tmp/fused_one.py <<'PY'
import torch, flashopm
from flashopm.testing import PARAM_ORDER, Shape, make_problem
x, m, p = make_problem(Shape(1, 1024, 256, 64, 32, 128), "masked_positions", seed=1)
x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
for _ in range(2):
    flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer", precision="highest")
torch.cuda.synchronize()
PY
env $SETTING timeout 240 ncu --clock-control none -k regex:opm_outer_tc_kernel --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
  python /tmp/fused_one.py > "$OUT/ncu_$FORM.txt" 2>&1
echo "ncu rc=$?" >> "$OUT/ncu_$FORM.txt"
