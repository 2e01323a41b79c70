"""DeepSpeed checkpoint reader vs real DeepSpeed 0.19.8 checkpoints (tests/generators/make_ds_ckpts.py made them: one
set on the CPU machine with gloo, one on 2x H200 with NCCL)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

from fsdpzero.checkpoint import deepspeed as dc

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "deepspeed_ckpts"
RECORD = json.loads((ASSETS / "record.json").read_text())
ZERO_VARIANTS = [v for v in RECORD["variants"] if not v.startswith("z0")]
GPU_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "deepspeed_ckpts_gpu"
GPU_RECORD = json.loads((GPU_ASSETS / "record.json").read_text())
BOTH_SETS = [(ASSETS, v) for v in ZERO_VARIANTS] + [(GPU_ASSETS, v) for v in GPU_RECORD["variants"]]


@pytest.mark.parametrize("assets,variant", BOTH_SETS, ids=[f"{a.name}-{v}" for a, v in BOTH_SETS])
def test_fp32_weights_equal_deepspeed_zero_to_fp32_bit_for_bit(assets, variant):
    ours = dc.fp32_state_dict(assets / variant)
    ref = load_file(assets / variant / "zero_to_fp32.safetensors")
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, k
        assert torch.equal(ours[k], ref[k]), k
    assert ours["lm_head.weight"] is ours["transformer.wte.weight"]  # tied params re-aliased


def test_adam_states_agree_across_layouts():
    """fp32 runs of every stage trained identically; stage 0 stores a plain torch optimizer (by index), stages 1-3
    flat partitions. Reading each layout must give the same per-param moments (up to reduction-order noise)."""
    ref = dc.adam_states(dc.read_checkpoint(ASSETS / "z0_fp32"))
    ref_w = dc.fp32_state_dict(ASSETS / "z0_fp32")
    for variant in ("z1_fp32", "z2_fp32", "z3_fp32"):
        ckpt = dc.read_checkpoint(ASSETS / variant)
        ours = dc.adam_states(ckpt)
        weights = dc.fp32_state_dict(ckpt)
        assert sorted(ours) == sorted(ref)
        for name, st in ref.items():
            assert float(ours[name]["step"]) == float(st["step"]) == RECORD["save_step"]
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours[name][key], st[key], rtol=1e-4, atol=1e-9, msg=f"{variant} {name}")
            # Adam turns ~1e-9 grad noise on near-zero grads into ~lr-sized steps: weights agree to ~1e-5 only
            torch.testing.assert_close(weights[name], ref_w[name], rtol=1e-5, atol=5e-5)


def test_training_state_has_what_resume_needs():
    st = dc.training_state(ASSETS / "z2_fp16")
    assert st["stage"] == 2 and st["world_size"] == 2 and st["tag"] == "global_step3"
    assert st["counters"] == {"global_steps": 3, "global_samples": 24, "skipped_steps": 0}
    assert st["loss_scaler"]["cur_scale"] > 1 and st["loss_scaler"]["dynamic"] is True
    assert st["param_groups"][0]["lr"] == RECORD["lr"]
    assert "transformer.wpe.weight" in st["weights"]  # frozen param
    assert "transformer.wpe.weight" not in st["adam"] and len(st["adam"]) == 27
    # stage 1 does not record frozen params; training_state takes them from `module`
    assert "transformer.wpe.weight" in dc.training_state(ASSETS / "z1_bf16")["weights"]


def _model_from(weights: dict) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(ASSETS)).float()
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    model.transformer.wpe.weight.requires_grad_(False)
    return model


RESUME = [(ASSETS, RECORD, v, 2e-6) for v in ("z0_fp32", "z2_fp32", "z3_fp32")]
# GPU-made: DeepSpeed's curve came from cuBLAS kernels, ours from CPU ones: fp32 agreement, not bit-level
RESUME += [(GPU_ASSETS, GPU_RECORD, v, 2e-5) for v in ("z1_fp32", "z2_fp32", "z3_fp32")]


@pytest.mark.parametrize("assets,record,variant,tol", RESUME, ids=[f"{a.name}-{v}" for a, _, v, _ in RESUME])
def test_resume_in_plain_torch_continues_deepspeed_loss_curve(assets, record, variant, tol):
    """Load weights + Adam moments into torch.optim.AdamW and train the steps DeepSpeed trained after its save."""
    st = dc.training_state(assets / variant)
    model = _model_from(st["weights"])
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g = st["param_groups"][0]
    opt = torch.optim.AdamW(named.values(), lr=g["lr"], betas=g["betas"], eps=g["eps"],
                            weight_decay=g["weight_decay"])
    opt.load_state_dict({"state": {i: st["adam"][n] for i, n in enumerate(named)},
                         "param_groups": [{**g, "params": list(range(len(named)))}]})
    data = load_file(assets / "data.safetensors")["input_ids"]
    ga, world, save = record["grad_accum"], data.shape[2], record["save_step"]
    losses = []
    for step in range(save, save + record["cont_steps"]):
        total = 0.0
        for micro in range(ga):
            for rank in range(world):  # DeepSpeed averages grads over GA micro-steps and ranks
                ids = data[step, micro, rank]
                loss = model(input_ids=ids, labels=ids).loss
                (loss / (ga * world)).backward()
                total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / (ga * world))
    expected = record["variants"][variant]["losses_after_save"]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < tol, (losses, expected)


def test_stage0_16bit_masters_and_fused_flat_layout(tmp_path):
    """Stage-0 fp16/bf16 (FP16 optimizer wrapper): the fp32 masters replace `module`'s 16-bit copies; the fused
    wrapper's layout (one flat fp32 tensor and one flat Adam state per group) reads back to the same tensors."""
    unfused = dc.read_checkpoint(ASSETS / "z0_fp16")
    weights, adam = dc.fp32_state_dict(unfused), dc.adam_states(unfused)
    module = unfused.meta["module"]
    assert weights["transformer.h.0.mlp.c_fc.weight"].dtype == torch.float32
    torch.testing.assert_close(weights["transformer.h.0.mlp.c_fc.weight"].half(),
                               module["transformer.h.0.mlp.c_fc.weight"], rtol=0, atol=0)  # module = fp16(master)
    assert weights["transformer.wpe.weight"].dtype == torch.float16  # frozen: no master, as saved
    assert dc.loss_scaler_state(unfused)["cur_scale"] == 512.0
    # the fused layout of the same state
    sd = dc.load_ds_file(ASSETS / "z0_fp16" / "global_step3" / "mp_rank_00_model_states.pt")
    opt = sd["optimizer"]
    groups = opt.pop("fp32_groups")
    opt["fp32_groups_flat"] = [torch.cat([t.reshape(-1) for t in g]) for g in groups]
    state, firsts = opt["optimizer_state_dict"]["state"], 0
    flat_state = {}
    for g, group in enumerate(groups):
        idx = range(firsts, firsts + len(group))
        flat_state[g] = {"step": state[firsts]["step"],
                         **{k: torch.cat([state[i][k].reshape(-1) for i in idx]) for k in ("exp_avg", "exp_avg_sq")}}
        firsts += len(group)
    opt["optimizer_state_dict"]["state"] = flat_state
    (tmp_path / "global_step3").mkdir()
    torch.save(sd, tmp_path / "global_step3" / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step3")
    trainable = list(adam)  # fused files cannot tell a frozen param from a trainable one: the engine knows
    with pytest.raises(ValueError, match="pass trainable_names"):
        dc.fp32_state_dict(dc.read_checkpoint(tmp_path))
    fused = dc.read_checkpoint(tmp_path)
    fused_w, fused_adam = dc.fp32_state_dict(fused, trainable_names=trainable), dc.adam_states(fused, trainable)
    assert all(torch.equal(fused_w[k], weights[k]) for k in weights)
    assert all(torch.equal(fused_adam[n][k], adam[n][k]) for n in adam for k in adam[n])


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_in_deepspeed_dir_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ASSETS / "z2_fp32", ckpt)
    marker = tmp_path / "pwned"
    evil = _Evil()
    evil.marker = marker
    target = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    torch.save({"module": evil}, target)
    with pytest.raises(dc.UnsafeCheckpointError, match=r"refused to unpickle .*system"):
        dc.fp32_state_dict(ckpt)
    assert not marker.exists()


def test_incomplete_checkpoint_is_reported(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ASSETS / "z3_bf16", ckpt)
    (ckpt / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match="partition_count says 2 ranks but there are 1"):
        dc.read_checkpoint(ckpt)
    with pytest.raises(FileNotFoundError, match="no `latest` file"):
        dc.read_checkpoint(tmp_path)
