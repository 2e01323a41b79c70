"""fsdpzero.hf.Trainer on one GPU (NCCL) with LoRA and ZeRO-3 CPU offload of parameters and optimizer (the
LLaMA-Factory config): training runs with the frozen base on the CPU, and the adapter and merged saves gather the
CPU-offloaded shards through NCCL; both reload to the trained model's logits. Run: `pytest -m gpu tests/hf`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_lora_zero3_offload_trains_and_saves_on_gpu(tmp_path, one_rank_nccl):
    import sys
    from transformers import AutoModelForCausalLM, LlamaConfig

    import fsdpzero.hf
    sys.path.insert(0, str(ROOT / "recipes"))
    from corpus import PackedLMDataset
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    base = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    ds = json.loads((ROOT / "tests" / "ds_configs" / "llamafactory_ds_z3_offload.json").read_text())
    args = fsdpzero.hf.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                                         learning_rate=1e-2, bf16=True, logging_steps=1, report_to=[],
                                         save_strategy="no", disable_tqdm=True, deepspeed=ds, seed=0)
    trainer = fsdpzero.hf.Trainer(model=model, args=args, train_dataset=PackedLMDataset(64))
    trainer.train()
    frozen = [p for p in trainer.engine.module.parameters() if not p.requires_grad]
    assert frozen and all(p.to_local().device.type == "cpu" for p in frozen)   # offload_param kept them there
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(l == l for l in losses)
    trainer.save_model(str(tmp_path / "adapter"))
    trainer.save_merged_model(str(tmp_path / "merged"))
    probe = (torch.arange(12).reshape(2, 6) * 17 % 256).cuda()
    with torch.no_grad():
        ours = trainer.engine.module(input_ids=probe).logits.float().cpu()
    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).cuda()
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        for other in (loaded, merged):
            torch.testing.assert_close(other(input_ids=probe).logits.float().cpu(), ours, rtol=2e-2, atol=2e-2)
