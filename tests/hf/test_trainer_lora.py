"""PEFT/LoRA through fsdpzero.hf.Trainer at every ZeRO stage and with CPU offload, on 2 gloo ranks, with no manual
dtype casts. Reference: transformers' plain Trainer (DDP, unsharded) with the same PEFT model, data, seed and
arguments on the same 2 ranks; fp32: per-step loss / learning rate / grad norm and the adapter weights within 1e-5.
Also: frozen weights get no gradient and no optimizer state (asserted on the optimizer's tensors), the saved
adapter (adapter_model.safetensors) loads with PeftModel.from_pretrained and reproduces the trained model's logits,
and a bf16 config keeps the frozen base in bf16 (2 bytes a parameter) with fp32 masters for the adapters only."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  imported before forking ranks
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.hf.cases import ZERO_CASES
from tests.multirank import run_distributed

peft = pytest.importorskip("peft")

STEPS = 4
CASES = ZERO_CASES
PROBE = torch.arange(12).reshape(2, 6) * 17 % 256


def _peft_model(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=256, eos_token_id=257, pad_token_id=258)
    base = AutoModelForCausalLM.from_config(cfg).to(dtype)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


def _args(cls, outdir, **extra):
    return cls(output_dir=outdir, max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
               learning_rate=1e-2, weight_decay=0.0, warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=1.0,
               logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, **extra)


def _history(trainer):
    return [{k: h[k] for k in ("loss", "learning_rate", "grad_norm")} for h in trainer.state.log_history
            if "loss" in h]


def _full(module):
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.named_parameters() if p.requires_grad}


def _ours(rank, world, zero, outdir, bf16):
    import fsdpzero.hf
    from corpus import PackedLMDataset
    model = _peft_model(torch.bfloat16 if bf16 else torch.float32)    # a bf16 base, as LoRA users load it
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # no optimizer/scheduler sections: the Trainer's own, stepped by the Trainer, as in the plain reference run
    # (with sections, the rate is logged after the step, as DeepSpeed does: tests/hf/test_trainer_oracle.py)
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": zero}
    if bf16:
        ds["bf16"] = {"enabled": "auto"}
    args = _args(fsdpzero.hf.TrainingArguments, outdir, deepspeed=ds, bf16=bf16)
    trainer = fsdpzero.hf.Trainer(model=model, args=args, train_dataset=PackedLMDataset(64))
    trainer.train()
    module, opt = trainer.engine.module, trainer.engine.optimizer
    state_numel = sum((t.to_local() if hasattr(t, "to_local") else t).numel()   # this rank's share
                      for st in opt.state.values() for k, t in st.items() if k == "exp_avg" and torch.is_tensor(t))
    frozen = [(p.dtype, (p.to_local() if hasattr(p, "to_local") else p).element_size())
              for p in module.parameters() if not p.requires_grad]
    frozen_grads = sum(p.grad is not None for p in module.parameters() if not p.requires_grad)
    adapters = _full(module)    # before the probe forward, after which FSDP2's root unit holds unsharded bf16 views
    trainer.save_model(str(Path(outdir) / "adapter"))
    trainer.save_merged_model(str(Path(outdir) / "merged"))
    with torch.no_grad():
        logits = module(input_ids=PROBE).logits.float()
    return {"history": _history(trainer), "adapters": adapters, "trainable": trainable,
            "state_numel": state_numel, "frozen": frozen, "frozen_grads": frozen_grads, "logits": logits}


def _reference(rank, world, outdir):
    from corpus import PackedLMDataset
    model = _peft_model()
    trainer = transformers.Trainer(model=model, args=_args(transformers.TrainingArguments, outdir),
                                   train_dataset=PackedLMDataset(64))
    trainer.train()
    return {"history": _history(trainer), "adapters": _full(model)}


_REFERENCE: list[dict] = []


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_lora_matches_the_plain_trainer_and_saves_an_adapter(tmp_path, case):
    if not _REFERENCE:
        _REFERENCE.append(run_distributed(_reference, 2, str(tmp_path / "reference"), timeout=300)[0])
    ref = _REFERENCE[0]
    results = run_distributed(_ours, 2, CASES[case], str(tmp_path / "ours"), False, timeout=300)
    ours = results[0]
    assert len(ours["history"]) == len(ref["history"]) == STEPS
    for a, b in zip(ours["history"], ref["history"]):
        for key in ("loss", "learning_rate"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, ours["history"], ref["history"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-5), (ours["history"], ref["history"])
    assert set(ours["adapters"]) == set(ref["adapters"]) and all("lora_" in n for n in ours["adapters"])
    for name, p in ref["adapters"].items():
        torch.testing.assert_close(ours["adapters"][name], p, rtol=1e-5, atol=1e-6, msg=name)

    # optimizer state for the adapters only: Adam's exp_avg covers this rank's share of the trainable elements
    world_numel = sum(r["state_numel"] for r in results)
    per_rank = CASES[case]["stage"] > 0   # stage 0 would replicate; every stage here shards the state
    assert per_rank and ours["trainable"] <= world_numel <= ours["trainable"] + 2 * 64, \
        (world_numel, ours["trainable"])
    assert ours["frozen_grads"] == 0

    # the adapter folder: what PEFT writes, loaded onto a fresh base, gives the trained model's logits
    adapter = tmp_path / "ours" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    assert not (adapter / "model.safetensors").exists()
    base = _peft_model().get_base_model()
    loaded = peft.PeftModel.from_pretrained(base, adapter)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=PROBE).logits, ours["logits"], rtol=1e-5, atol=1e-5)

    # the merged folder: a plain transformers model equal to PEFT's own merge_and_unload() of that adapter
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ours" / "merged")
    reference = loaded.merge_and_unload().state_dict()
    assert set(merged.state_dict()) == set(reference)
    for name, t in merged.state_dict().items():
        torch.testing.assert_close(t, reference[name], rtol=1e-6, atol=1e-7, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=PROBE).logits, ours["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_lora_bf16_keeps_the_frozen_base_in_bf16(tmp_path):
    """bf16 config, bf16 base: frozen weights stay bf16 (2 bytes a parameter, no fp32 copy), adapters get fp32
    masters and optimizer state, no manual casts, and the loss falls."""
    ours = run_distributed(_ours, 2, {"stage": 3}, str(tmp_path), True, timeout=300)[0]
    assert ours["frozen"] and all(d == torch.bfloat16 and size == 2 for d, size in ours["frozen"]), ours["frozen"]
    assert ours["frozen_grads"] == 0
    assert all(p.dtype == torch.float32 for p in ours["adapters"].values())
    losses = [h["loss"] for h in ours["history"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def _modules_to_save(rank, world, outdir):
    import fsdpzero.hf
    from corpus import PackedLMDataset
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = peft.get_peft_model(AutoModelForCausalLM.from_config(cfg),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                modules_to_save=["lm_head"], lora_dropout=0.0))
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 3}}
    trainer = fsdpzero.hf.Trainer(model=model, args=_args(fsdpzero.hf.TrainingArguments, outdir, deepspeed=ds),
                                  train_dataset=PackedLMDataset(64))
    trainer.train()
    trainer.save_model(str(Path(outdir) / "adapter"))
    trainer.save_merged_model(str(Path(outdir) / "merged"))
    return cfg.to_dict()


@pytest.mark.slow
def test_merged_save_with_modules_to_save_equals_peft_merge(tmp_path):
    """modules_to_save (a trained lm_head copy): the merged folder holds the trained copy under the plain name, as
    PEFT's merge_and_unload() does, not the frozen original."""
    cfg = LlamaConfig(**run_distributed(_modules_to_save, 2, str(tmp_path), timeout=300)[0])
    torch.manual_seed(0)
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_config(cfg), tmp_path / "adapter")
    reference = loaded.merge_and_unload().state_dict()
    from safetensors import safe_open
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(reference), set(f.keys()) ^ set(reference)   # what was written, exactly
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    for name, t in merged.items():
        torch.testing.assert_close(t, reference[name], rtol=1e-6, atol=1e-7, msg=name)
