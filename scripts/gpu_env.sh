# Sourced by the GPU scripts: run from the repository root with the package on the path, build in
# parallel into a cache inside the checkout, and record the machine and a first build in DIR.
#   usage: . scripts/gpu_env.sh DIR      (sets $py; returns non-zero when the build fails)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}"
export FLASHOPM_CACHE_DIR="${FLASHOPM_CACHE_DIR:-$PWD/.cache/flashopm}"
py=${PYTHON:-python3}
{ nvidia-smi; $py -m flashopm info; } >"$1/env.txt" 2>&1
( time $py -c "import flashopm._build as b; print(b.load())" ) >"$1/build.log" 2>&1
