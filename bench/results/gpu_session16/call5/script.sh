set -u
mkdir -p /tmp/s && tar -xzf .snap/tree.tgz -C /tmp/s && cd /tmp/s
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/ops:/tmp/s/.dsdist NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O; { date -u; nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv; lscpu | grep -i numa; } > $O/host.txt 2>&1
timeout 290 python3 bench/ulysses.py --nproc 4 --sp 4 --impls zero3 fsdpzero_sp deepspeed_alst --seq-start 524288 --seq-max 524288 --budget 140 --run-timeout 130 --out $O/ulysses524 > $O/ulysses524.log 2>&1
tail -8 $O/ulysses524.log
tar -czf $OUT/e.tgz -C $O .
