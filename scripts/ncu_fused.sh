#!/usr/bin/env bash
# The fused projection's contraction (FLASHOPM_FUSED_PROJECTION=1) under Nsight Compute at
# (1,1024,256,64,32,128): throughput against the ceilings, memory traffic by level, warp stalls and
# the instructions they sit on.   usage: scripts/ncu_fused.sh OUTDIR
OUT=${1:?usage: scripts/ncu_fused.sh OUTDIR}
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
FLASHOPM_FUSED_PROJECTION=1 timeout 240 ncu --clock-control none -k regex:opm_outer_tc_kernel --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
  python /tmp/fused_one.py > "$OUT/ncu_fused.txt" 2>&1
echo "ncu rc=$?" >> "$OUT/ncu_fused.txt"
