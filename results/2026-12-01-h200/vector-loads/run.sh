#!/usr/bin/env bash
# main's unrun commits on the GPU, then the vector-load projection against main in bfloat16.
set -u
out=${1:?}; mkdir -p "$out"
cd "$(dirname "$0")/.."
export MAX_JOBS=16 PYTHONUNBUFFERED=1
py=python3
nvidia-smi > "$out/env.txt" 2>&1
for n in cur vec; do
  rm -rf /tmp/ab-$n; mkdir -p /tmp/ab-$n; cp -r src /tmp/ab-$n/
  [ $n = vec ] && cp ab/vec/* /tmp/ab-$n/src/flashopm/csrc/
  ( FLASHOPM_CACHE_DIR=/tmp/ab-cache-$n PYTHONPATH=/tmp/ab-$n/src $py -c "import flashopm._build as b; b.load()" > "$out/build_$n.log" 2>&1 ) &
done
wait
tail -2 "$out"/build_*.log
E="FLASHOPM_CACHE_DIR=/tmp/ab-cache-cur PYTHONPATH=/tmp/ab-cur/src"
env $E timeout 200 $py -m pytest -q -x tests/test_ln_backward.py tests/test_backward.py tests/test_autograd.py > "$out/tests_cur_bwd.log" 2>&1
echo "cur bwd: $(tail -1 $out/tests_cur_bwd.log)"
env FLASHOPM_CACHE_DIR=/tmp/ab-cache-vec PYTHONPATH=/tmp/ab-vec/src timeout 150 $py -m pytest -q -x tests/test_cuda.py -k "tiled or project or half or bfloat16" > "$out/tests_vec.log" 2>&1
echo "vec cuda subset: $(tail -1 $out/tests_vec.log)"
for round in 1 2; do
  for n in cur vec; do
    env FLASHOPM_CACHE_DIR=/tmp/ab-cache-$n PYTHONPATH=/tmp/ab-$n/src $py scripts/ab_time.py $n 1,512,1536,256,32,128 1,512,768,256,32,128 2>&1 | grep -v Warn | tee -a "$out/ab.log"
  done
done
env FLASHOPM_CACHE_DIR=/tmp/ab-cache-vec PYTHONPATH=/tmp/ab-vec/src $py scripts/kernel_times.py forward bfloat16 1,512,1536,256,32,128 > "$out/kernel_times_vec.log" 2>&1
grep -i -m3 "project" "$out/kernel_times_vec.log"
env FLASHOPM_CACHE_DIR=/tmp/ab-cache-cur PYTHONPATH=/tmp/ab-cur/src timeout 150 $py -m pytest -q tests/test_cuda.py > "$out/tests_cur_cuda.log" 2>&1
echo "cur cuda: $(tail -1 $out/tests_cur_cuda.log)"
