set -u
mkdir -p /tmp/s && tar -xzf .snap/tree.tgz -C /tmp/s && cd /tmp/s
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/ops:/tmp/s/.dsdist NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
python3 -c "import torch,transformers,accelerate;print(torch.__version__,transformers.__version__,accelerate.__version__)"
timeout 550 python3 bench/vs_deepspeed.py --matrix issue31 --nproc 2 --out $OUT/vs31 --budget-s 470 --run-timeout 240 > $OUT/vs31.log 2>&1
tail -40 $OUT/vs31.log
