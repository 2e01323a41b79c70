"""save_16bit_model: a 2-rank fully_shard'ed GPT-2 -> safetensors (+ index when sharded) -> from_pretrained, and
equal bit for bit to DCP's full state dict; the streamed safetensors writer against safetensors' own reader."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from fsdpzero.checkpoint.export import INDEX_NAME, WEIGHTS_NAME, save_16bit_model, write_safetensors
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
    try:   # refused on every rank before any gather: a rank-0-only error would leave rank 1 in a collective
        save_16bit_model(model, f"{out_dir}/bad", filename="pytorch_model.bin")
        refused = False
    except ValueError as e:
        refused = "use a name ending in .safetensors" in str(e)
    save_16bit_model(model, f"{out_dir}/fp32", dtype=None, max_shard_size="40KB")  # forces several shards
    save_16bit_model(model, f"{out_dir}/bf16")
    # the reference: DCP gathers the whole model into one state dict (what DeepSpeed does on rank 0)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with torch.no_grad():
        return model(input_ids=IDS).logits, full, refused


def test_export_round_trip_through_from_pretrained(tmp_path):
    results = run_distributed(_export_job, 2, str(tmp_path), timeout=120)
    assert all(r[2] for r in results)   # the bad filename was refused on both ranks
    logits, full, _ = results[0]
    fp32 = tmp_path / "fp32"
    index = json.loads((fp32 / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (fp32 / WEIGHTS_NAME).exists()
    assert "lm_head.weight" not in index["weight_map"]  # tied to wte: stored once, re-tied by transformers
    files = {}
    for f in set(index["weight_map"].values()):
        files.update(load_file(fp32 / f))
    assert files.keys() == full.keys() - {"lm_head.weight"}
    for k, v in files.items():
        assert torch.equal(v, full[k]), k
    bf16_files = load_file(tmp_path / "bf16" / WEIGHTS_NAME)
    assert all(torch.equal(bf16_files[k], full[k].bfloat16()) for k in files)
    model = AutoModelForCausalLM.from_pretrained(fp32, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(input_ids=IDS).logits
    torch.testing.assert_close(ours, logits, rtol=0, atol=1e-5)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
    assert (tmp_path / "bf16" / WEIGHTS_NAME).is_file() and (tmp_path / "bf16" / "config.json").is_file()
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.lm_head.weight.float(), model.lm_head.weight.bfloat16().float(), rtol=0, atol=0)


def _bytes(t):   # bit-exact comparison for every dtype (float8 has no torch.equal)
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_streamed_safetensors_writer_matches_the_library(tmp_path):
    """write_safetensors (header first, then one tensor at a time) against safetensors' reader: every dtype we map,
    odd sizes, 0-d, empty and non-contiguous tensors come back bit for bit, with the 'pt' metadata."""
    g = torch.Generator().manual_seed(5)
    tensors = {
        "f32": torch.randn(7, 13, generator=g), "bf16": torch.randn(3, 5, 11, generator=g).bfloat16(),
        "f16": torch.randn(1, generator=g).half(), "f64": torch.randn(2, 3, generator=g).double(),
        "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "i64": torch.randint(-9, 9, (17,), generator=g),
        "i32": torch.arange(5, dtype=torch.int32), "u8": torch.arange(255, dtype=torch.uint8), "b": torch.rand(9) > 0.5,
        "strided": torch.randn(6, 8, generator=g).t(), "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
    }
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    path = tmp_path / "x.safetensors"
    write_safetensors(path, specs, (tensors[k] for k, _, _ in specs))
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(_bytes(back[k]), _bytes(v)), k
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(ValueError, match="f32: got torch.float32 \\(7, 13\\), the header says torch.bfloat16"):
        write_safetensors(tmp_path / "y.safetensors", [("f32", torch.bfloat16, (7, 13))], [tensors["f32"]])
