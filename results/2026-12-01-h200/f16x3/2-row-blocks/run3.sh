#!/usr/bin/env bash
# Every test file on the float16 split form, the conventions' epilogue cost and the spec shape's paths.
set -u
out=${1:?}; mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export MAX_JOBS=16 PYTHONUNBUFFERED=1 FLASHOPM_CACHE_DIR=/tmp/fcache PYTHONPATH=$PWD/src
py=python3
$py -c "import flashopm._build as b; b.load()" >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "built ($SECONDS s)"
timeout 200 $py -m pytest -q -rfE tests/test_cuda.py >"$out/tests_cuda.log" 2>&1
echo "test_cuda: $(tail -1 "$out/tests_cuda.log")"; grep -E "^FAILED|^ERROR" "$out/tests_cuda.log" | head -30
slow="tests/test_backward.py tests/test_ln_backward.py tests/test_distributed.py"
timeout 150 $py -m pytest -q -rfE tests $(printf -- '--ignore %s ' tests/test_cuda.py $slow) >"$out/tests_other.log" 2>&1
echo "other tests: $(tail -1 "$out/tests_other.log")"; grep -E "^FAILED|^ERROR" "$out/tests_other.log" | head
timeout 60 $py scripts/convention_times.py 384 1536 row openfold boltz 2>&1 | grep -v Warn | tail -8
timeout 40 $py scripts/spec_paths.py 2>&1 | grep -v Warn | tail -12
timeout 280 $py -m pytest -q -rfE $slow >"$out/tests_slow.log" 2>&1
echo "backward, LayerNorm backward, distributed: $(tail -1 "$out/tests_slow.log")"; grep -E "^FAILED|^ERROR" "$out/tests_slow.log" | head
echo "done ($SECONDS s)"
