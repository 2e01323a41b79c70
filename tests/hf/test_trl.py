"""TRL's own example scripts (trl.scripts.sft / dpo / grpo, their entry points unchanged) through `fsdpzero launch` on
2 gloo ranks, on a tiny local Llama with a byte tokenizer and local JSONL datasets, with DeepSpeed hidden from every
process (tests/hf/test_accelerate_launch.py's sitecustomize). Both doors: `--deepspeed ds.json` in the trainer's
arguments, and accelerate's launch config (`--config_file zero3.yaml`, no --deepspeed, as TRL's docs launch them).
SFT + LoRA at ZeRO-3 through the two doors gives the same adapter bit for bit; DPO (reference model) and GRPO (in-process
generation, a reward function from the working directory) train and save through each door."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytestmark = [pytest.mark.slow]

from tests.hf.test_accelerate_launch import HIDE_DEEPSPEED, _env  # noqa: E402

FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
# what `accelerate config` writes for DeepSpeed ZeRO-3 (TRL's examples/accelerate_configs/deepspeed_zero3.yaml)
ZERO3_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_multinode_launcher: standard
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
COMMON = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
          "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--bf16", "true"]


def save_byte_llama(where: Path) -> None:
    """A tiny Llama with ByT5's byte tokenizer (seed 0), saved as a from_pretrained folder: the TRL tests' model."""
    from transformers import AutoModelForCausalLM, ByT5Tokenizer, LlamaConfig
    torch.manual_seed(0)
    tok = ByT5Tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(where)
    tok.save_pretrained(where)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A from_pretrained folder (Llama, ByT5's byte tokenizer), three datasets, a reward function, the configs."""
    root = tmp_path_factory.mktemp("trl")
    save_byte_llama(root / "model")
    rows = {"sft": [{"text": " ".join(WORDS[(i + j) % 8] for j in range(6))} for i in range(64)],
            "pref": [{"prompt": WORDS[i % 8] + " ", "chosen": WORDS[(i + 1) % 8], "rejected": WORDS[(i + 3) % 8]}
                     for i in range(64)],
            "prompts": [{"prompt": " ".join(WORDS[(i + j) % 8] for j in range(3))} for i in range(64)]}
    for name, items in rows.items():
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    (root / "rewards.py").write_text("def length_reward(completions, **kwargs):\n"
                                     "    return [-abs(len(c) - 12) / 12.0 for c in completions]\n")
    (root / "zero3.json").write_text(json.dumps(ZERO3))
    (root / "zero3.yaml").write_text(ZERO3_YAML)
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(HIDE_DEEPSPEED)
    return root


def _launch(work: Path, door: list[str], script: str, out: str, *args: str) -> subprocess.CompletedProcess:
    env = _env(PYTHONPATH=f"{work / 'site'}{os.pathsep}{Path(__file__).resolve().parents[2]}", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    cmd = [*FSDPZERO, "launch", *door, "--module", f"trl.scripts.{script}", "--model_name_or_path", "model",
           "--output_dir", out, *COMMON, *args]
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-6000:]
    assert "import deepspeed` is fsdpzero's stand-in" in p.stderr
    return p


def _doors(work: Path) -> dict[str, list[str]]:
    return {"deepspeed=": ["--num_gpus", "2"], "yaml": ["--config_file", str(work / "zero3.yaml")]}


def test_sft_lora_zero3_same_adapter_through_both_doors(work):
    from safetensors.torch import load_file
    adapters = {}
    for name, door in _doors(work).items():
        extra = ["--deepspeed", "zero3.json"] if name == "deepspeed=" else []
        out = str(work / f"sft_{name}")
        _launch(work, door, "sft", out, "--dataset_name", "sft", "--max_length", "64", "--use_peft", "--lora_r", "4",
                "--lora_alpha", "8", "--lora_dropout", "0.0", "--learning_rate", "1e-3", *extra)
        adapters[name] = load_file(os.path.join(out, "adapter_model.safetensors"))
    a, b = adapters.values()
    assert a.keys() == b.keys() and len(a) >= 8
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)   # the adapter trained


@pytest.mark.parametrize("door", ["deepspeed=", "yaml"])
def test_dpo_trains_through_either_door(work, door):
    out = str(work / f"dpo_{door}")
    extra = ["--deepspeed", "zero3.json"] if door == "deepspeed=" else []
    _launch(work, _doors(work)[door], "dpo", out, "--dataset_name", "pref", "--max_length", "64",
            "--learning_rate", "1e-2", *extra)
    from safetensors.torch import load_file
    saved = load_file(os.path.join(out, "model.safetensors"))
    initial = load_file(str(work / "model" / "model.safetensors"))
    assert saved.keys() == initial.keys()
    changed = [k for k in saved if not torch.equal(saved[k], initial[k].to(saved[k].dtype))]
    assert len(changed) > len(saved) // 2, changed     # it trained


@pytest.mark.parametrize("door", ["deepspeed=", "yaml"])
def test_grpo_generates_in_process_at_zero3(work, door):
    out = str(work / f"grpo_{door}")
    extra = ["--deepspeed", "zero3.json"] if door == "deepspeed=" else []
    _launch(work, _doors(work)[door], "grpo", out, "--dataset_name", "prompts", "--reward_funcs",
            "rewards.length_reward", "--num_generations", "2", "--max_completion_length", "8",
            "--learning_rate", "1e-2", *extra)
    from safetensors.torch import load_file
    saved = load_file(os.path.join(out, "model.safetensors"))
    initial = load_file(str(work / "model" / "model.safetensors"))
    assert saved.keys() == initial.keys()
    changed = [k for k in saved if not torch.equal(saved[k], initial[k].to(saved[k].dtype))]
    assert changed, "GRPO did not move the weights"
