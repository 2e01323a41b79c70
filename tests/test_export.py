"""save_16bit_model: a 2-rank fully_shard'ed GPT-2 -> safetensors (+ index when sharded) -> from_pretrained."""
from __future__ import annotations

import json

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from fsdpzero.export import INDEX_NAME, WEIGHTS_NAME, save_16bit_model
from tests.multirank import run_distributed

IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))


def _export_job(rank, world, out_dir):
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):  # train a little so the weights are not the init ones
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()
    save_16bit_model(model, f"{out_dir}/fp32", dtype=None, max_shard_size="40KB")  # forces several shards
    save_16bit_model(model, f"{out_dir}/bf16")
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_export_round_trip_through_from_pretrained(tmp_path):
    logits = run_distributed(_export_job, 2, str(tmp_path), timeout=120)[0]
    fp32 = tmp_path / "fp32"
    index = json.loads((fp32 / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (fp32 / WEIGHTS_NAME).exists()
    assert "lm_head.weight" not in index["weight_map"]  # tied to wte: stored once, re-tied by transformers
    model = AutoModelForCausalLM.from_pretrained(fp32, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(input_ids=IDS).logits
    torch.testing.assert_close(ours, logits, rtol=0, atol=1e-5)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
    assert (tmp_path / "bf16" / WEIGHTS_NAME).is_file() and (tmp_path / "bf16" / "config.json").is_file()
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.lm_head.weight.float(), model.lm_head.weight.bfloat16().float(), rtol=0, atol=0)
