"""DeepSpeed's learning-rate schedules as torch `LRScheduler`s, bit-exact with DeepSpeed 0.19.8.

The engine steps a scheduler once per optimizer step (not on fp16-overflow steps, like DeepSpeed). The schedule
index t is DeepSpeed's `last_batch_iteration`: -1 after construction, t after the (t+1)-th step; it is also torch's
`last_epoch`. Float expressions are evaluated in DeepSpeed's order (e.g. `log(t+1) * (1/log N)`, not a division)
so that every lr is the same double, not merely close. state_dict() is DeepSpeed's `{'last_batch_iteration': t}`.

Construction writes DeepSpeed's initial values into the optimizer (t = -1): WarmupLR/WarmupDecayLR the min lr,
WarmupCosineLR 0.0, OneCycle the min lr and betas=(min_mom, 0.99), LRRangeTest the min lr.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from fsdpzero.plan import SchedulerPlan

log = logging.getLogger(__name__)

DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list:
    """A scalar applies to every param group; a list/tuple must give one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"scheduler.params.{name}: {len(value)} values given for "
                             f"{len(optimizer.param_groups)} param groups; give one per group or a single number")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"scheduler.params.{name}={value!r}: must be a positive integer")
    return value


def _warmup_type(value: str) -> str:
    if value not in ("log", "linear"):
        log.warning("scheduler.params.warmup_type=%r is not 'log' or 'linear'; using 'log' as DeepSpeed does", value)
        return "log"
    return value


class DeepSpeedSchedule(LRScheduler):
    """Common shell: t lives in `last_epoch`; subclasses give `initial_lrs()` (t = -1) and `lrs_at(t)`."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1):
        self._start_at = last_batch_iteration   # torch's base insists on `initial_lr` keys when resuming; DS not
        super().__init__(optimizer, last_epoch=-1)

    # torch's base class steps once at construction; DeepSpeed does not, it only writes the t = -1 values.
    def _initial_step(self) -> None:
        self._step_count = 1
        self.last_epoch = self._start_at
        if self.last_epoch == -1:
            self._write(self.initial_lrs())
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch

    @last_batch_iteration.setter
    def last_batch_iteration(self, t: int) -> None:
        self.last_epoch = t

    def initial_lrs(self) -> list[float]:
        raise NotImplementedError

    def lrs_at(self, t: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch) if self.last_epoch >= 0 else self.initial_lrs()

    def step(self, last_batch_iteration: int | None = None) -> None:  # DeepSpeed's signature
        self._step_count += 1
        self.last_epoch = self.last_epoch + 1 if last_batch_iteration is None else last_batch_iteration
        self._write(self.get_lr())

    def rewind(self) -> None:
        """Undo the last step (the engine stepped optimistically and later learned that the step overflowed)."""
        self._step_count -= 1
        if self.last_epoch > 0:
            self.step(self.last_epoch - 1)
            self._step_count -= 1
        else:
            self.last_epoch = -1
            self._write(self.initial_lrs())

    def _write(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):   # tensor lrs (capturable/fused optimizers) stay tensors
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Also what get_last_lr() reports: the rate of the restored step, not the one this object was built at
        (the Trainer logs it before the next step; a resumed run logs what the uninterrupted run logged)."""
        self.last_epoch = state_dict["last_batch_iteration"]
        self._last_lr = list(self.get_lr())


class WarmupLR(DeepSpeedSchedule):
    """min → max over N = max(2, warmup_num_steps) steps (log: ln(t+1)/ln N, linear: t/N), then max.
    warmup_max_lr None means the optimizer's lr (DeepSpeed >= 0.17.2)."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float | list = 0.0,
                 warmup_max_lr: float | list | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        _positive_int(warmup_num_steps, "warmup_num_steps")
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def warmup_gamma(self, t: int) -> float | None:
        if t >= self.warmup_num_steps:
            return None
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(t + 1)
        return t / self.warmup_num_steps

    def gamma(self, t: int) -> float:
        g = self.warmup_gamma(t)
        return 1.0 if g is None else g

    def initial_lrs(self) -> list[float]:
        return list(self.min_lrs)

    def lrs_at(self, t: int) -> list[float]:
        g = self.gamma(t)
        return [lo + (d * g) for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps: γ = max(0, (T−t)/max(1, T−N)).
    warmup_max_lr defaults to 0.001 here on every DeepSpeed version (not the optimizer lr)."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: float | list = 0.0,
                 warmup_max_lr: float | list = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            log.warning("scheduler.params.total_num_steps=%s is less than warmup_num_steps=%s",
                        total_num_steps, warmup_num_steps)

    def gamma(self, t: int) -> float:
        g = self.warmup_gamma(t)
        if g is not None:
            return g
        return max(0.0, float(self.total_num_steps - t) / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(DeepSpeedSchedule):
    """lr = optimizer lr × ratio; ratio warms r0 → 1, then follows a cosine to cos_min_ratio (clamped at the end)."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        _positive_int(warmup_num_steps, "warmup_num_steps")
        self.total_num_steps = total_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if total_num_steps < self.warmup_num_steps:
            log.warning("scheduler.params.total_num_steps=%s is less than warmup_num_steps=%s",
                        total_num_steps, warmup_num_steps)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, t: int) -> float:
        if t < self.warmup_num_steps:
            if self.warmup_type == "log":
                r = self.inverse_log_warm_up * math.log(t + 1)
            else:
                r = t / self.warmup_num_steps
            return self.warmup_min_ratio + r * (1. - self.warmup_min_ratio)
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        r = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * r)

    def initial_lrs(self) -> list[float]:
        return [0.0 for _ in self.org_lrs]

    def lrs_at(self, t: int) -> list[float]:
        r = self.ratio(t)
        return [lr * r for lr in self.org_lrs]


class OneCycle(DeepSpeedSchedule):
    """One triangular cycle min → max → min over s1 + s2 steps (optionally in stairs), then 1/(1+rate·k) decay.

    With cycle_momentum (and an optimizer with `betas`), beta1 cycles inversely max_mom → min_mom → max_mom and
    every group's betas are overwritten with (beta1, 0.99), as DeepSpeed does: the configured beta2 is lost.
    """

    def __init__(self, optimizer: Optimizer, cycle_min_lr: float | list, cycle_max_lr: float | list,
                 decay_lr_rate: float = 0., cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float | list = 0.8,
                 cycle_max_mom: float | list = 0.9, decay_mom_rate: float = 0., last_batch_iteration: int = -1):
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"scheduler.params.cycle_first_step_size={cycle_first_step_size!r}: must be positive")
        if second < 0:
            raise ValueError(f"scheduler.params.cycle_second_step_size={cycle_second_step_size!r}: must be >= 0")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            log.warning("OneCycle: cycle_momentum is off because %s has no betas", type(optimizer).__name__)
        if self.cycle_momentum:
            self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
            self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
            self.decay_mom_rate = decay_mom_rate
            self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
            if last_batch_iteration == -1:
                for group, mom in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = (mom, 0.99)
        super().__init__(optimizer, last_batch_iteration)

    def scale(self, t: int) -> float:
        i = t + 1
        x = 1. + i / self.total_size - math.floor(1 + i / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantised from the integer position in the cycle, not from `scale` (DeepSpeed 0.19.4+).
            pos = i % self.total_size
            if pos <= self.first_step_size:
                stair = pos * stairs / self.first_step_size
            else:
                stair = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def initial_lrs(self) -> list[float]:
        return list(self.min_lrs)

    def lrs_at(self, t: int) -> list[float]:
        if t < self.total_size:
            s = self.scale(t)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((t - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def beta1s_at(self, t: int) -> list[float]:
        if t < self.total_size:
            s = self.scale(t)
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((t - self.total_size + 1) / self.decay_step_size)
        return [hi * factor for hi in self.max_moms]

    def rewind(self) -> None:
        super().rewind()
        if self.cycle_momentum and self.last_epoch == -1:
            for group, mom in zip(self.optimizer.param_groups, self.min_moms):
                group["betas"] = (mom, 0.99)

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self.beta1s_at(self.last_epoch)):
                group["betas"] = (beta1, 0.99)


class LRRangeTest(DeepSpeedSchedule):
    """lr = min_lr · (1 + rate · (t+1)/size), the interval floored when staircase."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: float | list = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def initial_lrs(self) -> list[float]:
        return list(self.min_lrs)

    def lrs_at(self, t: int) -> list[float]:
        interval = float(t + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [lo * increase for lo in self.min_lrs]


_CLASSES = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def build_scheduler(plan: SchedulerPlan, optimizer: Optimizer) -> LRScheduler | None:
    """The scheduler section as an LRScheduler stepped once per optimizer step; None when there is no section.

    DeepSpeed's five names are built here; any other name is `torch.optim.lr_scheduler.<type>(optimizer, **params)`
    (case-sensitive, as DeepSpeed resolves it).
    """
    if plan.type is None:
        return None
    cls = _CLASSES.get(plan.type) or getattr(torch.optim.lr_scheduler, plan.type, None)
    if not (isinstance(cls, type) and issubclass(cls, LRScheduler)):
        raise ValueError(f"scheduler.type={plan.type!r} is neither a DeepSpeed schedule {DEEPSPEED_SCHEDULERS} nor "
                         f"a class in torch.optim.lr_scheduler; fix the name (it is case-sensitive)")
    try:
        return cls(optimizer, **plan.params)
    except TypeError as e:  # an unknown or missing keyword: DeepSpeed also fails here, less clearly
        raise ValueError(f"scheduler.params={plan.params!r} do not fit scheduler.type={plan.type!r}: {e}. "
                         f"Remove the unknown key or add the missing one") from e
