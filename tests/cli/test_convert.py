"""fsdpzero convert: our DCP -> safetensors from the files alone; DeepSpeed -> our format that resumes training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

from fsdpzero.checkpoint import dcp as ck
from fsdpzero.cli import main as cli
from tests.multirank import run_distributed
from tests.checkpoint.test_checkpoint import _build, _full_params, _state, _train

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "deepspeed_ckpts"
RECORD = json.loads((ASSETS / "record.json").read_text())


def _save_job(rank, world, save_dir):
    model, opt, sched = _build(world, 0, 0.0)
    _train(model, opt, sched, range(2), rank, world)
    ck.save_checkpoint(save_dir, None, _state(model, opt, sched, {"global_steps": 2}), step=2)
    return _full_params(model)


def test_dcp_to_fp32_safetensors_without_process_group(tmp_path):
    full = run_distributed(_save_job, 2, str(tmp_path / "ckpt"), timeout=120)[0]
    out = tmp_path / "out"
    assert cli(["convert", str(tmp_path / "ckpt"), "--to", "fp32", "--out", str(out), "--max-shard-size", "30KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(out / f))
    assert sorted(got) == sorted(full)
    assert all(torch.equal(got[k], full[k]) for k in full)


def test_deepspeed_to_safetensors_equals_zero_to_fp32(tmp_path):
    assert cli(["convert", str(ASSETS / "z3_bf16"), "--from", "deepspeed", "--to", "safetensors",
                "--out", str(tmp_path)]) == 0
    got, ref = load_file(tmp_path / "model.safetensors"), load_file(ASSETS / "z3_bf16" / "zero_to_fp32.safetensors")
    assert "lm_head.weight" not in got  # tied: stored once
    assert all(torch.equal(got[k], ref[k]) for k in got) and set(ref) - set(got) == {"lm_head.weight"}


def _resume_from_ds_job(rank, world, ckpt_dir, variant):
    torch.manual_seed(5)
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(ASSETS))
    model.transformer.wpe.weight.requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cfg = RECORD["variants"][variant]["config"]["optimizer"]["params"]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1.0, weight_decay=0.0)
    counters = {}
    ck.load_checkpoint(ckpt_dir, None, {"train": ck.ModelOptimizer(model, opt), "counters": counters})
    assert opt.param_groups[0]["lr"] == cfg["lr"] and opt.param_groups[0]["weight_decay"] == cfg["weight_decay"]
    data = load_file(ASSETS / "data.safetensors")["input_ids"]
    ga, ds_world, save = RECORD["grad_accum"], data.shape[2], RECORD["save_step"]
    losses = []
    for step in range(save, save + RECORD["cont_steps"]):
        micro_batches = data[step].reshape(ga * ds_world, *data.shape[3:])  # DeepSpeed's micro-batches of this step
        mine = micro_batches.chunk(world)[rank]
        total = torch.zeros(())
        for ids in mine:
            loss = model(input_ids=ids, labels=ids).loss
            (loss / len(mine)).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / (ga * ds_world))
    return counters, losses


@pytest.mark.parametrize("variant,world", [("z2_fp32", 2), ("z3_fp32", 1), ("z1_fp32", 2)])
def test_resume_from_converted_deepspeed_checkpoint_continues_its_loss_curve(tmp_path, variant, world):
    assert cli(["convert", str(ASSETS / variant), "--from", "deepspeed", "--to", "dcp", "--out", str(tmp_path)]) == 0
    assert ((tmp_path / "latest").read_text() == "global_step3"
            and ck.checkpoint_problems(tmp_path / "global_step3") == [])
    counters, losses = run_distributed(_resume_from_ds_job, world, str(tmp_path), variant, timeout=120)[0]
    assert counters["global_steps"] == RECORD["save_step"]
    expected = RECORD["variants"][variant]["losses_after_save"]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 2e-6, (losses, expected)


@pytest.mark.parametrize("extra", [[], ["--from", "deepspeed", "--to", "dcp"]])
def test_convert_on_a_folder_without_a_checkpoint_is_one_line(tmp_path, capsys, extra):
    from fsdpzero.cli import main
    args = ["convert", str(tmp_path)] + (extra or ["--to", "safetensors"])
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fsdpzero convert: error: ") and str(tmp_path) in err[0], err
