R=$OUT/r; mkdir -p $R
pack() { tar -C $OUT -czf $OUT/r.tgz r; }
export FLASHOPM_SPLIT_COMPILE=1
. scripts/gpu_env.sh $R || { pack; exit 1; }
export PYTHONPATH="$PYTHONPATH:$PWD/scripts"
T() { local n=$1 t=$2; shift 2; ( time timeout $t "$@" ) > $R/$n.log 2>&1; echo "$n rc=$?" >> $R/steps.txt; pack; }
T kt_high_fused 60 env PRECISION=high FLASHOPM_BACKWARD_BLOCKS=0 $py scripts/kernel_times.py training float32 1,512,256,256,32,128 1,128,256,256,32,128
T kt_high_blocks 60 env PRECISION=high $py scripts/kernel_times.py training float32 1,512,256,256,32,128
T kt_highest 60 $py scripts/kernel_times.py training float32 1,512,256,256,32,128
T kt_bf16 60 $py scripts/kernel_times.py training bfloat16 1,512,256,256,32,128 1,128,256,256,32,128
pack
