"""fsdpzero.loss_scaler vs hand-derived DeepSpeed sequences, vs DeepSpeed's DynamicLossScaler (`oracle`), its
device copy (state in 0-dim tensors, advanced from a found_inf tensor) vs its host rule, and found_inf agreeing
across 2 gloo ranks (plain tensors and DTensor shards)."""
import os
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from fsdpzero.loss_scaler import DynamicLossScaler, LossScaleFloorError, StaticLossScaler, found_inf, make_loss_scaler
from fsdpzero.plan import LossScalePlan
from tests.multirank import run_distributed


def _run(scaler, overflows):
    scales, hyst = [], []
    for o in overflows:
        scaler.update(bool(o))
        scales.append(scaler.loss_scale)
        hyst.append(scaler.cur_hysteresis)
    return scales, hyst


OVERFLOWS = [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1]


def test_hand_derived_hysteresis():
    # Derived by hand from DeepSpeed's rule (module docstring): window 2, hysteresis 2, 2**4 start.
    s = make_loss_scaler(LossScalePlan(initial_scale_power=4, loss_scale_window=2, hysteresis=2))
    assert _run(s, OVERFLOWS) == ([16, 16, 32, 32, 16, 16, 16, 32, 32, 32, 16],
                                  [2, 2, 2, 1, 1, 1, 1, 2, 1, 1, 1])


def test_hand_derived_consecutive_hysteresis():
    s = make_loss_scaler(LossScalePlan(initial_scale_power=4, loss_scale_window=2, hysteresis=2,
                                       consecutive_hysteresis=True))
    assert _run(s, OVERFLOWS) == ([16, 16, 32, 32, 16, 16, 16, 32, 32, 32, 32],
                                  [2, 2, 2, 1, 1, 2, 2, 2, 1, 2, 1])


@pytest.mark.parametrize("power,floor,expected", [(2, 1, [2, 1]), (3, 3, [4, 3])])
def test_floor_then_abort(power, floor, expected):
    s = make_loss_scaler(LossScalePlan(initial_scale_power=power, hysteresis=1, min_loss_scale=floor))
    assert _run(s, [1, 1])[0] == expected
    with pytest.raises(LossScaleFloorError, match="min_loss_scale"):
        s.update(True)


def test_static_and_none_and_scale_loss():
    assert make_loss_scaler(None) is None
    s = make_loss_scaler(LossScalePlan(loss_scale=128.0))
    assert isinstance(s, StaticLossScaler) and not s.dynamic
    for o in (True, False, True):
        s.update(o)
    assert s.loss_scale == 128.0 and s.scale_loss(torch.tensor(0.5)).item() == 64.0
    d = make_loss_scaler(LossScalePlan())
    assert isinstance(d, DynamicLossScaler) and d.loss_scale == 65536.0
    with pytest.raises(ValueError, match="fp16.loss_scale_window=0"):
        make_loss_scaler(LossScalePlan(loss_scale_window=0))


def test_state_dict_round_trip():
    a = make_loss_scaler(LossScalePlan(initial_scale_power=8, loss_scale_window=3))
    _run(a, [0, 1, 0, 0, 1])
    b = make_loss_scaler(LossScalePlan(initial_scale_power=8, loss_scale_window=3))
    b.load_state_dict(a.state_dict())
    seq = [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert _run(a, seq) == _run(b, seq)


def _device_twin(plan: LossScalePlan):
    """A scaler run the engine's deferred way: the device copy advanced from found_inf, the host settled after."""
    s = make_loss_scaler(plan)
    s.on_device(torch.device("cpu"))
    return s


def _step_device(s, overflow: bool) -> None:
    s.update_on_device(torch.tensor(float(overflow)))
    assert s.live_scale.dtype == torch.float32 and s.live_scale.item() == float(s.device_state()["cur_scale"])
    s.settle(overflow)                       # raises the floor error here, after the device already moved
    assert s.device_state() == s.state_dict()


@pytest.mark.parametrize("consecutive", [False, True])
def test_device_state_follows_host_rule(consecutive):
    host = make_loss_scaler(LossScalePlan(initial_scale_power=4, loss_scale_window=2, hysteresis=2,
                                          consecutive_hysteresis=consecutive))
    dev = _device_twin(LossScalePlan(initial_scale_power=4, loss_scale_window=2, hysteresis=2,
                                     consecutive_hysteresis=consecutive))
    for o in OVERFLOWS + OVERFLOWS[::-1]:
        host.update(bool(o))
        _step_device(dev, bool(o))
        assert dev.state_dict() == host.state_dict()
    dev.update(True)                         # a synchronous update re-seeds the device copy
    assert dev.device_state() == dev.state_dict()
    fresh = _device_twin(LossScalePlan(initial_scale_power=4, loss_scale_window=2, hysteresis=2))
    fresh.load_state_dict(host.state_dict())  # so does a checkpoint load
    assert fresh.device_state() == host.state_dict()


def test_device_floor_error_one_step_late():
    dev = _device_twin(LossScalePlan(initial_scale_power=2, hysteresis=1, min_loss_scale=1))
    _step_device(dev, True)
    _step_device(dev, True)
    assert dev.loss_scale == 1
    dev.update_on_device(torch.tensor(1.0))  # overflow at the floor: the device keeps the floor, no error yet
    assert dev.device_state()["cur_scale"] == 1
    with pytest.raises(LossScaleFloorError, match="min_loss_scale"):
        dev.settle(True)


def test_static_scaler_device_hooks():
    s = make_loss_scaler(LossScalePlan(loss_scale=1000.0))
    s.on_device(torch.device("cpu"))
    s.update_on_device(torch.tensor(1.0))
    s.settle(True)
    assert s.live_scale == s.loss_scale == 1000.0


@pytest.mark.oracle
def test_against_deepspeed_random_sequences(monkeypatch):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(ds.dist, "get_rank", lambda *a, **k: 0)   # DeepSpeed logs on rank 0 only
    rng = random.Random(1234)
    aborts = 0
    for trial in range(300):
        plan = LossScalePlan(initial_scale_power=rng.randint(1, 8), loss_scale_window=rng.randint(1, 6),
                             hysteresis=rng.randint(1, 4), consecutive_hysteresis=rng.random() < 0.5,
                             min_loss_scale=rng.choice([1, 2, 3, 0.25]))
        ours = make_loss_scaler(plan)
        dev = _device_twin(plan) if trial % 6 == 0 else None   # the device rule too, on a sixth of the trials
        theirs = ds.DynamicLossScaler(init_scale=2 ** plan.initial_scale_power, scale_window=plan.loss_scale_window,
                                      min_scale=plan.min_loss_scale, delayed_shift=plan.hysteresis,
                                      consecutive_hysteresis=plan.consecutive_hysteresis)
        p = rng.choice([0.05, 0.2, 0.5])
        for i in range(120):
            o = rng.random() < p
            try:
                theirs.update_scale(o)
            except Exception:
                with pytest.raises(LossScaleFloorError):
                    ours.update(o)
                if dev is not None:
                    with pytest.raises(LossScaleFloorError):
                        _step_device(dev, o)
                aborts += 1
                break
            ours.update(o)
            if dev is not None:
                _step_device(dev, o)
                assert dev.state_dict() == ours.state_dict()
            assert (ours.cur_scale, ours.cur_hysteresis, ours.last_overflow_iter, ours.cur_iter) == \
                (theirs.cur_scale, theirs.cur_hysteresis, theirs.last_overflow_iter, theirs.cur_iter), (trial, i)
    assert aborts > 0   # the floor abort was exercised


def test_found_inf_single_process():
    assert not found_inf([torch.ones(3), None, torch.zeros(0)])
    assert found_inf([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert found_inf([torch.tensor([float("-inf")], dtype=torch.float16)])
    assert not found_inf([torch.full((4,), 60000.0, dtype=torch.float16)])   # big but finite: no false alarm
    assert found_inf(torch.tensor(float("inf"))) and not found_inf(torch.tensor(3.0))


def _found_inf_ranks(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0)
    full[6] = float("inf")                 # lands in rank 1's shard only
    dgrad = distribute_tensor(full, mesh, [Shard(0)])
    local_has_inf = not torch.isfinite(dgrad.to_local()).all().item()
    plain = [torch.ones(2)] if rank == 0 else [torch.tensor([float("nan")])]
    clean = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    return (local_has_inf, found_inf([dgrad]), found_inf(plain), found_inf([clean]),
            found_inf(torch.tensor(1.0) if rank == 0 else torch.tensor(float("nan"))))


@pytest.mark.timeout(120)
def test_found_inf_agrees_across_ranks():
    r0, r1 = run_distributed(_found_inf_ranks, 2, timeout=90)
    assert r0[0] is False and r1[0] is True          # only rank 1 sees the inf locally...
    assert r0[1:] == r1[1:] == (True, True, False, True)   # ...but every rank reports it
