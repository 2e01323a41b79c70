"""A parameter that gets a gradient on some ranks only: every rank must still enter the same collectives.

Rank 0 feeds token ids and rank 1 a soft prompt (`inputs_embeds` from a tensor trained outside the model), so the
input embedding of a real transformers Llama (untied) has a gradient on rank 0 alone. DeepSpeed
(`ignore_unused_parameters`, true by default) reduces a zero gradient for it on rank 1. FSDP2 reduce-scatters only
the gradients a rank has, so rank 0 entered a larger reduce-scatter than rank 1 and the job aborted (gloo: SIGABRT,
stages 0, 2, 3; the stage-1 path already reduced zeros). Now shard_model turns on FSDP2's
set_reduce_scatter_unused_params, and every trainable parameter has a gradient on every rank. The clipping norm
(global_grad_norm, one reduction per DTensor mesh) then enters the same collectives on every rank.

2 forked gloo ranks under a hard timeout, ZeRO 0-3 in one job, 2 steps with clipping. Reference: the unsharded
single-process run of the same two batches (AdamW + clip_grad_norm_ on the mean of the two losses). Per-step losses
and pre-clip grad norms within 1e-5 (fp32).
"""
import pytest
import torch
import torch.distributed as dist

import fsdpzero
from tests.engine_cases import ADAMW, SEQ, VOCAB, build_model
from tests.multirank import run_distributed

MICRO, STEPS, WORLD = 2, 2, 2
TOL = 1e-5


def data():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (STEPS, WORLD, MICRO, SEQ), generator=g)
    embeds = torch.randn(STEPS, MICRO, SEQ, 64, generator=g) * 0.02   # rank 1's inputs_embeds (hidden size 64)
    return ids, embeds


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def batch(rank: int, step: int, ids, embeds) -> dict:
    labels = ids[step, rank]
    if rank == 0:
        return {"input_ids": labels, "labels": labels}
    # a soft prompt trained outside the model: it requires grad, so the first block's input does too (without, that
    # block's FSDP2 post-backward waits for the final callback and runs after the root's: another order)
    return {"inputs_embeds": embeds[step].clone().requires_grad_(), "labels": labels}


def _ranks(rank, world, torch_switch=True):
    if not torch_switch:   # as on torch 2.11/2.12, which lack it: fsdp2_internals.zero_unused_grads steps in
        from torch.distributed.fsdp import FSDPModule
        if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
            del FSDPModule.set_reduce_scatter_unused_params   # this rank's process only
    ids, embeds = data()
    out = {}
    for stage in (0, 1, 2, 3):
        engine = fsdpzero.initialize(model=build_model("llama"), config=config(stage))[0]
        losses, norms = [], []
        for step in range(STEPS):
            loss = engine(**batch(rank, step, ids, embeds)).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            losses.append(mean.item())
            norms.append(float(engine.get_global_grad_norm()))
        out[f"stage {stage}"] = (losses, norms)
    return out


def _reference():
    ids, embeds = data()
    model = build_model("llama")
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, norms = [], []
    for step in range(STEPS):
        loss = sum(model(**batch(r, step, ids, embeds)).loss for r in range(WORLD)) / WORLD
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.parametrize("torch_switch", [True, False], ids=["set_reduce_scatter_unused_params", "zero_fill"])
def test_parameter_used_on_some_ranks_only(torch_switch):
    """torch_switch False: the fallback of torch 2.11/2.12 (no set_reduce_scatter_unused_params), with the torch
    switch removed in the ranks; without the fallback the ranks abort in the reduce-scatter."""
    out = run_distributed(_ranks, WORLD, torch_switch, timeout=240)[0]
    ref_losses, ref_norms = _reference()
    for stage in range(4):
        losses, norms = out[f"stage {stage}"]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (stage, losses, ref_losses)
        assert max(abs(a - b) for a, b in zip(norms, ref_norms)) <= TOL, (stage, norms, ref_norms)
