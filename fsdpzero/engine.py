"""The Engine: DeepSpeed's training-loop surface (`engine(x)`, `engine.backward(loss)`, `engine.step()`) over a
model already laid out by `fsdpzero.sharding` and a gradient path from `fsdpzero.optim`.

It only keeps the step bookkeeping; where gradients go is the gradient path's business, precision the scaler's,
the learning rate the scheduler's. Call `backward` and `step` on every micro-step, exactly as with DeepSpeed: the
optimizer steps on every `gradient_accumulation_steps`-th call.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from fsdpzero.log import StepPrinter, Timers
from fsdpzero.loss_scaler import DeferredVerdict
from fsdpzero.optim import GradPath, clip_factor
from fsdpzero.plan import Plan
from fsdpzero.precision import DTYPES, autocast, checks_overflow


class Engine(nn.Module):
    def __init__(self, module: nn.Module, plan: Plan, path: GradPath, *, lr_scheduler=None, scaler=None,
                 device: torch.device = torch.device("cpu"), mesh=None, local_rank: int = 0):
        super().__init__()
        self.module = module
        self.plan = plan
        self.grad_path = path
        self.optimizer = path.optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = scaler
        self.device = device
        self.mesh = mesh
        self.local_rank = local_rank
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._grad_norm: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._last_loss: torch.Tensor | None = None
        self._boundary_override: bool | None = None
        self._step_applied = False
        self.timers = Timers(plan.batch.wall_clock_breakdown, device.type)
        self._printer = StepPrinter(plan.batch.steps_per_print, self.timers)
        # Overflow checks without a host sync: the optimizer skips on the device, the fp16 scaler updates its scale
        # there too, and the host learns the verdict one step later (see _settle).
        self._defer_verdict = (checks_overflow(plan) and path.can_skip_on_device()
                               and (lr_scheduler is None or hasattr(lr_scheduler, "rewind"))
                               and os.environ.get("FSDPZERO_SYNC_OVERFLOW_CHECK") != "1")
        if self._defer_verdict and scaler is not None:
            scaler.on_device(device)
        self._verdict: DeferredVerdict | None = None

    # -- DeepSpeed accessors -----------------------------------------------------------------------------------
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.plan.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.plan.batch.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.plan.batch.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Norm of the unscaled gradients before clipping, at the last boundary (None before the first)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def get_loss_scale(self) -> float:
        self._settle()
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    @property
    def was_step_applied(self) -> bool:
        self._settle()
        return self._step_applied

    def _settle(self) -> None:
        """Account for a deferred overflow verdict: a skipped step is counted and the scheduler's optimistic step
        undone, as if the skip had been known at once (DeepSpeed: no scheduler step on an overflow step); the fp16
        scaler's host copy catches up with its device state (and raises the floor error, one step late)."""
        verdict, self._verdict = self._verdict, None
        if verdict is None:
            return
        overflow = verdict.overflowed()
        if overflow:
            self.skipped_steps += 1
            self._step_applied = False
            if self.lr_scheduler is not None:
                self.lr_scheduler.rewind()
        if self.loss_scaler is not None:
            self.loss_scaler.settle(overflow)

    # -- the loop ----------------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.timers.start("forward")
        with autocast(self.plan, self.device.type):
            out = self.module(*args, **kwargs)
        self.timers.stop("forward")
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """loss / gradient_accumulation_steps (DeepSpeed does the division), times the fp16 loss scale."""
        self.timers.start("backward")
        detached = loss.detach().float()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self.grad_path.set_sync(self.is_gradient_accumulation_boundary())
        gas = self.gradient_accumulation_steps()
        scaled = loss / gas if gas > 1 else loss
        if self.loss_scaler is not None:
            scaled = self.loss_scaler.scale_loss(scaled)   # a device tensor when the scaler runs there
        scaled.backward(retain_graph=retain_graph)
        self.timers.stop("backward")
        return scaled

    def step(self) -> None:
        """Call after every backward. At the accumulation boundary: finish gradients, unscale, clip the global
        norm, step (or skip on overflow), step the scheduler, zero the gradients."""
        if self.is_gradient_accumulation_boundary():
            self.timers.start("step")
            self._boundary_step()
            self.timers.stop("step")
            if self._loss_sum is not None:
                self._last_loss = self._loss_sum / self.gradient_accumulation_steps()
            self._loss_sum = None
            if self._printer.due(self.global_steps):   # settles: the printed skip count, lr and scale are final
                self._printer.maybe_print(step=self.global_steps, skipped=self.skipped_steps,
                                          samples=self.global_samples, loss=self._last_loss, lr=self.get_lr(),
                                          grad_norm=self._grad_norm, loss_scale=self.get_loss_scale())
        self.micro_steps += 1
        self._boundary_override = None

    def _boundary_step(self) -> None:
        path, scaler = self.grad_path, self.loss_scaler
        self._settle()
        deferred = self._defer_verdict and path.can_skip_on_device()
        # the scale this step's backward used: a device tensor for a deferred dynamic scaler, else a float
        scale = 1.0 if scaler is None else scaler.live_scale if deferred else scaler.loss_scale
        unscale = not (isinstance(scale, float) and scale == 1.0)
        path.finish_gradients()
        norm = path.grad_norm()                  # collective: the same value on every rank
        if unscale:
            norm = norm / scale
        self._grad_norm = norm
        if deferred:
            found_inf = (~torch.isfinite(norm)).float()
            factor = clip_factor(norm, self.plan.batch.gradient_clipping)
            path.scale_grads_(factor / scale if unscale else factor)
            path.step(found_inf=found_inf)       # a no-op on the device where found_inf is 1
            if scaler is not None:
                scaler.update_on_device(found_inf)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()         # optimistic; _settle rewinds it if the step overflowed
            self._verdict = DeferredVerdict(found_inf)
            path.zero_grad()
            self._step_applied = True
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            return
        # the skip decision needs the norm on the host (one sync); without overflow checks nothing waits
        overflow = checks_overflow(self.plan) and not bool(torch.isfinite(norm))
        if overflow:
            self.skipped_steps += 1       # DeepSpeed: no optimizer step, no scheduler step, global_steps advances
        else:
            factor = clip_factor(norm, self.plan.batch.gradient_clipping)
            if unscale:
                factor = factor / scale
            path.scale_grads_(factor)
            path.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        path.zero_grad()
        self._step_applied = not overflow
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def zero_grad(self) -> None:
        self.grad_path.zero_grad()

    def wait_for_params(self) -> None:
        """Afterwards the model holds the last step's weights: a path may still be moving them after step() (a
        stage-1 all-gather finished by the next forward, an overlapped CPU step). Saving calls it; so should any
        code that reads the parameters directly instead of through a forward or state_dict()."""
        self.grad_path.wait()

    # -- state for checkpoints ---------------------------------------------------------------------------------
    def client_state(self) -> dict:
        """The engine's own counters plus the scheduler/scaler state (the checkpoint layer saves these)."""
        self._settle()
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, **options):
        """DeepSpeed's signature; options: keep_last, async_save (see fsdpzero.checkpoint.dcp)."""
        from fsdpzero.checkpoint.engine_state import save_engine
        self.wait_for_params()
        return save_engine(self, save_dir, tag, client_state, save_latest, **options)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):
        """-> (path, client_state); (None, None) when there is nothing to load, as DeepSpeed."""
        from fsdpzero.checkpoint.engine_state import load_engine
        self._settle()          # a pending verdict belongs to the state being replaced, not to the loaded one
        return load_engine(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)

    def save_16bit_model(self, save_dir, save_filename="model.safetensors", exclude_frozen_parameters=False):
        """Consolidated weights in the compute dtype for from_pretrained (see fsdpzero.checkpoint.export)."""
        from fsdpzero.checkpoint.export import save_16bit_model
        self.wait_for_params()
        dtype = DTYPES[self.plan.precision.param_dtype]
        return save_16bit_model(self.module, save_dir, dtype=None if dtype == torch.float32 else dtype,
                                filename=save_filename, exclude_frozen_parameters=exclude_frozen_parameters,
                                param_swapper=self.grad_path.param_swapper)

    def load_client_state(self, state: dict) -> None:
        for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
            setattr(self, k, state[k])
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

