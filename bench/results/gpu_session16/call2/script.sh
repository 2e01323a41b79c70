set -u
mkdir -p /tmp/s && tar -xzf .snap/tree.tgz -C /tmp/s && cd /tmp/s
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/ops:/tmp/s/.dsdist NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O; { date -u; nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv; lscpu | grep -i numa; } > $O/host.txt 2>&1
timeout 330 python3 bench/vs_deepspeed.py --matrix issue31 --nproc 4 --only z2_bf16_ga1_off-opt z3_bf16_ga1_off-both --impls fsdpzero deepspeed --out $O/vs31off --budget-s 260 --run-timeout 150 > $O/vs31off.log 2>&1
tail -28 $O/vs31off.log
timeout 250 python3 bench/zenflow.py --nproc 4 --configs zenflow_ours,zenflow_ds --out $O/zf4 --budget-s 190 > $O/zf4.log 2>&1
tail -12 $O/zf4.log
tar -czf $OUT/b.tgz -C $O .
