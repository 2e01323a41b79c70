"""fsdpzero.optim.schedulers vs (a) the published DeepSpeed formulas (ds_config_map.md §1.6), re-derived here
independently, and (b) DeepSpeed 0.19.8's own scheduler classes (`oracle`; exact equality)."""
import math
import os

import pytest
import torch

from fsdpzero.plan import SchedulerPlan
from fsdpzero.optim.schedulers import build_scheduler

STEPS = 260


def _opt(lr=0.01, groups=1, kind="adamw"):
    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    pg = [{"params": [p]} for p in ps]
    if kind == "sgd":
        return torch.optim.SGD(pg, lr=lr, momentum=0.9)
    return torch.optim.AdamW(pg, lr=lr, betas=(0.9, 0.95))


def _trace(sched, opt, steps=STEPS):
    """[(lr, beta1)] for group 0 at t = -1 (construction) and after each of `steps` steps."""
    def now():
        g = opt.param_groups[0]
        return (g["lr"], g.get("betas", (None,))[0])
    out = [now()]
    for _ in range(steps):
        sched.step()
        out.append(now())
    return out


# --- the published formulas, written from the spec, t = last_batch_iteration -------------------------------------
def f_warmup(t, lo, hi, n, kind):
    n = max(2, n)
    if t < 0:
        return lo
    g = (math.log(t + 1) / math.log(n) if kind == "log" else t / n) if t < n else 1.0
    return lo + (hi - lo) * g


def f_warmup_decay(t, lo, hi, n, kind, total):
    nn = max(2, n)
    if t < 0 or t < nn:
        return f_warmup(t, lo, hi, n, kind)
    return lo + (hi - lo) * max(0.0, (total - t) / max(1, total - nn))


def f_cosine(t, base, n, total, r0, c, kind):
    if t < 0:
        return 0.0
    n = max(2, n)
    if t < n:
        g = math.log(t + 1) / math.log(n) if kind == "log" else t / n
        return base * (r0 + (1 - r0) * g)
    p = min(1.0, (t - n + 1) / max(1, total - n))
    return base * max(0.0, c + (1 - c) * (1 + math.cos(math.pi * p)) / 2)


def f_onecycle(t, lo, hi, s1, s2, mlo, mhi, rate=0.0, dstep=0, mrate=0.0, stairs1=0, stairs2=None):
    if t < 0:
        return lo, mlo
    L = s1 + s2
    if t < L:
        i = t + 1
        x = i / L - math.floor(i / L)
        r = s1 / L
        scale = x / r if x <= r else (x - 1) / (r - 1)
        stairs = stairs1 if x <= r else (stairs1 if stairs2 is None else stairs2)
        if stairs:
            pos = i % L
            frac = pos / s1 if pos <= s1 else (L - pos) / s2
            scale = math.floor(frac * stairs + 1e-9) / stairs
        return lo + (hi - lo) * scale, mhi - (mhi - mlo) * scale
    k = t - L + 1
    lr = lo if (rate == 0 or dstep == 0) else lo / (1 + rate * k / dstep)
    mom = mhi if (mrate == 0 or dstep == 0) else mhi * (1 + mrate * k / dstep)
    return lr, mom


def f_range(t, lo, size, rate, stair):
    if t < 0:
        return lo
    k = (t + 1) / size
    return lo * (1 + rate * (math.floor(k) if stair else k))


CASES = {
    "warmup_log": ("WarmupLR", dict(warmup_min_lr=1e-5, warmup_max_lr=3e-3, warmup_num_steps=100),
                   lambda t: f_warmup(t, 1e-5, 3e-3, 100, "log")),
    "warmup_linear_optlr": ("WarmupLR", dict(warmup_min_lr=0.0, warmup_num_steps=37, warmup_type="linear"),
                            lambda t: f_warmup(t, 0.0, 0.01, 37, "linear")),   # max = optimizer lr (>= 0.17.2)
    "warmup_n1": ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=1),
                  lambda t: f_warmup(t, 0.0, 1e-3, 1, "log")),
    "decay_log": ("WarmupDecayLR", dict(total_num_steps=200, warmup_min_lr=0.0, warmup_max_lr=2e-3,
                                        warmup_num_steps=50), lambda t: f_warmup_decay(t, 0.0, 2e-3, 50, "log", 200)),
    "decay_linear_default_max": ("WarmupDecayLR", dict(total_num_steps=150, warmup_num_steps=20, warmup_type="linear"),
                                 lambda t: f_warmup_decay(t, 0.0, 0.001, 20, "linear", 150)),
    "cosine_log": ("WarmupCosineLR", dict(total_num_steps=180, warmup_num_steps=30, warmup_min_ratio=0.1),
                   lambda t: f_cosine(t, 0.01, 30, 180, 0.1, 1e-4, "log")),
    "cosine_linear_short": ("WarmupCosineLR", dict(total_num_steps=10, warmup_num_steps=20, cos_min_ratio=0.05,
                                                   warmup_type="linear"),
                            lambda t: f_cosine(t, 0.01, 20, 10, 0.0, 0.05, "linear")),
    "range_cont": ("LRRangeTest", dict(lr_range_test_min_lr=1e-4, lr_range_test_step_size=7,
                                       lr_range_test_step_rate=0.5), lambda t: f_range(t, 1e-4, 7, 0.5, False)),
    "range_stair": ("LRRangeTest", dict(lr_range_test_min_lr=1e-4, lr_range_test_step_size=9,
                                        lr_range_test_step_rate=2.0, lr_range_test_staircase=True),
                    lambda t: f_range(t, 1e-4, 9, 2.0, True)),
}

ONECYCLE = {
    "sym": dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=40),
    "asym_decay": dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=30, cycle_second_step_size=70,
                       decay_lr_rate=0.3, decay_step_size=10, decay_mom_rate=0.01, cycle_min_mom=0.85,
                       cycle_max_mom=0.95),
    "stairs": dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=30, cycle_second_step_size=45,
                   cycle_first_stair_count=4, cycle_second_stair_count=6, decay_lr_rate=0.1, decay_step_size=5),
    "stairs_first_only": dict(cycle_min_lr=1e-3, cycle_max_lr=5e-3, cycle_first_step_size=21,
                              cycle_first_stair_count=3, cycle_second_stair_count=0),
}


def _close(a, b):
    return abs(a - b) <= 1e-12 * max(1.0, abs(b))


@pytest.mark.parametrize("name", sorted(CASES))
def test_formula(name):
    typ, params, f = CASES[name]
    opt = _opt()
    tr = _trace(build_scheduler(SchedulerPlan(type=typ, params=params), opt), opt)
    for t, (lr, _) in enumerate(tr, start=-1):
        assert _close(lr, f(t)), (name, t, lr, f(t))


@pytest.mark.parametrize("name", sorted(ONECYCLE))
def test_onecycle_formula(name):
    p = ONECYCLE[name]
    opt = _opt()
    tr = _trace(build_scheduler(SchedulerPlan(type="OneCycle", params=p), opt), opt)
    s1 = p["cycle_first_step_size"]
    s2 = p.get("cycle_second_step_size") or s1
    for t, (lr, b1) in enumerate(tr, start=-1):
        elr, emom = f_onecycle(t, p["cycle_min_lr"], p["cycle_max_lr"], s1, s2, p.get("cycle_min_mom", 0.8),
                               p.get("cycle_max_mom", 0.9), p.get("decay_lr_rate", 0.0), p.get("decay_step_size", 0),
                               p.get("decay_mom_rate", 0.0), p.get("cycle_first_stair_count", 0),
                               p.get("cycle_second_stair_count"))
        assert _close(lr, elr) and _close(b1, emom), (name, t, lr, elr, b1, emom)
    assert opt.param_groups[0]["betas"][1] == 0.99   # DeepSpeed overwrites beta2 too


def test_onecycle_no_betas_keeps_momentum():
    opt = _opt(kind="sgd")
    s = build_scheduler(SchedulerPlan(type="OneCycle", params=ONECYCLE["sym"]), opt)
    _trace(s, opt, 10)
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9


def test_per_group_lists_and_state_dict_resume():
    opt = _opt(groups=2)
    params = dict(warmup_min_lr=[0.0, 1e-4], warmup_max_lr=[1e-3, 2e-3], warmup_num_steps=20, total_num_steps=50)
    s = build_scheduler(SchedulerPlan(type="WarmupDecayLR", params=params), opt)
    for _ in range(13):
        s.step()
    sd = s.state_dict()
    assert sd == {"last_batch_iteration": 12}
    assert opt.param_groups[1]["lr"] == pytest.approx(f_warmup(12, 1e-4, 2e-3, 20, "log"), rel=1e-12)
    opt2 = _opt(groups=2)
    s2 = build_scheduler(SchedulerPlan(type="WarmupDecayLR", params=params), opt2)
    s2.load_state_dict(sd)
    for _ in range(30):
        s.step()
        s2.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]
    assert s2.last_batch_iteration == s2.last_epoch == 42


def test_torch_fallback_and_errors():
    opt = _opt()
    s = build_scheduler(SchedulerPlan(type="StepLR", params={"step_size": 2, "gamma": 0.5}), opt)
    assert isinstance(s, torch.optim.lr_scheduler.StepLR)
    assert build_scheduler(SchedulerPlan(), opt) is None
    with pytest.raises(ValueError, match="scheduler.type='Warmuplr'"):
        build_scheduler(SchedulerPlan(type="Warmuplr"), opt)
    with pytest.raises(ValueError, match="warmup_max_lr"):
        build_scheduler(SchedulerPlan(type="WarmupCosineLR", params={"total_num_steps": 5, "warmup_max_lr": 1}), opt)
    with pytest.raises(ValueError, match="warmup_num_steps"):
        build_scheduler(SchedulerPlan(type="WarmupLR", params={"warmup_num_steps": 0}), opt)


# --- DeepSpeed 0.19.8 itself ---------------------------------------------------------------------------------------
def _ds_schedules():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed.runtime.lr_schedules")


ORACLE = [(typ, params) for typ, params, _ in CASES.values()] + [("OneCycle", p) for p in ONECYCLE.values()] + [
    ("WarmupLR", dict(warmup_min_lr=[0.0, 1e-5], warmup_max_lr=[1e-3, 1e-2], warmup_num_steps=64)),
    ("OneCycle", dict(cycle_min_lr=[1e-4, 2e-4], cycle_max_lr=[1e-3, 4e-3], cycle_first_step_size=13,
                      cycle_second_step_size=0, decay_lr_rate=0.5, decay_step_size=3)),
    ("WarmupCosineLR", dict(total_num_steps=1000, warmup_num_steps=1)),
]


@pytest.mark.oracle
@pytest.mark.parametrize("case", range(len(ORACLE)), ids=[f"{t}-{i}" for i, (t, _) in enumerate(ORACLE)])
def test_against_deepspeed(case):
    ds = _ds_schedules()
    typ, params = ORACLE[case]
    groups = 2 if any(isinstance(v, list) for v in params.values()) else 1
    for kind in ("adamw", "sgd") if typ == "OneCycle" else ("adamw",):
        ours_opt, ds_opt = _opt(groups=groups, kind=kind), _opt(groups=groups, kind=kind)
        ours = build_scheduler(SchedulerPlan(type=typ, params=params), ours_opt)
        theirs = getattr(ds, typ)(ds_opt, **params)
        for t in range(-1, 400):
            if t >= 0:
                ours.step()
                theirs.step()
            for a, b in zip(ours_opt.param_groups, ds_opt.param_groups):
                assert a["lr"] == b["lr"], (typ, t, a["lr"], b["lr"])
                assert a.get("betas") == b.get("betas"), (typ, t)
        assert ours.state_dict() == theirs.state_dict()
