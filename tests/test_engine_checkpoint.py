"""Engine save/load: 12 straight steps vs 6 + save + fresh process group + load + 6, through engine.save_checkpoint
/ engine.load_checkpoint (gradient accumulation 2, fp16-style dynamic loss scaling on); resharded 2 -> 1 and 1 -> 2;
resume from a converted DeepSpeed checkpoint; save_16bit_model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  imported before forking the ranks

from fsdpzero.api import wrap
from fsdpzero.cli import main as cli
from fsdpzero.plan import LossScalePlan
from tests.engine_cases import batches, build_model, engine_losses, full_params, make_plan
from tests.multirank import run_distributed

STEPS, HALF, GLOBAL_MICRO = 12, 6, 4
SCALER = LossScalePlan(initial_scale_power=8, loss_scale_window=2, hysteresis=1)


def _plan(stage, world):
    return make_plan(stage=stage, gas=2, world=world, micro=GLOBAL_MICRO // world, fp16=SCALER)


def _data():
    return batches(STEPS, 2, GLOBAL_MICRO)


def _straight(rank, world, stage):
    engine = wrap(build_model("gpt2"), _plan(stage, world))
    losses = engine_losses(engine, _data(), rank, world)
    return losses, full_params(engine.module), engine.get_loss_scale()


def _first_half(rank, world, stage, save_dir):
    engine = wrap(build_model("gpt2"), _plan(stage, world))
    losses = engine_losses(engine, _data()[:HALF], rank, world)
    path = engine.save_checkpoint(save_dir, client_state={"epoch": 1})
    return losses, str(path)


def _second_half(rank, world, stage, save_dir):
    engine = wrap(build_model("gpt2", seed=99), _plan(stage, world))
    path, client = engine.load_checkpoint(save_dir)
    assert Path(path).name == f"global_step{HALF}" and client == {"epoch": 1}
    assert engine.global_steps == HALF and engine.micro_steps == 2 * HALF
    losses = engine_losses(engine, _data()[HALF:], rank, world)
    return losses, full_params(engine.module), engine.get_loss_scale()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_exact_resume_through_engine(tmp_path, stage):
    ref_losses, ref_params, ref_scale = run_distributed(_straight, 2, stage, timeout=180)[0]
    first, _ = run_distributed(_first_half, 2, stage, str(tmp_path), timeout=180)[0]
    second, params, scale = run_distributed(_second_half, 2, stage, str(tmp_path), timeout=180)[0]
    assert first + second == ref_losses
    assert scale == ref_scale > 1
    assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (1, 2)])
def test_resharded_resume_through_engine(tmp_path, save_world, load_world):
    ref_losses, ref_params, _ = run_distributed(_straight, 2, 3, timeout=180)[0]
    run_distributed(_first_half, save_world, 3, str(tmp_path), timeout=180)
    second, params, _ = run_distributed(_second_half, load_world, 3, str(tmp_path), timeout=180)[0]
    assert max(abs(a - b) for a, b in zip(second, ref_losses[HALF:])) <= 1e-6
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=0, atol=1e-5)


ASSETS = Path(__file__).parent / "assets" / "deepspeed_ckpts"
RECORD = json.loads((ASSETS / "record.json").read_text())


def _resume_from_deepspeed(rank, world, ckpt_dir, variant):
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(5)
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(ASSETS))
    model.transformer.wpe.weight.requires_grad_(False)
    engine = wrap(model, RECORD["variants"][variant]["config"])  # DeepSpeed's own config, as the fixture used it
    path, _ = engine.load_checkpoint(ckpt_dir)
    assert engine.global_steps == RECORD["save_step"]
    data = load_file(ASSETS / "data.safetensors")["input_ids"]   # [step, micro-step, DS rank, micro, seq]
    save = RECORD["save_step"]
    ds_world = data.shape[2]
    losses = []
    for step in range(save, save + RECORD["cont_steps"]):
        acc = torch.zeros(())
        for micro in range(data.shape[1]):
            rows = data[step, micro].reshape(-1, data.shape[-1])   # the DS global micro-batch
            mine = rows.chunk(world)[rank]
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            acc += loss.detach()
        torch.distributed.all_reduce(acc)
        losses.append(acc.item() / (data.shape[1] * world))
    return losses, ds_world, engine.get_loss_scale()


@pytest.mark.parametrize("variant", ["z2_fp32", "z3_fp32", "z1_fp32"])
def test_engine_resumes_converted_deepspeed_checkpoint(tmp_path, variant):
    assert cli(["convert", str(ASSETS / variant), "--from", "deepspeed", "--to", "dcp", "--out", str(tmp_path)]) == 0
    losses, ds_world, _ = run_distributed(_resume_from_deepspeed, 2, str(tmp_path), variant, timeout=180)[0]
    expected = RECORD["variants"][variant]["losses_after_save"]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 2e-6, (losses, expected)
