"""bf16-style overflow checks (check_grad_overflow) without a host sync: the optimizer skips on the device and the
engine learns the verdict one step later. It must give exactly what the synchronous check gives (DeepSpeed's
semantics: no optimizer step, no scheduler step, skipped_steps + 1), for FSDP2 stages and stage 1."""
import os

import pytest
import torch
import torch.distributed as dist

import fsdpzero
from fsdpzero.plan import PrecisionPlan, SchedulerPlan
from fsdpzero.schedulers import build_scheduler
from tests.engine_cases import batches, build_model, engine_losses, full_params, make_plan
from tests.multirank import run_distributed

SCHED = SchedulerPlan(type="WarmupDecayLR", params={"warmup_min_lr": 0.0, "warmup_max_lr": 5e-4,
                                                    "warmup_num_steps": 3, "total_num_steps": 8,
                                                    "warmup_type": "linear"})
BAD_STEP = 3


def _run(rank, world, stage, sync):
    if sync:
        os.environ["FSDPZERO_SYNC_OVERFLOW_CHECK"] = "1"
    else:
        os.environ.pop("FSDPZERO_SYNC_OVERFLOW_CHECK", None)
    plan = make_plan(stage=stage, world=world, gas=2)
    plan = type(plan)(**{**plan.__dict__, "precision": PrecisionPlan(check_grad_overflow=True), "scheduler": SCHED})
    engine = fsdpzero.wrap(build_model("llama"), plan)
    assert engine._defer_verdict is (not sync)
    data = batches(6, 2, 4)
    m = data.shape[2] // world
    losses = []
    for i, step in enumerate(data):
        acc = torch.zeros(())
        for j, micro in enumerate(step):
            x = micro[rank * m:(rank + 1) * m]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            if i == BAD_STEP and j == len(step) - 1 and rank == 0:   # one rank's gradient overflows
                g = next(p.grad for p in engine.module.parameters() if p.grad is not None)
                (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")
            engine.step()
            acc += loss.detach().float()
        dist.all_reduce(acc)
        losses.append(acc.item())
    state = engine.client_state()
    return losses, full_params(engine.module), state["skipped_steps"], state["lr_scheduler"], engine.get_lr()


@pytest.mark.parametrize("stage", [2, 1])
def test_deferred_verdict_equals_synchronous_check(stage):
    deferred = run_distributed(_run, 2, stage, False, timeout=240)[0]
    synced = run_distributed(_run, 2, stage, True, timeout=240)[0]
    assert deferred[2] == synced[2] == 1                 # exactly one skipped step, counted
    assert deferred[3] == synced[3]                      # scheduler not advanced by the skipped step
    assert deferred[4] == synced[4]
    assert deferred[0] == synced[0]                      # same losses, bit for bit
    for k in synced[1]:
        assert torch.equal(deferred[1][k], synced[1][k]), k


@pytest.mark.parametrize("kind,params", [
    ("WarmupLR", {"warmup_num_steps": 4}),
    ("WarmupDecayLR", {"warmup_num_steps": 3, "total_num_steps": 9}),
    ("WarmupCosineLR", {"warmup_num_steps": 3, "total_num_steps": 9}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 3}),
    ("LRRangeTest", {"lr_range_test_step_size": 2}),
])
@pytest.mark.parametrize("steps", [0, 4])
def test_scheduler_rewind_undoes_one_step(kind, params, steps):
    def make():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        return opt, build_scheduler(SchedulerPlan(type=kind, params=params), opt)
    opt_a, a = make()
    opt_b, b = make()
    for _ in range(steps):
        a.step()
        b.step()
    b.step()
    b.rewind()
    assert a.state_dict() == b.state_dict()
    assert [g["lr"] for g in opt_a.param_groups] == [g["lr"] for g in opt_b.param_groups]
    assert [g["betas"] for g in opt_a.param_groups] == [g["betas"] for g in opt_b.param_groups]
    a.step()
    b.step()
    assert [g["lr"] for g in opt_a.param_groups] == [g["lr"] for g in opt_b.param_groups]
