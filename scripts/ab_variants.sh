#!/usr/bin/env bash
# Kernel variants side by side on one GPU: each variant's CUDA sources in their own copy of the
# package and build cache, test_cuda on each, then scripts/ab_time.py for each variant in turn,
# twice over (so that drift shows).  A variant is `cur` (the working tree) or a directory of files
# that replace src/flashopm/csrc/*, e.g. the sources of an earlier commit:
#     mkdir -p ab/old && git archive REV src/flashopm/csrc | tar -x --strip-components=3 -C ab/old
#   usage: scripts/ab_variants.sh OUTDIR VARIANT... (ab_time.py's shapes and options in AB_TIME_ARGS)
# AB_PACK=1: the build and test logs end up in OUTDIR/ab_logs.tgz, beside ab.log
# (for machines that return only a few files).
# AB_TESTS: pytest's arguments for each variant (default: tests/test_cuda.py).
# AB_KERNEL_TIMES: arguments of scripts/kernel_times.py, one set per ';', run for each variant into
# OUTDIR/kernel_times_VARIANT.log (e.g. "forward bfloat16 1,512,1536,256,32,128; training float32
# 1,128,256,256,32,128").  AB_TIME=0 skips ab_time.py.
set -u
out=${1:?usage: scripts/ab_variants.sh OUTDIR VARIANT...}; shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
name() { basename "$1"; }
for v in "$@"; do
  n=$(name "$v"); rm -rf "/tmp/ab-$n"; mkdir -p "/tmp/ab-$n"; cp -r src "/tmp/ab-$n/"
  [ "$v" != cur ] && cp "$v"/* "/tmp/ab-$n/src/flashopm/csrc/"
  ( FLASHOPM_CACHE_DIR="/tmp/ab-cache-$n" PYTHONPATH="/tmp/ab-$n/src" $py -c "import flashopm._build as b; b.load()" \
      >"$out/build_$n.log" 2>&1 ) &
done
wait
for v in "$@"; do
  n=$(name "$v")
  FLASHOPM_CACHE_DIR="/tmp/ab-cache-$n" PYTHONPATH="/tmp/ab-$n/src" $py -m pytest -q -x ${AB_TESTS:-tests/test_cuda.py} \
    >"$out/tests_$n.log" 2>&1
  echo "$n: $(tail -1 "$out/tests_$n.log")"
done
if [ -n "${AB_KERNEL_TIMES:-}" ]; then
  for v in "$@"; do
    n=$(name "$v")
    IFS=';' read -ra sets <<<"$AB_KERNEL_TIMES"
    for args in "${sets[@]}"; do
      FLASHOPM_CACHE_DIR="/tmp/ab-cache-$n" PYTHONPATH="/tmp/ab-$n/src" $py scripts/kernel_times.py $args 2>&1 |
        grep -v Warning >>"$out/kernel_times_$n.log"
    done
    echo "$n: kernel_times_$n.log"
  done
fi
[ "${AB_TIME:-1}" = 0 ] && set --
for round in 1 2; do
  for v in "$@"; do
    n=$(name "$v")
    FLASHOPM_CACHE_DIR="/tmp/ab-cache-$n" PYTHONPATH="/tmp/ab-$n/src" $py scripts/ab_time.py "$n" ${AB_TIME_ARGS:-} 2>&1 |
      grep -v Warning | tee -a "$out/ab.log"
  done
done
if [ "${AB_PACK:-0}" = 1 ]; then
  (cd "$out" && tar -czf ab_logs.tgz build_*.log tests_*.log && rm -f build_*.log tests_*.log)
fi
