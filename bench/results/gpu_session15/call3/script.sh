set -u
mkdir -p /tmp/s && tar -xzf .snap/tree.tgz -C /tmp/s && cd /tmp/s
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/ops:/tmp/s/.dsdist NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
O=/tmp/o; mkdir -p $O
timeout 265 python3 bench/vs_deepspeed.py --matrix issue31 --nproc 2 --out $O/vs31 --only z2_bf16_ga1_off-opt z3_bf16_ga1_off-both --impls fsdpzero deepspeed --budget-s 240 --run-timeout 200 > $O/vs31c.log 2>&1
cat $O/vs31/summary.md | head -8
timeout 260 python3 bench/zenflow.py --nproc 2 --configs adamw_z2_ours,muon_z2_ours,muon_z2_ds --out $O/muon2 --budget-s 240 > $O/muon2.log 2>&1
tail -6 $O/muon2.log; grep -i -m5 "error\|Traceback" $O/muon2/*.log
tar -czf $OUT/c.tgz -C $O .
