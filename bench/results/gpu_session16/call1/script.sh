set -u
mkdir -p /tmp/s && tar -xzf .snap/tree.tgz -C /tmp/s && cd /tmp/s
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/ops:/tmp/s/.dsdist NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O; { date -u; nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv; lscpu | grep -i numa; } > $O/host.txt 2>&1
cp .snap/a.sh $O/script.sh
timeout 570 python3 bench/vs_deepspeed.py --matrix issue31 --nproc 4 --out $O/vs31 --budget-s 470 --run-timeout 240 > $O/vs31.log 2>&1
tail -40 $O/vs31.log
tar -czf $OUT/a.tgz -C $O .
