#!/usr/bin/env bash
# Nsight Compute of the fused backward's two contraction kernels (opm_bwd_side_kernel,
# opm_bwd_w_kernel) in a float32 training step, warm caches: the stall reasons per issued
# instruction and the pipes' utilisation of one launch of each, and each kernel's per-instruction
# stall samples, summarised by scripts/ncu_source_summary.py.
#   usage: scripts/ncu_backward.sh OUTDIR [B,S,N,C,H,D]      (default: the training crop)
out=$(mkdir -p "${1:?usage: scripts/ncu_backward.sh OUTDIR [B,S,N,C,H,D]}" && cd "$1" && pwd) || exit 1
shape=${2:-1,128,256,256,32,128}
. "$(dirname "$0")/gpu_env.sh" "$out" || { tail -5 "$out/build.log"; exit 1; }
prog=(scripts/ncu_backward_step.py "$shape")
# the second step's launches (grad_a's side, grad_b's side, W), after the first step's three
stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard short_scoreboard \
  wait math_pipe_throttle barrier mio_throttle not_selected selected dispatch_stall lg_throttle no_instruction)
ncu --clock-control none --cache-control none -k regex:opm_bwd --launch-skip 3 --launch-count 3 \
  --metrics "${stalls}sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active" \
  $py "${prog[@]}" >"$out/stalls.txt" 2>&1
for k in opm_bwd_side opm_bwd_w; do
  ncu --clock-control none --cache-control none -k regex:$k --launch-skip 3 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    $py "${prog[@]}" >"$out/source_$k.csv" 2>"$out/source_$k.err"
  $py scripts/ncu_source_summary.py "$out/source_$k.csv" >"$out/source_summary_$k.txt" 2>&1
  gzip -f "$out/source_$k.csv"
done
