#!/usr/bin/env bash
# Nsight Compute of the float16 split form: S = 512 (N = 768) and S = 32 (N = 1536).
set -u
out=${1:?}; mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export MAX_JOBS=16 PYTHONUNBUFFERED=1 FLASHOPM_CACHE_DIR=/tmp/fcache PYTHONPATH=$PWD/src
py=python3
$py -c "import flashopm._build as b; b.load()" >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "built ($SECONDS s)"
secs="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section SourceCounters"
for shape in 1,512,768,256,32,128 1,32,1536,256,32,128; do
  timeout 130 ncu -k regex:opm_outer_tc -c 1 $secs --print-summary none \
    $py scripts/profile_outer.py $shape outer highest > "$out/ncu_${shape//,/_}.txt" 2>&1
  echo "== $shape ($SECONDS s)"; grep -E "Shared Excessive|Global Excessive|Wavefronts|Duration|Compute \(SM\) Throughput|Memory Throughput|Issued Warp|No Eligible|Registers|Bank|Excessive|Stall" "$out/ncu_${shape//,/_}.txt" | head -24
done
echo "done ($SECONDS s)"
