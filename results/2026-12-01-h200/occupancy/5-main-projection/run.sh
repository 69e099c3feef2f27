#!/usr/bin/env bash
# Main with the projection kernel at three blocks per SM: test_cuda, the bfloat16 benchmark beside
# eager and torch.compile, then the other test files (till the time runs out).
set -u
O=$OUT; R=$O/res; mkdir -p "$R"
cd "$(dirname "$0")/.."
start=$SECONDS
pack() { tar -C "$O" -czf "$O/run.tgz" res; }
trap pack EXIT
log() { echo "[$((SECONDS - start)) s] $*" | tee -a "$O/summary.txt"; }
. scripts/gpu_env.sh "$R" || { log "build failed"; tail -20 "$R/build.log" >> "$O/summary.txt"; exit 1; }
log "built"
$py -m pytest -q -rfEs tests/test_cuda.py > "$R/tests_cuda.log" 2>&1
log "test_cuda: $(tail -1 $R/tests_cuda.log)"
$py -m flashopm bench --dtype bfloat16 --shapes "1,512,768,256,32,128;1,512,1536,256,32,128" \
  --impls eager,flashopm,compile --calls 3 --fp64-max-n 0 --out "$R/bf16" > "$R/bench_bf16.log" 2>&1
log "bench bf16"; grep -v -i warn "$R/bench_bf16.log" | grep -E "^B1_|ceil" >> "$O/summary.txt"
timeout $((400 - (SECONDS - start))) $py -m pytest -q -rfEs tests/test_modules.py tests/test_conventions.py tests/test_validation.py tests/test_autograd.py tests/test_rows.py > "$R/tests_other.log" 2>&1
log "other tests (rc $?): $(tail -1 $R/tests_other.log)"
