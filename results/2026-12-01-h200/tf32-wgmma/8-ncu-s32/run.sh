#!/usr/bin/env bash
# Nsight Compute of the float32 tensor-core kernel at S = 32 (what does not scale with S), "highest"
# and "high", (1,32,1536,256,32,128).
set -u
out=${1:?}; mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/gpu_env.sh "$out" || exit 1
echo "built ($SECONDS s)"
secs="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SourceCounters"
for prec in highest high; do
  timeout 100 ncu -k regex:opm_outer_tc -c 1 $secs --print-summary none \
    $py scripts/profile_outer.py 1,32,1536,256,32,128 outer $prec > "$out/ncu_$prec.txt" 2>&1
  echo "== $prec ($SECONDS s)"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Issued Warp|No Eligible|Stall" "$out/ncu_$prec.txt" | head -12
done
echo "done ($SECONDS s)"
