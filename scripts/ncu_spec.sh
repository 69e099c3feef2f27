#!/usr/bin/env bash
# Spec shape under Nsight Compute (cold and warm caches), the SASS size of every kernel, and wall
# time with and without an L2 flush.   usage: scripts/ncu_spec.sh OUTDIR
OUT=${1:?usage: scripts/ncu_spec.sh OUTDIR}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src MAX_JOBS=16 FLASHOPM_CACHE_DIR=$PWD/.cache/flashopm
python -c "import flashopm._build as b; print(b.load())" > $OUT/build.log 2>&1
so=$(ls .cache/flashopm/*/*.so | head -1); d=$(dirname $so)
cuobjdump -sass $d/cuda.cuda.o > /tmp/sass.txt 2>&1
awk '/Function :/{name=$3} /\/\*[0-9a-f]+\*\/ +[A-Z@]/{n[name]++} END{for(k in n) print n[k], k}' /tmp/sass.txt | sort -n > $OUT/sass_sizes.txt
grep -n "Function" /tmp/sass.txt | head -50 >> $OUT/sass_sizes.txt
python scripts/spec_cold.py > $OUT/cold.log 2>&1
cat > /tmp/one.py <<'PY'
import torch, flashopm
torch.manual_seed(0)
m = flashopm.ModelNew(64, 64, 32).cuda()
x = torch.randn(2, 8, 32, 64, device="cuda"); k = (torch.rand(2, 8, 32, device="cuda") > 0.2).float()
with torch.no_grad():
    for _ in range(5): m(x, k)
torch.cuda.synchronize()
PY
for cc in all none; do
ncu --clock-control none --cache-control $cc -k regex:opm_small --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters python /tmp/one.py > $OUT/ncu_$cc.txt 2>&1
done
tail -5 $OUT/cold.log; grep -i "duration\|Stall\|Elapsed Cycles\|Issued" $OUT/ncu_all.txt | head -30
