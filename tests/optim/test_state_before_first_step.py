"""Reading the optimizer state before the first step must not change training (issue 32's "silently wrong" class).

torch.distributed.checkpoint's get_optimizer_state_dict creates a never-stepped optimizer's state by running a
zero-gradient step at lr 0: AdamW's step counter becomes 1 (the first real update is then ~0.75 lr), SGD's momentum
buffer starts at wd * p, Adam's (L2) first moment at (1 - beta1) wd p. Stage 1 did the same in its own ensure_state.

Reference: the same engine trained without the save (plain run, 3 steps, 2 gloo ranks, tiny Llama). Saving before
step 1 must leave the weights bit-identical to it, and a fresh engine (other initial weights) that loads the pre-step
checkpoint must continue bit-identically too. AdamW, SGD with momentum, dampening and weight decay, Adam with L2
weight decay, Adagrad with initial_accumulator_value (whose state exists from construction), at stages 0 and 1.
"""
import dataclasses

import pytest
import torch
import transformers  # noqa: F401  imported before forking the ranks

from fsdpzero.api import wrap
from tests.engine_cases import ADAMW, batches, build_model, engine_losses, full_params, make_plan
from tests.multirank import run_distributed

STEPS = 3
OPTIMIZERS = {
    "adamw": ("adamw", ADAMW),
    "adam_l2": ("adam", {"lr": 5e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}),
    "sgd": ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    "adagrad": ("adagrad", {"lr": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1}),
}


def _plan(stage, world, opt):
    kind, params = OPTIMIZERS[opt]
    plan = make_plan(stage=stage, world=world, opt=kind, opt_params=params)
    return dataclasses.replace(plan, optimizer=dataclasses.replace(plan.optimizer, zero_allow_untested_optimizer=True,
                                                                   adam_w_mode=opt != "adam_l2"))


def _rank(rank, world, cases, save_root):
    out = {}
    for stage, opt in cases:
        plan = _plan(stage, world, opt)
        data = batches(STEPS, 1, plan.batch.micro_batch_size * world)
        plain = wrap(build_model("llama"), plan)
        engine_losses(plain, data, rank, world)
        ref = full_params(plain.module)

        saved = wrap(build_model("llama"), plan)
        save_dir = f"{save_root}/{stage}_{opt}"
        saved.save_checkpoint(save_dir)    # before step 1
        engine_losses(saved, data, rank, world)
        after_save = full_params(saved.module)

        resumed = wrap(build_model("llama", seed=7), plan)
        resumed.load_checkpoint(save_dir)
        engine_losses(resumed, data, rank, world)
        after_load = full_params(resumed.module)
        out[(stage, opt)] = {
            "save": max((after_save[k] - ref[k]).abs().max().item() for k in ref),
            "load": max((after_load[k] - ref[k]).abs().max().item() for k in ref),
            "moved": max((ref[k] - v).abs().max().item() for k, v in build_model("llama").state_dict().items()),
        }
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_save_before_first_step_changes_nothing(tmp_path, stage):
    cases = [(stage, opt) for opt in OPTIMIZERS]
    results = run_distributed(_rank, 2, cases, str(tmp_path), timeout=600)
    bad = []
    for r in results:
        for case, d in r.items():
            assert d["moved"] > 1e-4, f"{case}: training did not move the weights"
            if d["save"] != 0.0:
                bad.append(f"{case}: saving before step 1 changed the weights after {STEPS} steps by {d['save']:.3g}")
            if d["load"] != 0.0:
                bad.append(f"{case}: resuming from the pre-step checkpoint differs by {d['load']:.3g}")
    assert not bad, "\n".join(sorted(set(bad)))
