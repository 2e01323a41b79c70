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
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist

from fsdpzero.plan import LossScalePlan

log = logging.getLogger(__name__)


class LossScaleFloorError(RuntimeError):
    """Overflow with the dynamic scale already at min_loss_scale: DeepSpeed ends the run here, and so do we."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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

    def update(self, overflow: bool) -> None:
        if overflow and _rank0():
            log.warning("fp16 overflow with static loss scale %s: step skipped", self.cur_scale)

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

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise LossScaleFloorError(
                        f"fp16 gradients overflowed with the loss scale already at fp16.min_loss_scale="
                        f"{self.min_scale} (step {self.cur_iter}); DeepSpeed aborts here too. The model diverges "
                        f"or fp16 cannot hold its gradients: lower the lr, or train in bf16 (\"bf16\": "
                        f"{{\"enabled\": true}})")
                new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                if _rank0():
                    log.info("fp16 overflow: step skipped, loss scale %s -> %s", self.cur_scale, new_scale)
                self.cur_scale = new_scale
            else:
                if _rank0():
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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor shard: each rank checks what it holds


def found_inf(grads_or_norm: torch.Tensor | Iterable[torch.Tensor | None], process_group=None) -> bool:
    """True on every rank if any rank holds an inf/nan gradient (or a non-finite norm): one MAX all-reduce.

    Give either a norm tensor (e.g. `clip_grad_norm_`'s result) or the gradients; DTensor shards are checked
    locally and the verdict agreed over `process_group` (default: the world).
    """
    if isinstance(grads_or_norm, torch.Tensor):
        tensors = [_local(grads_or_norm)]
    else:
        tensors = [_local(g) for g in grads_or_norm if g is not None]
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
