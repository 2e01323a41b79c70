"""ZeRO stage 1: replicated parameters, sharded fp32 master weights and optimizer state.

Forward and backward are untouched: every rank holds whole parameters (in their compute dtype) and accumulates whole
gradients locally over the micro-steps. At the accumulation boundary:

  1. gradients are reduce-scattered, in buckets of `reduce_bucket_size` elements, straight into this rank's fp32
     gradient shard (optionally launched from backward hooks as buckets fill: `overlap_comm`);
  2. one all-reduce of the squared shard norms gives the global gradient norm, which drives clipping and (through
     inf/nan) an overflow verdict that every rank shares;
  3. the inner optimizer (any torch.optim optimizer, built by a factory over the flat fp32 master shards, one tensor
     per dtype per param group) steps on this rank's shard only (a fused torch Adam/AdamW may step it bucket by
     bucket, each bucket's all-gather starting while the next updates: ops/fsdpzero_ops/stage1/step.py);
  4. the updated shards are cast to the parameter dtype and all-gathered, in buckets of `allgather_bucket_size`
     (ops/fsdpzero_ops/stage1/gather.py). After `defer_allgather_to_forward(model)` step() returns with them in flight, and
     each module's forward waits only for the buckets of its own parameters.

Traffic per optimizer step is one reduce-scatter plus one all-gather, about 2x the parameter bytes. DeepSpeed stage 1
all-reduces each bucket and keeps a slice, then all-gathers: about 3x. `reduce_op="all_reduce"` is that design (the
plain reference path, also the fallback for backends without reduce-scatter).

Layout. Every parameter is flattened and cut into `world_size` equal chunks of ceil(numel / world) elements (the
tail padded with zeros), exactly torch.chunk / DTensor Shard(0) of the flat parameter. Rank r's shard is the
concatenation, over parameters, of their chunk r. So each rank owns 1/N of every parameter (element-balanced, with
at most one padding element per rank per parameter), any run of consecutive parameters is a contiguous range of the
shard, and the checkpoint can expose each parameter's master and state as a 1-D DTensor that DCP reshards to any
world size. A bucket is a run of parameters; its collective buffer is rank-major (world, run length).
"""
from __future__ import annotations

import collections
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .gather import ParamAllGather
from .layout import FlatGroup, named_groups, pack, Run, runs, Slot, take_chunks
from .state import load_logical_state_dict, logical_state_dict, shard_whole_state
from .step import BucketStep, pipelinable, takes_grad_scale

__all__ = ["Stage1Optimizer"]

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


# ---------------------------------------------------------------- collectives (looked up per call: tests wrap them)

def _reduce_scatter(out, inp, group, async_op):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    return fn(out, inp, group=group, async_op=async_op)


# ---------------------------------------------------------------- the optimizer

class Stage1Optimizer(torch.optim.Optimizer):
    """ZeRO stage 1 around any elementwise torch.optim optimizer.

    optimizer_factory(param_groups) builds the inner optimizer; it receives the caller's param groups with their
    options (lr, weight_decay, ...) and, as "params", this rank's flat fp32 master shards. Only elementwise
    optimizers (Adam/AdamW, SGD, Adagrad, RMSprop, Lion, ...) give the same result flattened; LAMB-style per-tensor
    trust ratios or factored states do not.

    `param_groups` is the inner optimizer's list, so LR schedulers work on this object. `step()` consumes the
    gradients: the model's `.grad` are freed afterwards. Call `set_gradient_sync(True)` before the backward of the
    last micro-step to let `overlap_comm` start reductions from backward hooks; without it all reductions run in
    `step()`. `step()` is reduce_gradients + grad_norm + scale_grads_ + update_params, which a training engine
    may call one by one (see Stage1GradPath). After `defer_allgather_to_forward(model)` the parameters receive the
    step's values in the next forward (or state_dict(), or `wait_for_params()`), not inside step().
    """

    def __init__(self, params, optimizer_factory: OptimizerFactory, *, process_group: dist.ProcessGroup | None = None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 reduce_bucket_size: int, allgather_bucket_size: int,
                 overlap_comm: bool = False, max_grad_norm: float = 0.0, check_overflow: bool = True,
                 reduce_op: str = "reduce_scatter", master_device: torch.device | str | None = None,
                 ramp_buckets: bool = True, fold_grad_scale: bool = True, pipeline_step: bool = False):
        if reduce_op not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"reduce_op={reduce_op!r}: use 'reduce_scatter' (default) or 'all_reduce' (reference)")
        for key, value in (("reduce_bucket_size", reduce_bucket_size),
                           ("allgather_bucket_size", allgather_bucket_size)):
            if int(value) < 1:
                raise ValueError(f"zero_optimization.{key}={value}: must be a positive number of elements")
        distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group if distributed else None
        self.logical_mesh = None    # the DeviceMesh of the logical state dict (state.py), made on first use
        self.world = dist.get_world_size(self.group) if distributed else 1
        self.rank = dist.get_rank(self.group) if distributed else 0
        self.reduce_dtype, self.reduce_op = reduce_dtype, reduce_op
        # offload_optimizer: masters, their grads and the optimizer state on `master_device` (the CPU); collectives
        # and the packing stay on the parameters' device
        self.master_device = torch.device(master_device) if master_device is not None else None
        self.max_grad_norm, self.check_overflow = float(max_grad_norm or 0.0), check_overflow
        self.overlap_comm, self._sync = overlap_comm, False
        # buckets ramp up from size/8 and down to size/8 at the ends (layout.runs): less exposed time
        self.ramp_buckets = ramp_buckets
        # scale_grads_ hands its factor to a fused Adam/AdamW/SGD step (its grad_scale input) instead of a pass of
        # its own over the fp32 gradient shard
        self.fold_grad_scale, self._grad_factor = fold_grad_scale, None
        # fused Adam/AdamW: update the shard bucket by bucket, all-gathering each while the next updates
        self.pipeline_step = pipeline_step
        self.last_grad_norm: torch.Tensor | None = None   # unscaled, pre-clip global norm at the last step()
        self.overflow = False                              # the last step() was skipped for inf/nan gradients

        groups = named_groups(params)
        seen: set[int] = set()
        self.flat_groups: list[FlatGroup] = []
        inner_groups = []
        for gi, g in enumerate(groups):
            by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = collections.defaultdict(list)
            for name, p in g["named"]:
                if not p.requires_grad or id(p) in seen or p.numel() == 0:  # frozen/empty: left alone; tied: first name
                    continue
                if not p.is_contiguous():
                    raise ValueError(f"parameter {name!r} is not contiguous; Stage1Optimizer flattens parameters")
                seen.add(id(p))
                by_dtype[p.dtype].append((name, p))
            masters = []
            for named in by_dtype.values():
                fg = self._flat_group(gi, named[::-1], reduce_bucket_size, allgather_bucket_size)  # backward order
                self.flat_groups.append(fg)
                masters.append(fg.master)
            inner_groups.append({**g["options"], "params": masters})
        self.optimizer = optimizer_factory(inner_groups)
        if param_dtype is not None:  # masters were taken from the original values; now lower the compute copy
            for fg in self.flat_groups:
                for s in fg.slots:
                    s.param.data = s.param.data.to(param_dtype)
                fg.dtype = param_dtype
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._grad_ready(fg, run))
                       for fg in self.flat_groups for run in fg.reduce_runs for s in run.slots] if overlap_comm else []
        self._inflight: collections.deque = collections.deque()   # (flat group, run, work, buffer, receive)
        self._reset_pending()
        self.param_gather = ParamAllGather(self.flat_groups, self.group, self.rank, self.world,
                                           getattr(self, "comm_device", None))
        # torch.optim.Optimizer plumbing, so LR schedulers and hooks accept this object; the groups are the inner ones
        super().__init__([s.param for fg in self.flat_groups for s in fg.slots] or [torch.empty(0)], {})
        self.param_groups, self.state, self.defaults = (self.optimizer.param_groups, self.optimizer.state,
                                                       self.optimizer.defaults)

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, names: dict[int, str] | None = None, **kwargs) -> "Stage1Optimizer":
        """Shard an optimizer built over the whole parameters (a config's, or a client's, with its param groups):
        the same object is rebound in place to the flat masters, so schedulers built on it keep working, and state
        it created at construction (Adagrad's sums) moves into the shards. `names`: id(param) -> name."""
        names = names or {}
        old_state = {p: dict(st) for p, st in optimizer.state.items()}
        groups = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                   "params": [(names.get(id(p), f"group{gi}.param{i}"), p) for i, p in enumerate(g["params"])]}
                  for gi, g in enumerate(optimizer.param_groups)]

        def rebind(inner_groups):
            optimizer.state.clear()
            for g, inner in zip(optimizer.param_groups, inner_groups):
                g["params"] = inner["params"]
                g.pop("param_names", None)
            return optimizer

        self = cls(groups, rebind, **kwargs)
        shard_whole_state(self, old_state)
        return self

    def _flat_group(self, gi, named, reduce_bucket, gather_bucket) -> FlatGroup:
        slots, offset = [], 0
        for name, p in named:
            n = p.numel()
            chunk = -(-n // self.world)
            local = max(0, min(chunk, n - self.rank * chunk))
            slots.append(Slot(name, p, n, chunk, offset, local))
            offset += chunk
        self.comm_device = slots[0].param.device
        master = torch.zeros(offset, dtype=torch.float32, device=self.master_device or self.comm_device)
        take_chunks(master, slots, self.rank)
        return FlatGroup(gi, slots[0].param.dtype, slots, master,
                          runs(slots, int(reduce_bucket), self.world, self.ramp_buckets),
                          runs(slots, int(gather_bucket), self.world, self.ramp_buckets))

    def refresh_masters(self) -> None:
        """Masters <- this rank's chunk of the parameters as they are now: after weights were loaded into the model
        without the optimizer state, or the next step would all-gather the old masters back over them (DeepSpeed
        restores its fp32 partitions from the 16-bit weights the same way). The engine calls it from a
        load_state_dict post-hook on the model."""
        self.param_gather.wait()
        for fg in self.flat_groups:
            take_chunks(fg.master, fg.slots, self.rank)

    # ------------------------------------------------------------ gradient reduction

    def set_gradient_sync(self, enabled: bool = True) -> None:
        """Mark the coming backward as the accumulation boundary (overlap_comm reduces buckets as they fill)."""
        self._sync = bool(enabled)

    def _reset_pending(self) -> None:
        for fg in self.flat_groups:
            for run in fg.reduce_runs:
                run.pending = len(run.slots)

    def _grad_ready(self, fg: FlatGroup, run: Run):
        def hook(_param):
            if self._sync:
                run.pending -= 1
                if run.pending == 0:
                    self._launch_reduce(fg, run)
        return hook

    def _launch_reduce(self, fg: FlatGroup, run: Run) -> None:
        """Pack the run's gradients rank-major (freeing each .grad once copied) and start its reduction. At most
        two reductions stay in flight, which bounds the temporary buffers to two buckets."""
        run.pending = -1  # launched
        master_grad = self._master_grad(fg)
        out = master_grad[run.lo: run.hi]
        dtype = self.reduce_dtype or fg.dtype
        if self.world == 1 and out.device == self.comm_device:  # no communication: pack straight into the master grad
            for s in run.slots:
                pack(out[s.offset - run.lo: s.offset - run.lo + s.chunk].view(1, -1), self._flat_grad(s), 1.0)
                s.param.grad = None
            return
        # the mean over ranks is taken before the sum (exact for power-of-two worlds; keeps fp16 sums in range)
        buf = torch.empty(self.world, run.hi - run.lo, dtype=dtype, device=self.comm_device)
        for s in run.slots:
            pack(buf[:, s.offset - run.lo: s.offset - run.lo + s.chunk], self._flat_grad(s), 1.0 / self.world)
            s.param.grad = None
        if self.world == 1:   # offloaded master on one rank: no collective, only the copy to the master's device
            self._inflight.append((fg, run, None, buf, buf[0]))
            return
        while len(self._inflight) >= 2:
            self._finish_reduce(*self._inflight.popleft())
        if self.reduce_op == "reduce_scatter":
            recv = out if dtype == out.dtype and out.device == buf.device else torch.empty_like(buf[0])
            try:
                work = _reduce_scatter(recv, buf.view(-1), self.group, async_op=True)
            except (RuntimeError, NotImplementedError) as exc:   # a backend without reduce-scatter
                warnings.warn(f"fsdpzero stage 1: reduce-scatter failed ({exc}); using all-reduce + slice (1.5x "
                              "the gradient traffic) from now on", RuntimeWarning, stacklevel=2)
                self.reduce_op = "all_reduce"
        if self.reduce_op == "all_reduce":  # reference design: everyone gets the whole sum, keeps its row
            work = dist.all_reduce(buf, group=self.group, async_op=True)
            recv = buf[self.rank]
        self._inflight.append((fg, run, work, buf, recv))

    @staticmethod
    def _flat_grad(s: Slot) -> torch.Tensor | None:
        g = s.param.grad
        return None if g is None else g.reshape(-1)

    @staticmethod
    def _master_grad(fg: FlatGroup) -> torch.Tensor:
        """Allocated at the boundary, freed after the step; offloaded to the CPU it is kept, pinned (fast D2H)."""
        if fg.master.grad is None:
            if fg.master.device.type == "cpu" and torch.cuda.is_available():
                fg.grad_cache = fg.grad_cache if fg.grad_cache is not None else torch.empty_like(fg.master).pin_memory()
                fg.master.grad = fg.grad_cache
            else:
                fg.master.grad = torch.empty_like(fg.master)
        return fg.master.grad

    def reduce_gradients(self) -> None:
        """Finish the reduction: afterwards each flat master's .grad holds this rank's shard of the mean gradient."""
        for fg in self.flat_groups:
            for run in fg.reduce_runs:
                if run.pending != -1:     # not launched from a hook (no overlap, unused parameters, ...)
                    self._launch_reduce(fg, run)
        while self._inflight:
            self._finish_reduce(*self._inflight.popleft())
        self._reset_pending()
        self._sync = False

    @staticmethod
    def _finish_reduce(fg: FlatGroup, run: Run, work, _buf: torch.Tensor, recv: torch.Tensor) -> None:
        if work is not None:
            work.wait()   # NCCL: the current stream waits, the host does not; the buffer is then safe to free
        out = fg.master.grad[run.lo: run.hi]
        if recv.data_ptr() != out.data_ptr():
            out.copy_(recv)

    # ------------------------------------------------------------ the step

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients: one all-reduce of the squared shard norms, so inf/nan on any
        rank gives inf/nan on every rank (a shared overflow verdict). No host sync. Returns a 0-dim fp32 tensor.

        On the CPU the sums are fp64: one fp32 vector_norm over a whole flat shard (its fp32 partial sums over ~5e5
        elements) was ~2e-5 relative off, against ~4e-7 for torch's per-tensor norms, and that moved the clip factor.
        An accelerator's tree reduction keeps fp32 at the per-tensor level; only the few totals go to fp64 there.
        The all-reduce is one fp64 scalar."""
        device = self.flat_groups[0].master.device
        acc = torch.float64 if device.type == "cpu" else torch.float32
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for fg in self.flat_groups:
            sq = sq + torch.linalg.vector_norm(fg.master.grad, dtype=acc).double().square()
        sq = sq.to(self.comm_device)
        if self.world > 1:
            dist.all_reduce(sq, group=self.group)
        # the overflow verdict as at the other stages (fp32 norms): a sum of squares past fp32's range is inf there
        sq = torch.where(sq > torch.finfo(torch.float32).max, torch.full_like(sq, float("inf")), sq)
        return sq.sqrt().float()

    @torch.no_grad()
    def scale_grads_(self, factor: torch.Tensor | float) -> None:
        """Shard gradients *= factor (unscale by the loss scale and clip). With a fused torch optimizer the factor
        goes to its step as grad_scale = 1/factor (the kernel divides the gradient it reads), which saves a read
        and a write of the fp32 gradient shard; the .grad tensors then stay unscaled until update_params()."""
        if not torch.is_tensor(factor) and factor == 1.0:
            return
        grads = [fg.master.grad for fg in self.flat_groups]
        if torch.is_tensor(factor):
            factor = factor.to(grads[0].device, torch.float32)
        if self.fold_grad_scale and takes_grad_scale(self.optimizer):
            self._grad_factor = factor if self._grad_factor is None else self._grad_factor * factor
            return
        torch._foreach_mul_(grads, factor)

    @torch.no_grad()
    def update_params(self) -> None:
        """Step the inner optimizer on the shards, then all-gather the parameters in their own dtype."""
        factor, self._grad_factor = self._grad_factor, None
        device = self.flat_groups[0].master.device
        grad_scale = None if factor is None else (1.0 / torch.as_tensor(factor, dtype=torch.float32)).to(device)
        if self.pipeline_step and device == self.comm_device and pipelinable(self.optimizer, device):
            bucket_step = BucketStep(self.optimizer, grad_scale)
            self.param_gather.gather(bucket_step, defer=True)
            bucket_step.finish()
            self._free_grads()
            return
        if grad_scale is None:
            self.optimizer.step()
        else:
            self.optimizer.grad_scale = grad_scale
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale
        self._free_grads()
        self.param_gather.gather(defer=True)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        """Reduce, unscale by `grad_scale` (fp16 loss scale), clip to max_grad_norm, step the shard, all-gather.
        With check_overflow, inf/nan gradients on any rank skip the step on every rank (`self.overflow`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.flat_groups:
            return loss
        self.reduce_gradients()
        norm = self.grad_norm() / grad_scale
        self.last_grad_norm = norm
        self.overflow = bool(self.check_overflow and not torch.isfinite(norm))   # the one host sync
        if self.overflow:
            self._free_grads()
            return loss
        factor = torch.full_like(norm, 1.0 / grad_scale)
        if self.max_grad_norm > 0:
            factor = factor * torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        self.scale_grads_(factor)
        self.update_params()
        return loss

    def _free_grads(self) -> None:
        self._grad_factor = None
        for fg in self.flat_groups:
            fg.master.grad = None
            for s in fg.slots:
                s.param.grad = None

    # ------------------------------------------------------------ the all-gather overlapped with the next forward

    def defer_allgather_to_forward(self, model: nn.Module) -> None:
        """From now on step() returns with the parameters' all-gather in flight; `model`'s modules wait, before
        their forward, for the buckets holding their own parameters. Saving or loading the model's state_dict waits
        for everything; so does `wait_for_params()`, which anything else reading the weights must call first."""
        self.param_gather.attach(model)

    def wait_for_params(self) -> None:
        """The parameters hold the last step's values once this returns (on CUDA: for work queued after it)."""
        self.param_gather.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_factor = None
        for _fg, _run, work, _buf, _recv in self._inflight:   # reductions started from hooks, now abandoned
            if work is not None:
                work.wait()
        self._inflight.clear()
        self._reset_pending()
        for fg in self.flat_groups:
            fg.master.grad = None
            for s in fg.slots:
                if s.param.grad is not None:
                    if set_to_none:
                        s.param.grad = None
                    else:
                        s.param.grad.zero_()

    # ------------------------------------------------------------ checkpoint (ops/fsdpzero_ops/stage1/state.py)

    def state_dict(self, *, copies: bool = False) -> dict[str, Any]:
        """Per-parameter fp32 master and optimizer state as 1-D DTensors (views of the shard; with `copies`, copies
        for an async save), for DCP: saved from N ranks, loadable into the state_dict() of M ranks. See
        ops/fsdpzero_ops/stage1/state.py."""
        return logical_state_dict(self, copies)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply state_dict() output (possibly filled by DCP from another world size); re-gathers the params."""
        self.param_gather.wait()
        load_logical_state_dict(self, state_dict)
        self.param_gather.gather()
