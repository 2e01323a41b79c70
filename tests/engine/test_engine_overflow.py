"""bf16-style overflow checks (check_grad_overflow) without a host sync: the optimizer skips on the device and the
engine learns the verdict one step later. It must give exactly what the synchronous check gives (DeepSpeed's
semantics: no optimizer step, no scheduler step, skipped_steps + 1), for FSDP2 stages and stage 1; with fp16 the
dynamic loss scaler runs on the device as well (same scales, same skips, the floor error one step late)."""
import os
import types

import pytest
import torch
import torch.distributed as dist

import fsdpzero
from fsdpzero.loss_scaler import LossScaleFloorError, make_loss_scaler
from fsdpzero.plan import LossScalePlan, PrecisionPlan, SchedulerPlan
from fsdpzero.optim.schedulers import build_scheduler
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
    assert (engine._defer_verdict and engine.grad_path.can_skip_on_device()) is (not sync)
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


# fp16 dynamic scaling, scale started high enough that the (scaled) grad norm overflows fp32 by itself: it overflows
# at the start, on the injected inf, and again each time the short window lets the scale grow back.
FP16 = LossScalePlan(initial_scale_power=66, loss_scale_window=2, hysteresis=2, min_loss_scale=1.0)
FP16_SCHED = SchedulerPlan(type="WarmupDecayLR", params={"warmup_min_lr": 0.0, "warmup_max_lr": 5e-4,
                                                         "warmup_num_steps": 3, "total_num_steps": 14,
                                                         "warmup_type": "linear"})
FP16_STEPS = 10


def _run_fp16(rank, world, stage, sync, scaler):
    _set_sync(sync)
    plan = make_plan(stage=stage, world=world, gas=2, fp16=scaler)
    plan = type(plan)(**{**plan.__dict__, "scheduler": FP16_SCHED})
    engine = fsdpzero.wrap(build_model("llama"), plan)
    assert engine._defer_verdict is (not sync)
    data = batches(FP16_STEPS, 2, 4)
    m = data.shape[2] // world
    losses, host, device = [], [], []
    for i, step in enumerate(data):
        acc = torch.zeros(())
        for j, micro in enumerate(step):
            x = micro[rank * m:(rank + 1) * m]
            loss = engine(input_ids=x, labels=x).loss
            if i == BAD_STEP and j == 0 and rank == 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            acc += loss.detach().float()
        dist.all_reduce(acc)
        losses.append(acc.item())
        host.append(engine.loss_scaler.state_dict())         # the host copy as it stands: no settling here
        device.append(engine.loss_scaler.device_state() if hasattr(engine.loss_scaler, "device_state") else None)
    state = engine.client_state()                           # settles the last verdict
    return dict(losses=losses, params=full_params(engine.module), skipped=state["skipped_steps"],
                sched=state["lr_scheduler"], lr=engine.get_lr(), scaler=state["loss_scaler"], host=host,
                device=device, global_steps=engine.global_steps)


def _set_sync(sync):
    if sync:
        os.environ["FSDPZERO_SYNC_OVERFLOW_CHECK"] = "1"
    else:
        os.environ.pop("FSDPZERO_SYNC_OVERFLOW_CHECK", None)


STATIC = LossScalePlan(loss_scale=1000.0)     # not a power of two: the unscale is still the same multiply


@pytest.mark.parametrize("stage,scaler", [(2, FP16), (1, FP16), (3, FP16), (2, STATIC)],
                         ids=["z2", "z1", "z3", "static"])
def test_fp16_deferred_scaler_equals_synchronous(stage, scaler):
    """The device-side scaler and skip give bit for bit what the synchronous path gives, several overflows long;
    the host copy lags one verdict behind until something reads it; the scales are DeepSpeed's own scaler's."""
    deferred = run_distributed(_run_fp16, 2, stage, False, scaler, timeout=240)[0]
    synced = run_distributed(_run_fp16, 2, stage, True, scaler, timeout=240)[0]
    assert synced["skipped"] >= (4 if scaler is FP16 else 1), synced["skipped"]   # it overflows several times
    for key in ("losses", "skipped", "sched", "lr", "scaler", "global_steps"):
        assert deferred[key] == synced[key], key
    for k in synced["params"]:
        assert torch.equal(deferred["params"][k], synced["params"][k]), k
    if scaler is STATIC:
        return
    assert deferred["device"] == synced["host"]            # the device state is current after every step...
    initial = make_loss_scaler(FP16).state_dict()
    assert deferred["host"] == [initial] + synced["host"][:-1]   # ...the host's one verdict behind
    assert _deepspeed_scales(synced["host"]) == [h["cur_scale"] for h in synced["host"]]


def _deepspeed_scales(states):
    """DeepSpeed's DynamicLossScaler fed the overflow verdicts the run saw (an overflow = last_overflow_iter moved)."""
    ds = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    ds.dist = types.SimpleNamespace(get_rank=lambda: 1)   # its logging asks DeepSpeed's comm for the rank
    oracle = ds.DynamicLossScaler(init_scale=2.0 ** FP16.initial_scale_power, scale_window=FP16.loss_scale_window,
                                  min_scale=FP16.min_loss_scale, delayed_shift=FP16.hysteresis,
                                  consecutive_hysteresis=FP16.consecutive_hysteresis)
    scales = []
    for i, s in enumerate(states):
        oracle.update_scale(s["last_overflow_iter"] == i)
        scales.append(oracle.cur_scale)
    return scales


def _floor_step(rank, world, sync):
    """The step whose engine.step() raised the floor error (scale at min_loss_scale after the first overflow)."""
    _set_sync(sync)
    floor = LossScalePlan(initial_scale_power=66, loss_scale_window=2, hysteresis=1, min_loss_scale=2.0 ** 65)
    plan = make_plan(stage=2, world=world, gas=1, fp16=floor)
    engine = fsdpzero.wrap(build_model("llama"), plan)
    m = 2
    for i, step in enumerate(batches(4, 1, 4)):
        x = step[0][rank * m:(rank + 1) * m]
        engine.backward(engine(input_ids=x, labels=x).loss)
        try:
            engine.step()
        except LossScaleFloorError:
            return i
    return None


def test_fp16_floor_error_raised_one_step_late():
    assert run_distributed(_floor_step, 2, True, timeout=120) == [1, 1]     # overflow at the floor: step 1
    assert run_distributed(_floor_step, 2, False, timeout=120) == [2, 2]    # learned when step 1's verdict is read
