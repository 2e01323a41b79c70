#!/usr/bin/env bash
# One device call of the GPU suite (tests/gpu_chunks.py) on a lent GPU host, as run for BENCHMARKS.md "GPU test runs".
#
#   bash bench/gpu_suite.sh [--hf 2,4] [--deepspeed] -- <tests/gpu_chunks.py arguments>
#
# The GPU image lacks pydantic (and DeepSpeed): wheels carried in .whl/ are installed into /tmp/site; with
# --deepspeed, DeepSpeed's pure-Python package copied into .dsdist/ (from a DS_BUILD_OPS=0 install) goes on the path
# (its ops JIT-build there). --hf N,M also runs the unchanged HF Trainer script under `fsdpzero launch --num_gpus N`
# (NCCL, ZeRO-3 with CPU offload, no DeepSpeed on the path). Logs go to $OUT (or out/gpu_suite) as one tarball.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-out/gpu_suite}
mkdir -p "$OUTDIR"
HF="" DS=0
while [[ $# -gt 0 && $1 != "--" ]]; do
  case $1 in
    --hf) HF=$2; shift 2 ;;
    --deepspeed) DS=1; shift ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
done
[[ ${1:-} == "--" ]] && shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/ops   # fsdpzero_ops from the checkout too
LOGS=$(mktemp -d)
{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nproc; free -g | head -2
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl',
'.'.join(map(str, torch.cuda.nccl.version())), 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$LOGS/env.txt"
if [[ -n $HF ]]; then
  for n in ${HF//,/ }; do
    t0=$(date +%s)
    timeout 300 python3 -m fsdpzero.cli.main launch --num_gpus "$n" examples/hf_trainer_deepspeed.py \
      --deepspeed tests/ds_configs/hf_transformers_zero3.json --output_dir "/tmp/hf$n" >"$LOGS/hf_launch_$n.log" 2>&1
    rc=$?
    echo "hf launch --num_gpus $n: rc $rc, $(( $(date +%s) - t0 )) s; $(grep -E '^train loss|gathered|backend|NCCL' \
      "$LOGS/hf_launch_$n.log" | head -4 | tr '\n' ' ')" | tee -a "$LOGS/env.txt"
    ls "/tmp/hf$n/final" >>"$LOGS/hf_launch_$n.log" 2>&1
  done
fi
[[ $DS == 1 ]] && export PYTHONPATH=$PYTHONPATH:$PWD/.dsdist
python3 tests/gpu_chunks.py --out "$LOGS/chunks" "$@"
rc=$?
tar -czf "$OUTDIR/logs.tgz" -C "$LOGS" .
cp "$LOGS/chunks/summary.jsonl" "$OUTDIR/" 2>/dev/null
exit $rc
