"""fp16 loss scaling with DeepSpeed's exact semantics (its `DynamicLossScaler` / static `LossScaler`).

The engine multiplies the loss by `loss_scale` before backward, unscales the gradients, asks `found_inf` whether any
rank saw a non-finite gradient, skips the optimizer (and scheduler) step if so, and calls `update(overflow)` once per
optimizer step. torch's `GradScaler` is close but has no hysteresis and no floor, so the schedule differs.

Dynamic rule, per optimizer step (iteration i counts every step, skipped or not):
- overflow: if hysteresis is exhausted (`hysteresis == 1` or the counter is at 1) the scale halves, floored at
  `min_loss_scale`; an overflow while already *at* the floor aborts the run. Otherwise the counter drops by one.
  The counter is not refilled when the scale is cut. `last_overflow = i`.
- clean: with `consecutive_hysteresis` the counter is refilled; when `i - last_overflow - 1` is a positive multiple
  of `loss_scale_window` the scale doubles and the counter is refilled.

Without a host sync (`on_device`, chosen by the engine when the optimizer can skip on the device): the state also
lives in 0-dim device tensors that `update_on_device(found_inf)` advances with the same rule in torch ops, so the
next backward multiplies by a device scale and nothing waits for the verdict. The host attributes stay DeepSpeed's
(checkpoints, `loss_scale`, logs) and catch up when the engine reads the verdict, one step later or on demand
(`settle`). The floor error is raised then: one more step has run (and, the scale sitting at the floor, most likely
been skipped too) before the run aborts.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist

from fsdpzero.log import is_rank0
from fsdpzero.plan import LossScalePlan
from fsdpzero.dist import local_tensor

log = logging.getLogger(__name__)


class LossScaleFloorError(RuntimeError):
    """Overflow with the dynamic scale already at min_loss_scale: DeepSpeed ends the run here, and so do we."""


class StaticLossScaler:
    """fp16 `loss_scale > 0`: a fixed scale. Overflowing steps are still skipped by the engine."""
    dynamic = False

    def __init__(self, scale: float):
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale

    @property
    def live_scale(self) -> float:
        return self.cur_scale

    def on_device(self, device: torch.device) -> None:
        pass

    def update_on_device(self, found_inf: torch.Tensor) -> None:
        pass

    def update(self, overflow: bool) -> None:
        if overflow and is_rank0():
            log.warning("fp16 overflow with static loss scale %s: step skipped", self.cur_scale)

    settle = update

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler:
    """DeepSpeed's dynamic scaler; attribute names follow DeepSpeed's so its checkpoints map one to one."""
    dynamic = True
    scale_factor = 2.0

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, hysteresis: int,
                 consecutive_hysteresis: bool):
        self.cur_scale = float(init_scale)
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis
        self._dev: dict[str, torch.Tensor] | None = None   # the same state on the device (on_device), or None

    @property
    def loss_scale(self) -> float:
        """The host's scale: exact after `settle`, one verdict behind the device's before it."""
        return self.cur_scale

    @property
    def live_scale(self) -> torch.Tensor | float:
        """The scale the next backward uses: fp32 0-dim on the device with `on_device`, else the host float."""
        return self._dev["scale32"] if self._dev is not None else self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.live_scale

    def on_device(self, device: torch.device) -> None:
        """Keep the state in device tensors from now on, seeded from the host attributes."""
        # fp64 scale: the same values as the host's Python float (min_loss_scale need not be a power of two)
        scale = torch.tensor(self.cur_scale, dtype=torch.float64, device=device)
        self._dev = {"scale": scale, "scale32": scale.float(),
                     **{k: torch.tensor(getattr(self, k), dtype=torch.int64, device=device)
                        for k in ("cur_iter", "last_overflow_iter", "cur_hysteresis")}}

    def update_on_device(self, found_inf: torch.Tensor) -> None:
        """`update` in torch ops from a 0-dim overflow flag (1.0 = overflow), without reading it on the host."""
        d, where = self._dev, torch.where
        overflow = found_inf.to(d["scale"].device) > 0
        scale, it, last, hyst = d["scale"], d["cur_iter"], d["last_overflow_iter"], d["cur_hysteresis"]
        full = torch.full_like(hyst, self.delayed_shift)
        # overflow: halve (floored) once hysteresis is exhausted, else count it down
        exhausted = (hyst == 1) | (self.delayed_shift == 1)
        of_scale = where(exhausted, (scale / self.scale_factor).clamp(min=self.min_scale), scale)
        of_hyst = where(exhausted, hyst, hyst - 1)
        # clean: double every scale_window stable iterations, refilling the counter
        stable = it - last - 1
        grow = (stable > 0) & (stable % self.scale_window == 0)
        ok_hyst = where(grow, full, full if self.consecutive_hysteresis else hyst)
        ok_scale = where(grow, scale * self.scale_factor, scale)
        new_scale = where(overflow, of_scale, ok_scale)
        self._dev = {"scale": new_scale, "scale32": new_scale.float(), "cur_iter": it + 1,
                     "last_overflow_iter": where(overflow, it, last),
                     "cur_hysteresis": where(overflow, of_hyst, ok_hyst)}

    def device_state(self) -> dict[str, float | int] | None:
        """The device copy as host numbers (a sync; for tests and checks)."""
        if self._dev is None:
            return None
        return {"cur_scale": self._dev["scale"].item(),
                **{k: int(self._dev[k].item()) for k in ("cur_iter", "last_overflow_iter", "cur_hysteresis")}}

    def settle(self, overflow: bool) -> None:
        """The host catches up with a verdict the device already applied (LossScaleFloorError raised here)."""
        self._update_host(overflow)

    def update(self, overflow: bool) -> None:
        """DeepSpeed's `update_scale`: one optimizer step's verdict, known on the host at once."""
        self._update_host(overflow)
        if self._dev is not None:
            self.on_device(self._dev["scale"].device)

    def _update_host(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise LossScaleFloorError(
                        f"fp16 gradients overflowed with the loss scale already at fp16.min_loss_scale="
                        f"{self.min_scale} (step {self.cur_iter}); DeepSpeed aborts here too. The model diverges "
                        f"or fp16 cannot hold its gradients: lower the lr, or train in bf16 (\"bf16\": "
                        f"{{\"enabled\": true}})")
                new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                if is_rank0():
                    log.info("fp16 overflow: step skipped, loss scale %s -> %s", self.cur_scale, new_scale)
                self.cur_scale = new_scale
            else:
                if is_rank0():
                    log.info("fp16 overflow: step skipped, loss scale %s kept (hysteresis %d -> %d)",
                             self.cur_scale, self.cur_hysteresis, self.cur_hysteresis - 1)
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    _STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self._STATE:
            setattr(self, k, state[k])
        self.cur_scale = float(self.cur_scale)
        if self._dev is not None:
            self.on_device(self._dev["scale"].device)


def make_loss_scaler(plan: LossScalePlan | None) -> DynamicLossScaler | StaticLossScaler | None:
    """None without fp16; static when `loss_scale > 0`; otherwise dynamic from 2**initial_scale_power."""
    if plan is None:
        return None
    if plan.loss_scale > 0:
        return StaticLossScaler(plan.loss_scale)
    for key, value in (("loss_scale_window", plan.loss_scale_window), ("min_loss_scale", plan.min_loss_scale),
                       ("hysteresis", plan.hysteresis)):
        if not value > 0:
            raise ValueError(f"fp16.{key}={value!r}: must be > 0 with dynamic loss scaling (fp16.loss_scale=0)")
    return DynamicLossScaler(2 ** plan.initial_scale_power, plan.loss_scale_window, plan.min_loss_scale,
                             plan.hysteresis, plan.consecutive_hysteresis)


def found_inf(grads_or_norm: torch.Tensor | Iterable[torch.Tensor | None], process_group=None) -> bool:
    """True on every rank if any rank holds an inf/nan gradient (or a non-finite norm): one MAX all-reduce.

    Give either a norm tensor (e.g. `clip_grad_norm_`'s result) or the gradients; DTensor shards are checked
    locally and the verdict agreed over `process_group` (default: the world).
    """
    if isinstance(grads_or_norm, torch.Tensor):
        tensors = [local_tensor(grads_or_norm)]
    else:
        tensors = [local_tensor(g) for g in grads_or_norm if g is not None]
    tensors = [t for t in tensors if t.numel() > 0]
    if tensors:
        # max |g| is non-finite iff some element is; a sum could overflow on large finite fp16 values.
        maxes = torch._foreach_norm(tensors, float("inf"))
        flag = torch.stack([m.float() for m in maxes]).isfinite().all().logical_not().float()
        device = flag.device
    else:
        device = torch.device("cpu")
        flag = None
    if dist.is_initialized() and dist.get_world_size(process_group) > 1:
        if "nccl" in str(dist.get_backend(process_group)) and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = (flag if flag is not None else torch.zeros((), device=device)).to(device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
    return bool(flag.item()) if flag is not None else False


class DeferredVerdict:
    """A 0-dim overflow flag copied to the host without waiting: read it later, when the GPU is long past it."""

    def __init__(self, found_inf: torch.Tensor):
        self.event = None
        if found_inf.is_cuda:
            self.flag = torch.empty((), dtype=found_inf.dtype, pin_memory=True)
            self.flag.copy_(found_inf, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.flag = found_inf

    def overflowed(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.flag)
