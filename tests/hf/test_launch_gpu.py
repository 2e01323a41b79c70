"""GPU: `fsdpzero launch --num_gpus N` runs the unchanged Hugging Face Trainer script written for DeepSpeed
(examples/hf_trainer_deepspeed.py, transformers' ZeRO-3 config with CPU offload of parameters and optimizer, "auto"
everywhere) on N GPUs over NCCL, to the end: the loss falls, save_model's folder loads in plain transformers, and
deepspeed.zero.GatheredParameters gives the full weight as saved. The GPU half of tests/cli/test_launch.py's
2-rank gloo run: on several GPUs accelerate would wrap the sharded model in DDP. Not part of CPU CI; run with

    pytest -m gpu tests/hf/test_launch_gpu.py -v
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]   # the console script


@pytest.mark.parametrize("world", [2, 4], ids=["2gpu", "4gpu"])
def test_unchanged_trainer_script_zero3_offload_on_nccl(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [*FSDPZERO, "launch", "--num_gpus", str(world), "examples/hf_trainer_deepspeed.py",
           "--deepspeed", "tests/ds_configs/hf_transformers_zero3.json", "--output_dir", str(out),
           "--max_steps", "8", "--logging_steps", "1"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    assert f"{world} GPU(s)" in p.stdout + p.stderr and p.stderr.count("unchanged-script mode") == 1
    assert f"ZeRO stage 3 on mesh ({world},)" in p.stderr and "'cuda'" in p.stderr, p.stderr[-3000:]
    assert f"after 8 steps on {world} process(es) (deepspeed 0.19.8+fsdpzero)" in p.stdout, p.stdout[-1500:]
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import hf_trainer_deepspeed as ex
    finally:
        sys.path.pop(0)
    torch.manual_seed(42)                                          # TrainingArguments' default seed
    init = ex.LlamaForCausalLM(model.config)
    batch = torch.stack([w["input_ids"] for w in ex.byte_windows(4 * world)])
    with torch.no_grad():
        loss, before = (m(input_ids=batch, labels=batch).loss.item() for m in (model, init))
    assert loss < before - 0.05, (loss, before)                    # 8 steps on these windows lowered their loss
    norm = model.lm_head.weight.float().norm().item()
    assert f"lm_head.weight gathered: Parameter (256, 64), norm {norm:.6f}" in p.stdout, p.stdout[-1500:]
