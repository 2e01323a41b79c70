"""The speculative CPU step of the offload path (fsdpzero/offload_speculate.py) on 2 gloo ranks, staged through
buffers as on a GPU. Speculation may only change *when* the CPU works, never a bit of the result: every run equals
the same run with FSDPZERO_OFFLOAD_SPECULATE=0 exactly (losses and final params), across steps that commit (factor
1.0), steps that clip (dropped), a skipped step (backward, no step), an lr changed between backward and step, the
early stop on the partial norm, and the overlapped step. The counters prove each branch ran."""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdpzero import offload
from fsdpzero.optim import clip_factor
from fsdpzero.plan import BatchPlan, OffloadPlan, Plan
from tests.multirank import run_distributed
from tests.test_offload import HYPER
from tests.test_offload_pipeline import _stage2_model

NEVER, ALWAYS = 1e9, 1e-3   # clip thresholds: never clips / always clips on this model
# per step: (clip used by the step, skip the step, halve the lr after backward)
SCHEDULE = [(NEVER, False, False), (ALWAYS, False, False), (NEVER, False, False), (NEVER, True, False),
            (NEVER, False, False), (NEVER, False, True), (ALWAYS, False, False), (NEVER, False, False)]


def _run(speculate, overlap, plan_clip):
    os.environ["FSDPZERO_OFFLOAD_SPECULATE"] = "1" if speculate else "0"
    model = _stage2_model()
    plan = Plan(offload=OffloadPlan(optimizer_device="cpu", sub_group_size=700),
                batch=BatchPlan(gradient_clipping=plan_clip))
    path = offload.build_grad_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER), stage=True,
                                   overlap=overlap)
    assert (path.spec is not None) == speculate
    gen = torch.Generator().manual_seed(300 + dist.get_rank())
    losses, outcomes = [], []
    for clip, skip, halve_lr in SCHEDULE:
        x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
        path.set_sync(True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        path.finish_gradients()
        if halve_lr:             # e.g. a hand-written lr rule between backward and step
            for g in path.optimizer.param_groups:
                g["lr"] = g["lr"] * 0.5
        path.scale_grads_(clip_factor(path.grad_norm(), clip))
        if not skip:
            path.step()
        path.zero_grad()
        if speculate:
            path.wait()
            outcomes.append(path.spec.last)
        losses.append(loss.item())
    path.wait()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    stats = dict(path.spec.stats) if path.spec is not None else {}
    path.close()
    return losses, full, outcomes, stats


def _scenario(rank, world, overlap, plan_clip):
    torch.set_num_threads(2)
    return _run(False, overlap, plan_clip), _run(True, overlap, plan_clip)


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_speculation_commits_drops_and_changes_nothing(overlap):
    for (ref_losses, ref, _, _), (losses, got, outcomes, stats) in run_distributed(_scenario, 2, overlap, NEVER,
                                                                                     timeout=180):
        assert losses == ref_losses
        assert all(torch.equal(got[k], ref[k]) for k in ref)
        # committed where the factor was 1.0 and the lr unchanged; dropped when clipped or skipped
        assert outcomes[0] == outcomes[2] == outcomes[4] == outcomes[7] == "committed"
        assert outcomes[1] == outcomes[3] == outcomes[6] == "dropped"
        assert stats["entries_committed"] > 0 and stats["stopped_early"] == 0


def test_partial_norm_stops_speculation_early():
    """gradient_clipping far below this model's norms: this rank's partial sum of squares already proves the step
    will clip, so the worker stops stepping; the results are still those of the run without speculation."""
    for (ref_losses, ref, _, _), (losses, got, outcomes, stats) in run_distributed(_scenario, 2, False, ALWAYS,
                                                                                     timeout=180):
        assert losses == ref_losses
        assert all(torch.equal(got[k], ref[k]) for k in ref)
        assert stats["stopped_early"] >= 6 and stats["entries_committed"] == 0
