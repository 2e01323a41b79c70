"""fsdpzero.hf.Trainer saves and resumes as a Trainer user expects, at every ZeRO stage and with CPU offload, on 2 gloo
ranks in fp32: `save_steps` checkpoints hold DeepSpeed's layout (global_stepN/ + latest) beside the Trainer's own
files; `save_model` writes a folder that plain `from_pretrained` loads to exactly the trained weights; and
`resume_from_checkpoint` continues the run bit for bit (losses, learning rates, final weights) against the same run
left uninterrupted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  imported before forking ranks
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.multirank import run_distributed

STEPS, SAVE_EVERY = 6, 3
CASES = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "stage3_cpu_offload": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                           "offload_optimizer": {"device": "cpu", "pin_memory": False},
                           "offload_param": {"device": "cpu", "pin_memory": False}},
    "stage2_trainer_optimizer": {"stage": 2, "trainer_optimizer": True},
    "stage3_nvme": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "SWAP", "pin_memory": False},
                    "offload_param": {"device": "nvme", "nvme_path": "SWAP", "pin_memory": False}},
}


def _ds_config(zero: dict, swap: str | None = None) -> dict:
    zero = json.loads(json.dumps(zero).replace('"SWAP"', json.dumps(swap)))   # offload to NVMe: a real swap dir
    sections = not zero.pop("trainer_optimizer", False)
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": zero}
    if sections:   # else the Trainer's own AdamW and linear schedule (its scheduler state goes to scheduler.pt)
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
        ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto"}}
    return ds


def _train(rank, world, zero, outdir, resume):
    import fsdpzero.hf
    from corpus import PackedLMDataset
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=256, eos_token_id=257, pad_token_id=258)
    model = AutoModelForCausalLM.from_config(cfg)
    Path(f"{outdir}-swap").mkdir(parents=True, exist_ok=True)
    args = fsdpzero.hf.TrainingArguments(output_dir=outdir, max_steps=STEPS, per_device_train_batch_size=2,
                                         gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01,
                                         warmup_steps=2, max_grad_norm=0.5, logging_steps=1, report_to=[],
                                         save_strategy="steps", save_steps=SAVE_EVERY, use_cpu=True,
                                         disable_tqdm=True, deepspeed=_ds_config(zero, f"{outdir}-swap"), seed=0)
    trainer = fsdpzero.hf.Trainer(model=model, args=args, train_dataset=PackedLMDataset(64))
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(Path(outdir) / "final"))
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.engine.module.named_parameters()}
    history = [{k: h[k] for k in ("step", "loss", "learning_rate", "grad_norm") if k in h}
               for h in trainer.state.log_history if "loss" in h]
    return {"history": history, "params": full if rank == 0 else None, "steps": trainer.engine.global_steps}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_trainer_checkpoints_save_model_and_resume_exactly(tmp_path, case):
    zero = CASES[case]
    straight = run_distributed(_train, 2, zero, str(tmp_path / "straight"), None, timeout=300)[0]
    assert [h["step"] for h in straight["history"]] == list(range(1, STEPS + 1))
    assert straight["history"][-1]["loss"] < straight["history"][0]["loss"]

    ckpt = tmp_path / "straight" / f"checkpoint-{SAVE_EVERY}"
    assert (ckpt / "latest").read_text().strip() == f"global_step{SAVE_EVERY}"
    assert (ckpt / f"global_step{SAVE_EVERY}").is_dir()
    for name in ("model.safetensors", "config.json", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"):
        assert (ckpt / name).is_file(), name

    # save_model: a plain Hugging Face folder, loaded without fsdpzero, equals the trained weights exactly (fp32)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "final")
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.detach(), straight["params"][name], rtol=0, atol=0, msg=name)

    # resume from the middle: the same losses, learning rates and grad norms, the same final weights
    resumed = run_distributed(_train, 2, zero, str(tmp_path / "resumed"), str(ckpt), timeout=300)[0]
    assert resumed["steps"] == straight["steps"] == STEPS
    assert resumed["history"] == straight["history"]
    for name, p in straight["params"].items():
        torch.testing.assert_close(resumed["params"][name], p, rtol=0, atol=0, msg=name)


def _stage3_no_gather(rank, world, outdir):
    import fsdpzero.hf
    from corpus import PackedLMDataset
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    args = fsdpzero.hf.TrainingArguments(output_dir=outdir, max_steps=2, per_device_train_batch_size=2,
                                         learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                                         disable_tqdm=True, deepspeed=_ds_config({"stage": 3}), seed=0)
    trainer = fsdpzero.hf.Trainer(model=AutoModelForCausalLM.from_config(cfg), args=args,
                                  train_dataset=PackedLMDataset(64))
    trainer.train()
    trainer.save_model(outdir)


@pytest.mark.slow
def test_stage3_without_gather_saves_the_engine_checkpoint_as_deepspeed_does(tmp_path):
    """stage3_gather_16bit_weights_on_model_save false (DeepSpeed's default): no weights file, the full checkpoint
    instead, which `fsdpzero convert` turns into weights."""
    run_distributed(_stage3_no_gather, 2, str(tmp_path), timeout=300)
    assert not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    from fsdpzero.checkpoint import dcp_to_safetensors
    out = dcp_to_safetensors(tmp_path, out=tmp_path / "weights")
    assert (Path(out) / "model.safetensors").is_file()


def _save_only_model(rank, world, outdir, resume):
    import fsdpzero.hf
    from corpus import PackedLMDataset
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    args = fsdpzero.hf.TrainingArguments(output_dir=outdir, max_steps=2, per_device_train_batch_size=2,
                                         learning_rate=1e-3, report_to=[], save_strategy="steps", save_steps=2,
                                         save_only_model=True, use_cpu=True, disable_tqdm=True,
                                         deepspeed=_ds_config({"stage": 2}), seed=0)
    trainer = fsdpzero.hf.Trainer(model=AutoModelForCausalLM.from_config(cfg), args=args,
                                  train_dataset=PackedLMDataset(64))
    try:
        trainer.train(resume_from_checkpoint=resume)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_save_only_model_checkpoints_hold_weights_and_do_not_resume(tmp_path):
    """save_only_model=True: checkpoint-N is a from_pretrained folder with no engine state; resuming from it is a
    clear error on every rank (transformers + DeepSpeed cannot resume from it either)."""
    assert run_distributed(_save_only_model, 2, str(tmp_path), None, timeout=300) == [None, None]
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "latest").exists()
    assert not list(ckpt.glob("global_step*"))
    AutoModelForCausalLM.from_pretrained(ckpt)
    errors = run_distributed(_save_only_model, 2, str(tmp_path / "again"), str(ckpt), timeout=300)
    assert errors[0] == errors[1] and "save_only_model=True" in errors[0], errors


def _best_model(rank, world, outdir):
    import fsdpzero.hf
    from corpus import PackedLMDataset
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    data = PackedLMDataset(64)
    # greater_is_better on a loss: the best checkpoint is the first one, not the last weights
    args = fsdpzero.hf.TrainingArguments(output_dir=outdir, max_steps=4, per_device_train_batch_size=2,
                                         learning_rate=3e-3, report_to=[], eval_strategy="steps", eval_steps=2,
                                         save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                                         metric_for_best_model="eval_loss", greater_is_better=True,
                                         use_cpu=True, disable_tqdm=True, deepspeed=_ds_config({"stage": 2}),
                                         seed=0)
    trainer = fsdpzero.hf.Trainer(model=AutoModelForCausalLM.from_config(cfg), args=args, train_dataset=data,
                                  eval_dataset=torch.utils.data.Subset(data, range(4)))
    trainer.train()
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.engine.module.named_parameters()}
    return {"best": trainer.state.best_model_checkpoint, "params": full}


@pytest.mark.slow
def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    r = run_distributed(_best_model, 2, str(tmp_path), timeout=300)[0]
    assert r["best"].endswith("checkpoint-2"), r["best"]
    best = AutoModelForCausalLM.from_pretrained(r["best"])
    for name, p in best.named_parameters():
        torch.testing.assert_close(r["params"][name], p.detach(), rtol=0, atol=0, msg=name)
