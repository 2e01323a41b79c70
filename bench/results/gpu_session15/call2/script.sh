set -u
mkdir -p /tmp/s && tar -xzf .snap/tree.tgz -C /tmp/s && cd /tmp/s
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/ops:/tmp/s/.dsdist NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 265 python3 bench/vs_deepspeed.py --matrix issue31 --nproc 2 --out $OUT/vs31 --only z2_bf16_ga1_off-opt z3_bf16_ga1_off-both --impls fsdpzero deepspeed --budget-s 235 --run-timeout 200 > $OUT/vs31b.log 2>&1
grep -A12 "^### " $OUT/vs31b.log | grep -v "^$"; tail -3 $OUT/vs31b.log
timeout 300 python3 bench/zenflow.py --nproc 2 --configs zenflow_ours,offload_ours,zenflow_ds --out $OUT/zenflow2 --budget-s 270 > $OUT/zenflow2.log 2>&1
tail -15 $OUT/zenflow2.log
