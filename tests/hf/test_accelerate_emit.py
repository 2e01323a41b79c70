"""`fsdpzero migrate --emit accelerate`: accelerate's FSDP2 launch config for a ds_config, read back by accelerate's
own launcher (`accelerate launch --config_file` parsing, then the FSDP_* variables it gives the ranks, then the
FullyShardedDataParallelPlugin they build): fsdp_version 2, reshard per stage, offload, mixed precision, state-dict
type, world size; what FSDP2 cannot express is said in the file and on stderr."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[2]
FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]

CASES = {   # name -> (ds_config, what accelerate's plugin must hold, notes expected on stderr)
    "stage3_bf16_full_state_dict": (
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
        {"reshard_after_forward": True, "offload": False, "mixed_precision": "bf16", "state_dict": "FULL_STATE_DICT"},
        []),
    "stage2_fp16": (
        {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
        {"reshard_after_forward": False, "offload": False, "mixed_precision": "fp16",
         "state_dict": "SHARDED_STATE_DICT"}, ["DeepSpeed's dynamic loss scaler"]),
    "stage3_cpu_offload": (
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                          "offload_param": {"device": "cpu"}}},
        {"reshard_after_forward": True, "offload": True, "mixed_precision": "bf16",
         "state_dict": "SHARDED_STATE_DICT"}, []),
    "stage2_optimizer_offload": (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        {"reshard_after_forward": False, "offload": False, "mixed_precision": "no",
         "state_dict": "SHARDED_STATE_DICT"}, ["optimizer-only offload"]),
    "stage1": (
        {"zero_optimization": {"stage": 1}},
        {"reshard_after_forward": False, "offload": False, "mixed_precision": "no",
         "state_dict": "SHARDED_STATE_DICT"}, ["ZeRO-1"]),
    "stage3_nvme": (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                               "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
        {"reshard_after_forward": True, "offload": True, "mixed_precision": "no",
         "state_dict": "SHARDED_STATE_DICT"}, ["NVMe offload has no FSDP2 equivalent"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_emitted_config_is_what_accelerate_reads(tmp_path, monkeypatch, case):
    ds, want, notes = CASES[case]
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, **ds}
    src = tmp_path / "ds.json"
    src.write_text(json.dumps(ds))
    p = subprocess.run([*FSDPZERO, "migrate", str(src), "--world-size", "8", "--nodes", "2", "--emit", "accelerate"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for note in notes:
        assert note in p.stderr and note in p.stdout, (note, p.stderr)
    if not notes:
        assert "not expressible" not in p.stderr + p.stdout
    assert "Accelerator(gradient_accumulation_steps=4)" in p.stdout and "clip_grad_norm_" in p.stdout
    path = tmp_path / "accelerate.yaml"
    path.write_text(p.stdout)

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp and args.num_processes == 8 and args.num_machines == 2
    env = {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    assert env["ACCELERATE_MIXED_PRECISION"] == want["mixed_precision"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    plugin = FullyShardedDataParallelPlugin()
    from torch.distributed.fsdp import CPUOffloadPolicy
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is want["reshard_after_forward"]
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) is want["offload"]
    assert plugin.state_dict_type.name == want["state_dict"]
