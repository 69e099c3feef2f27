#!/usr/bin/env bash
# Nsight Compute of the small path's two kernels (LayerNorm/projection, then opm_small_f16_kernel
# or opm_small_tc_kernel) at one shape, warm caches: the warp-state sections with their details,
# the raw stall-reason and shared-memory metrics, and the second kernel's per-instruction stall
# samples, summarised by scripts/ncu_source_summary.py into the stretches between its block
# barriers (its phases).
#   usage: scripts/ncu_small_tc.sh OUTDIR [B,S,N,C,H,D]      (default: the specification's shape)
out=$(mkdir -p "${1:?usage: scripts/ncu_small_tc.sh OUTDIR [B,S,N,C,H,D]}" && cd "$1" && pwd) || exit 1
shape=${2:-2,8,32,64,32,64}
. "$(dirname "$0")/gpu_env.sh" "$out" || { tail -5 "$out/build.log"; exit 1; }
prog="$out/one_call.py"
cat >"$prog" <<PY
import torch, flashopm
B, S, N, C, H, D = ($shape)
torch.manual_seed(0)
model = flashopm.ModelNew(C, D, H).cuda()
x = torch.randn(B, S, N, C, device="cuda")
mask = (torch.rand(B, S, N, device="cuda") > 0.2).float()
with torch.no_grad():
    for _ in range(5):
        model(x, mask)
torch.cuda.synchronize()
PY
# Calls 4 and 5 of the program (two kernels each): warm caches, clocks as the GPU sets them.
common=(--clock-control none --cache-control none -k regex:opm_ --launch-skip 6 --launch-count 2)
ncu "${common[@]}" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis_Tables --section InstructionStats --section LaunchStats \
    --section Occupancy --print-details all $py "$prog" >"$out/sections.txt" 2>&1
ncu "${common[@]}" --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$" \
    $py "$prog" >"$out/stall_reasons.txt" 2>&1
ncu "${common[@]}" --metrics smsp__inst_executed.sum,sm__sass_thread_inst_executed_op_ffma_pred_on.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum \
    $py "$prog" >"$out/counts.txt" 2>&1
ncu --clock-control none --cache-control none -k "regex:opm_small_(tc|f16)" --launch-skip 3 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    $py "$prog" >"$out/source_sass.csv" 2>"$out/source_sass.err"
$py scripts/ncu_source_summary.py "$out/source_sass.csv" >"$out/source_summary.txt" 2>&1
grep -E "opm_|Duration|stalled_|inst_executed|wavefronts|bank_conflicts" "$out/stall_reasons.txt" "$out/counts.txt" | head -80
head -40 "$out/source_summary.txt"
