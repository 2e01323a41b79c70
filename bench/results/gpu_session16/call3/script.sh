set -u
mkdir -p /tmp/s && tar -xzf .snap/tree.tgz -C /tmp/s && cd /tmp/s
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/ops:/tmp/s/.dsdist NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O; { date -u; nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv; lscpu | grep -i numa; } > $O/host.txt 2>&1
timeout 230 python3 bench/zenflow.py --nproc 4 --configs muon_z2_ours,adamw_z2_ours,muon_z2_ds --out $O/mu4 --budget-s 170 > $O/mu4.log 2>&1
tail -6 $O/mu4.log
timeout 170 python3 bench/multinode.py --out $O/multinode --run-timeout 70 > $O/multinode.log 2>&1
tail -14 $O/multinode.log
OUT=$O/suite timeout 130 bash bench/gpu_suite.sh --deepspeed -- --lanes 1 --deadline 120 zenflow_muon > $O/suite.log 2>&1
tail -8 $O/suite.log
tar -czf $OUT/c.tgz -C $O .
