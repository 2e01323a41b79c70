set -u
mkdir -p /tmp/s && tar -xzf .snap/tree.tgz -C /tmp/s && cd /tmp/s
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/ops:/tmp/s/.dsdist NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O; nproc; free -g | head -2; cat /sys/kernel/mm/transparent_hugepage/enabled
timeout 560 python3 bench/zenflow.py --configs zenflow_ours,offload_ours,zenflow_ds --out $O/zf28 --budget-s 530 > $O/zf28.log 2>&1
tail -5 $O/zf28.log
tar -czf $OUT/d.tgz -C $O .
