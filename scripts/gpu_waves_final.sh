# The waves form's checks in one short call, most needed first: its tests, the test files of the
# kernels it touched, the bench CLI beside eager, then where its time goes (each step left out,
# the parts' cost), then the conventions' files.  Logs in OUT/r, packed into OUT/r.tgz after each step.
#   usage: [DEST=DIR] bash scripts/gpu_waves_final.sh OUTDIR   (DEST: where r.tgz is also copied)
OUT=$1
R=$OUT/r
mkdir -p "$R"
pack() { tar -C "$OUT" -czf "$OUT/r.tgz" r; [ -n "$DEST" ] && cp "$OUT/r.tgz" "$DEST/"; }
export FLASHOPM_SPLIT_COMPILE=1
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "$R" || { pack; exit 1; }
export PYTHONPATH="$PYTHONPATH:$PWD/scripts"
T() {
  local n=$1 t=$2
  shift 2
  (time timeout "$t" "$@") >"$R/$n.log" 2>&1
  echo "$n rc=$?" >>"$R/steps.txt"
  pack
}
T t_waves 60 $py -m pytest -q -p no:cacheprovider tests/test_waves.py
T t_cuda 60 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
T t_fused 40 $py -m pytest -q -p no:cacheprovider tests/test_fused_projection.py
T bench_waves 60 $py -m flashopm bench --shapes "1,1024,256,64,32,128;1,5120,384,64,32,128" \
  --impls eager,flashopm,flashopm-bounded --calls 10 --out "$R/bench_waves"
for v in SKIP=1 SKIP=2 SKIP=4 WS=200000000 OUT=0; do
  T "ab_${v//=/_}" 25 $py scripts/ab_env.py FLASHOPM_WAVES=1,FLASHOPM_WAVES_$v 1,1024,256,64,32,128 --mode forward --calls 6
done
T t_conv 90 $py -m pytest -q -p no:cacheprovider tests/test_conventions.py tests/test_modules.py
