"""The Engine: DeepSpeed's training-loop surface (`engine(x)`, `engine.backward(loss)`, `engine.step()`) over a
model already laid out by `fsdpzero.sharding` and a gradient path from `fsdpzero.optim`.

It only keeps the step bookkeeping; where gradients go is the gradient path's business, precision the scaler's,
the learning rate the scheduler's. Call `backward` and `step` on every micro-step, exactly as with DeepSpeed: the
optimizer steps on every `gradient_accumulation_steps`-th call.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch import nn

from fsdpzero.log import StepPrinter, Timers, is_rank0
from fsdpzero.loss_scaler import DeferredVerdict
from fsdpzero.monitor import TIMER_TAGS, Monitor
from fsdpzero.optim import GradPath, clip_factor
from fsdpzero.plan import Plan
from fsdpzero.precision import DTYPES, autocast, checks_overflow
from fsdpzero.tuning import Tuning, or_defaults

log = logging.getLogger("fsdpzero")


class Engine(nn.Module):
    # fsdpzero.parallel.ulysses.SequenceParallel with sequence_parallel_size > 1 (set by wrap): forward then takes
    # sequence-sharded batches and returns the loss over the whole sequence
    sequence_parallel = None

    def __init__(self, module: nn.Module, plan: Plan, path: GradPath, *, lr_scheduler=None, scaler=None,
                 device: torch.device = torch.device("cpu"), mesh=None, local_rank: int = 0, tuning=None,
                 blocks: list[nn.Module] | None = None):
        super().__init__()
        self.module = module
        self.blocks = list(blocks or [])      # the transformer blocks (what compile() compiles one by one)
        self._compile_watch = None            # fsdpzero.compile.CompileWatch until the first step reports
        self.compile_report: dict | None = None
        self.plan = plan
        self.grad_path = path
        self.optimizer = path.optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = scaler
        self.device = device
        self.mesh = mesh
        self.local_rank = local_rank
        # fsdpzero/tuning.py: this engine's settings, built once at wrap (defaults < environment < wrap(tuning=));
        # the wings and the checkpoint code get them from here, never from the process, so two engines in one
        # process each keep theirs (TRL's policy and reference model)
        self.tuning: Tuning = or_defaults(tuning)
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._skipped_steps = 0
        self._grad_norm: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._last_loss: torch.Tensor | None = None
        self._boundary_override: bool | None = None
        self._step_applied = False
        self.timers = Timers(plan.batch.wall_clock_breakdown, device.type)
        self._printer = StepPrinter(plan.batch.steps_per_print, self.timers)
        # DeepSpeed's engine events (tensorboard / csv_monitor / wandb / comet), written on rank 0 at each boundary
        self.monitor = Monitor(plan.monitor, rank=dist.get_rank() if dist.is_initialized() else 0)
        self._timer_mark: dict[str, float] = {}
        # Overflow checks without a host sync: the optimizer skips on the device, the fp16 scaler updates its scale
        # there too, and the host learns the verdict one step later, or when a counter is read (see _settle).
        self._defer_verdict = (checks_overflow(plan) and path.can_skip_on_device()
                               and (lr_scheduler is None or hasattr(lr_scheduler, "rewind"))
                               and not self.tuning.sync_overflow_check)
        if self._defer_verdict and scaler is not None:
            scaler.on_device(device)
        self._verdict: DeferredVerdict | None = None
        # the path's threads and native queues end with the engine (destroy, garbage collection or interpreter
        # exit, whichever comes first): a worker still running at exit aborts the process (SIGABRT)
        self._closer = weakref.finalize(self, close_in_owner, path, os.getpid())

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

    def get_sequence_parallel_group(self):
        """DeepSpeed's accessor: this rank's Ulysses group (None without sequence parallelism)."""
        return self.sequence_parallel.group if self.sequence_parallel is not None else None

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

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients; current when read (a deferred verdict is settled)."""
        self._settle()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._settle()
        self._skipped_steps = int(value)

    def _settle(self) -> None:
        """Account for a deferred overflow verdict: a skipped step is counted and the scheduler's optimistic step
        undone, as if the skip had been known at once (DeepSpeed: no scheduler step on an overflow step); the fp16
        scaler's host copy catches up with its device state (and raises the floor error, one step late)."""
        verdict, self._verdict = self._verdict, None
        if verdict is None:
            return
        overflow = verdict.overflowed()
        if overflow:
            self._skipped_steps += 1
            self._step_applied = False
            if self.lr_scheduler is not None:
                self.lr_scheduler.rewind()
        if self.loss_scaler is not None:
            self.loss_scaler.settle(overflow)

    # -- the loop ----------------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        sp = self.sequence_parallel
        if sp is not None:
            kwargs = sp.model_inputs(kwargs)
        self.timers.start("forward")
        with autocast(self.plan, self.device.type):
            out = self.module(*args, **kwargs)
        self.timers.stop("forward")
        return out if sp is None else sp.reduce_output(out, kwargs)

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
            if self.monitor.configured:
                self._write_monitor()
            if self._printer.due(self.global_steps):   # settles: the printed skip count, lr and scale are final
                self._printer.maybe_print(step=self.global_steps, skipped=self.skipped_steps,
                                          samples=self.global_samples, loss=self._last_loss, lr=self.get_lr(),
                                          grad_norm=self._grad_norm, loss_scale=self.get_loss_scale())
            elif self.timers.enabled:   # wall_clock_breakdown: the timings every optimizer step, as DeepSpeed
                self._printer.print_timers()
            self._timer_mark = dict(self.timers.total)   # the printer may have reset them: next step's baseline
            if self._compile_watch is not None:
                self._report_compile()
        self.micro_steps += 1
        self._boundary_override = None

    def _boundary_step(self) -> None:
        path, scaler = self.grad_path, self.loss_scaler
        self._settle()
        deferred = self._defer_verdict and path.can_skip_on_device()
        # the scale this step's backward used: a device tensor for a deferred dynamic scaler, else a float
        scale = 1.0 if scaler is None else scaler.live_scale if deferred else scaler.loss_scale
        unscale = not (isinstance(scale, float) and scale == 1.0)
        self.timers.start("backward_allreduce")   # the wait for the gradient reductions still in flight
        path.finish_gradients()
        self.timers.stop("backward_allreduce")
        norm = path.grad_norm()                  # collective: the same value on every rank
        if unscale:
            norm = norm / scale
        finite = torch.isfinite(norm)
        # DeepSpeed reports an overflowed step's norm as inf (a NaN gradient included)
        self._grad_norm = torch.where(finite, norm, torch.full_like(norm, float("inf")))
        if deferred:
            found_inf = (~finite).float()
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
        overflow = checks_overflow(self.plan) and not bool(finite)
        if overflow:
            self._skipped_steps += 1      # DeepSpeed: no optimizer step, no scheduler step, global_steps advances
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

    def _write_monitor(self) -> None:
        """DeepSpeed's engine events at a boundary (engine.py step / _write_monitor), x = global samples after the
        step: the learning rate, the fp16 loss scale, the wall_clock_breakdown timings of this step in ms, plus
        `Train/Samples/train_loss`, the step's mean loss over micro-steps and ranks (DeepSpeed's pipeline engine
        writes it; its other engines do not). The loss mean is a collective: every rank of a monitored run calls
        this; rank 0 writes."""
        loss = self._last_loss if self._last_loss is not None else torch.zeros((), device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            loss = loss.clone()
            dist.all_reduce(loss)
            loss = loss / dist.get_world_size()
        if not self.monitor.enabled:
            return
        x = self.global_samples
        self._settle()                            # a deferred skip rewinds the scheduler: the lr is final
        events = [("Train/Samples/lr", self.get_lr()[0], x)]
        if self.plan.precision.loss_scale is not None:
            events.append(("Train/Samples/loss_scale", self.get_loss_scale(), x))
        events.append(("Train/Samples/train_loss", float(loss), x))
        if self.timers.enabled:
            t = self.timers.total
            ms = {k: 1000.0 * (t.get(k, 0.0) - self._timer_mark.get(k, 0.0)) for k in
                  ("forward", "backward", "backward_allreduce", "step")}
            # DeepSpeed's backward includes the reduction; ours waits for it at the boundary, inside step
            timings = {"forward": ms["forward"], "backward": ms["backward"] + ms["backward_allreduce"],
                       "backward_inner": ms["backward"], "backward_allreduce": ms["backward_allreduce"],
                       "step": ms["step"] - ms["backward_allreduce"]}
            events += [(f"Train/Samples/elapsed_time_ms_{k}", timings[k], x) for k in TIMER_TAGS]
        self.monitor.write_events(events)

    def zero_grad(self) -> None:
        self.grad_path.zero_grad()

    # -- torch.compile -----------------------------------------------------------------------------------------
    def compile(self, backend="inductor", compile_kwargs={}, schedule=None,  # noqa: B006 (DeepSpeed's signature)
                compiled_autograd_enabled=False) -> None:
        """DeepSpeed's `engine.compile()`: torch.compile of each transformer block (fsdpzero/compile.py), before
        or after the first step; a second call does nothing. The config's `compile` section (or the `compile`
        knob) calls it at initialize. Graph breaks and compile time are logged after the next optimizer step."""
        from fsdpzero.compile import compile_blocks
        if schedule is not None or compiled_autograd_enabled:
            raise ValueError("engine.compile(): DeepCompile schedules and compiled autograd are not implemented by "
                             "fsdpzero; call engine.compile(backend, compile_kwargs)")
        if self.is_compiled:
            return
        self._compile_watch = compile_blocks(self.module, self.blocks, backend, compile_kwargs)

    @property
    def is_compiled(self) -> bool:
        return self._compile_watch is not None or self.compile_report is not None

    def _report_compile(self) -> None:
        from fsdpzero.compile import describe
        self.compile_report, self._compile_watch = self._compile_watch.report(), None
        if is_rank0():
            log.info(describe(self.compile_report))

    def destroy(self) -> None:
        """DeepSpeed's `engine.destroy()`: finish a pending async checkpoint save and an overlapped CPU step, then
        release the gradient path's worker threads, aio engines and swap files. Not collective; idempotent. The
        engine must not train afterwards. Done at interpreter exit for engines still alive."""
        dcp = sys.modules.get("fsdpzero.checkpoint.dcp")   # loaded by the first save: nothing pending without it
        try:
            if dcp is not None:
                dcp.wait_for_pending_save()
        finally:
            self._closer()

    def named_parameters(self, *args, **kwargs):
        self.wait_for_params()   # nn.Module's walks the submodules' _parameters directly, past their own guards
        return super().named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        self.wait_for_params()
        return super().parameters(recurse)

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
        """DeepSpeed's signature; options: keep_last, async_save, tuning (this save's settings, default
        self.tuning: e.g. tuning=engine.tuning.replace(ckpt_stream=False)); see fsdpzero.checkpoint.dcp."""
        from fsdpzero.checkpoint.engine_state import save_engine
        self.wait_for_params()
        # the config's checkpoint.writer.decoupled is an async save too (save_engine applies it; the path must know)
        async_save = options.get("async_save", self.plan.checkpoint.async_save)
        with self.grad_path.async_save() if async_save else contextlib.nullcontext():
            saved = save_engine(self, save_dir, tag, client_state, save_latest, **options)
        if is_rank0() and isinstance(saved, os.PathLike):   # DeepSpeed users expect a line
            log.info("saved checkpoint %s at global step %d", saved, self.global_steps)
        elif is_rank0():   # async_save: finished (and agreed across ranks) by the next save or load
            log.info("saving the checkpoint of global step %d in the background", self.global_steps)
        return saved

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False):
        """-> (path, client_state); (None, None) when there is nothing to load, as DeepSpeed (same argument order).
        load_module_strict=False loads only the model keys the checkpoint and the model share."""
        from fsdpzero.checkpoint.engine_state import load_engine
        self._settle()          # a pending verdict belongs to the state being replaced, not to the loaded one
        path, client = load_engine(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                   load_module_only, strict=load_module_strict)
        if path is not None and is_rank0() and load_module_only:
            log.info("loaded the weights of checkpoint %s (load_module_only: counters and optimizer left as they "
                     "were)", path)
        elif path is not None and is_rank0():
            log.info("loaded checkpoint %s%s: resuming at global step %d", path,
                     "" if load_optimizer_states else " without its optimizer state", self.global_steps)
        return path, client

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


def close_in_owner(path: GradPath, pid: int) -> None:
    """The engine's finalizer: close the path, in the process that built it only (a forked child inherits the
    objects but not their threads)."""
    if os.getpid() == pid:
        path.close()
