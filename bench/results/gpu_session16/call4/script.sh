set -u
mkdir -p /tmp/s && tar -xzf .snap/tree.tgz -C /tmp/s && cd /tmp/s
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/ops:/tmp/s/.dsdist NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O; { date -u; nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv; lscpu | grep -i numa; } > $O/host.txt 2>&1
timeout 430 python3 bench/ulysses.py --nproc 4 --sp 4 --impls fsdpzero_sp zero3 deepspeed_alst --seq-start 131072 --seq-max 1048576 --budget 260 --run-timeout 140 --out $O/ulysses > $O/ulysses.log 2>&1
tail -14 $O/ulysses.log
tar -czf $OUT/d.tgz -C $O .
