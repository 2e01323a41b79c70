"""The gradient path: the one narrow interface between the engine and "where gradients go and how the optimizer
consumes them". The engine never touches gradients itself; per optimizer step it calls

    for each micro-step:  path.set_sync(is_boundary); loss.backward()
    at the boundary:      path.finish_gradients()
                          norm = path.grad_norm()             # global L2 over every rank, of the *scaled* grads
                          if finite: path.scale_grads_(f)     # unscale and clip in one multiply
                                     path.step(found_inf)     # found_inf only when path.can_skip_on_device()
                          path.zero_grad()

`path.optimizer` is what LR schedulers drive (its `param_groups` carry lr and betas); `state_dict()` /
`load_state_dict()` give the optimizer state in a form DCP can save (DTensors or plain local tensors).

Each path type owns, so that nothing outside it names a path (the engine, fsdpzero.checkpoint and fsdpzero.hf call
only what GradPath declares):
- how the model's parameters are laid out for it (`lay_out`, a classmethod run before the path is built, and for a
  forward-only engine of the same plan): FSDP2 per block by default; stage 1 leaves the module unwrapped
  (replicated plain tensors; its path reduces gradients in `finish_gradients`);
- how it is built from the plan (`build`, a classmethod run after `lay_out`: its optimizer over *its* tensors, from
  the engine's OptimizerFactory);
- what it saves and restores: `state_dict` / `load_state_dict`; a path that keeps its own fp32 masters stores them
  in each parameter's state under MASTER, and `keep_masters_on_load` keeps the masters a checkpoint load just read
  from being refreshed from the 16-bit weights loaded after them.

The path type is chosen by one explicit function of the plan, `fsdpzero.api.grad_path_type`; its types:
`FSDPGradPath` here (ZeRO 0/2/3 on FSDP2: reduction happens inside backward),
`fsdpzero.optim.stage1.Stage1GradPath` (stage 1 over fsdpzero_ops.stage1) and the CPU/NVMe offload paths
`fsdpzero.offload.path.OffloadGradPath` / `fsdpzero.offload.nvme_path.NVMeGradPath`. Adding a path: docs/engine.md.
"""
from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, Iterable

import torch
from torch import nn

from fsdpzero.dist import local_tensor
from fsdpzero.sharding import shard_model

# The per-parameter optimizer-state entry where a path that keeps its own fp32 masters (stage 1, offload) saves them;
# a checkpoint without it (stage 0/2/3, converted DeepSpeed) has its fp32 model weights as the masters.
MASTER = "master"

# The optimizer-state entry (True) of a state saved before the optimizer's first step. torch creates a never-stepped
# optimizer's state only to have something to save, by a zero-gradient step at lr 0 (get_optimizer_state_dict's
# _init_optim_state; stage 1's ensure_state): AdamW's step count is then 1, SGD's momentum wd * p. The path keeps
# that state out of training (drop_unstepped_state) and a load of such a state leaves the optimizer fresh again.
UNSTEPPED = "unstepped"


class GradPath(abc.ABC):
    """What the engine (and the checkpoint, export and HF code) may call on a gradient path; nothing else is reached
    for. All calls are collective where noted. A path type implements the abstract methods (`build` included) and
    overrides the others where its default does not fit."""

    name: str = "fsdp"                 # what the startup block calls the path (grad_path ...)
    optimizer: torch.optim.Optimizer   # schedulers set lr/betas on optimizer.param_groups
    param_swapper = None               # offload_param nvme: the ParamSwapper that export and checkpoints read through
    streams_checkpoints = False        # state_dict(streaming=True) gives on-disk states for DCP to stream

    @classmethod
    def lay_out(cls, model: nn.Module, plan, mesh, mp_policy, *, device_type: str = "cpu",
                blocks: list[nn.Module] | None = None) -> tuple[nn.Module, list[nn.Module]]:
        """Lay the model's parameters out for this path, in place, before the path is built. Returns (model, the
        blocks sharded one by one). The default: activation checkpointing, then fully_shard per block and root
        (fsdpzero.sharding.shard_model)."""
        return shard_model(model, plan, mesh, mp_policy, device_type=device_type, blocks=blocks)

    @classmethod
    def build(cls, model: nn.Module, plan, make_optimizer: Callable, mesh=None, *, tuning=None) -> "GradPath":
        """The path over `model` as lay_out left it, from the plan: `make_optimizer` (fsdpzero.optim.OptimizerFactory)
        builds the configured or client optimizer over the tensors the path steps (in model order); `mesh` is the
        engine's DeviceMesh; `tuning` the engine's knobs (fsdpzero.tuning.Tuning). Collective where the path's setup
        is (stage 1 lays out its flat shards across ranks). Every type the dispatch (fsdpzero.api.grad_path_type)
        returns implements it; a path that wraps another (fsdpzero.optim.muon.MuonGradPath) is built around it."""
        raise NotImplementedError(f"{cls.__name__} is not built from a plan")

    @abc.abstractmethod
    def set_sync(self, sync: bool) -> None:
        """Before each micro-step's backward: False on off-boundary micro-steps (accumulate locally, no comm)."""

    def finish_gradients(self) -> None:
        """After the boundary backward: make the gradients the optimizer will read complete (collective)."""

    @abc.abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients across all ranks, as a 0-dim fp32 tensor; inf/nan on overflow
        (collective: every rank gets the same value, so the skip decision agrees)."""

    @abc.abstractmethod
    def scale_grads_(self, factor: torch.Tensor | float) -> None:
        """grads *= factor, a float or a 0-dim device tensor (unscale by 1/loss_scale and clip, in one pass)."""

    def can_skip_on_device(self) -> bool:
        """True when step(found_inf) skips an overflowed step on the device, so the engine needs no host sync."""
        return False

    @abc.abstractmethod
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """Optimizer step (after it, the model's parameters hold the updated weights, or will once wait() returns).
        found_inf: a 0-dim tensor, 1.0 to skip; given only when can_skip_on_device()."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop the gradients (set to None)."""

    def wait(self) -> None:
        """Afterwards the model's parameters hold the last step's values (a path may still be moving them)."""

    def close(self) -> None:
        """Finish and release what runs beside the loop (worker threads, swap files, I/O engines): Engine.destroy
        and interpreter exit call it, once. Not collective. The default waits for the parameters."""
        self.wait()

    @abc.abstractmethod
    def state_dict(self, streaming: bool = False) -> dict[str, Any]:
        """Optimizer state for checkpoints (DCP-saveable). streaming (only when streams_checkpoints): on-disk
        states as entries DCP reads and writes a tensor at a time (fsdpzero.checkpoint.stream)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of state_dict."""

    def async_save(self) -> contextlib.AbstractContextManager:
        """Around the state_dict() of an async save, whose tensors DCP stages (deep-copies, on the CPU) and writes
        while training goes on: a path whose state_dict() hands out views that staging cannot copy gives copies.
        The default does nothing."""
        return contextlib.nullcontext()

    def keep_masters_on_load(self) -> contextlib.AbstractContextManager:
        """Around the model-weight load of a checkpoint whose optimizer state has MASTER entries: a path that
        refreshes its masters from loaded weights holds that off (the masters DCP just read are exact; the weights
        may be 16-bit). The default does nothing (the fp32 weights are the masters)."""
        return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 path: stages 0 (replicate mesh), 2 and 3. FSDP2 reduces (reduce-scatter / all-reduce) inside backward.

class FSDPGradPath(GradPath):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self._params = [p for p in model.parameters() if p.requires_grad]

    @classmethod
    def build(cls, model: nn.Module, plan, make_optimizer: Callable, mesh=None, *, tuning=None) -> "FSDPGradPath":
        """The optimizer over the FSDP2 shards (DTensors) that lay_out made."""
        return cls(model, make_optimizer([p for p in model.parameters() if p.requires_grad]))

    def set_sync(self, sync: bool) -> None:
        # FSDP2: skip reduce-scatter/all-reduce on off-boundary micro-steps; grads accumulate unsharded locally.
        self.model.set_requires_gradient_sync(sync)

    def finish_gradients(self) -> None:
        pass  # the boundary backward already reduced everything

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(self._params)

    @torch.no_grad()
    def scale_grads_(self, factor: torch.Tensor | float) -> None:
        if isinstance(factor, float) and factor == 1.0:
            return
        grads = [local_tensor(p.grad) for p in self._params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def can_skip_on_device(self) -> bool:
        return skips_on_device(self.optimizer)

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        step_unless(self.optimizer, found_inf)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self, streaming: bool = False) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        unstepped = not self.optimizer.state   # torch then creates the state by a step at lr 0
        state = get_optimizer_state_dict(self.model, self.optimizer)
        return drop_unstepped_state(self.optimizer, state) if unstepped else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        state = dict(state)
        unstepped = state.pop(UNSTEPPED, False)
        with keeping_impl_flags(self.optimizer):   # the saver's flags (a converted DeepSpeed state: none) are not ours
            set_optimizer_state_dict(self.model, self.optimizer, state)
        if unstepped:   # saved before its first step: the optimizer is as new
            self.optimizer.state.clear()


class ForwardOnlyPath(GradPath):
    """`deepspeed.initialize` without an optimizer (no section, none passed): ZeRO inference. The model is sharded
    (and offloaded) per the config; forward and generate run; a step is refused with the fix."""

    optimizer = None

    def __init__(self, model: nn.Module):
        self.model = model

    @classmethod
    def build(cls, model: nn.Module, plan=None, make_optimizer: Callable | None = None, mesh=None, *,
              tuning=None) -> "ForwardOnlyPath":
        return cls(model)

    def _refuse(self, *_args, **_kwargs):
        raise RuntimeError("this engine was initialized without an optimizer (no \"optimizer\" section and none "
                           "passed): it runs forward and generate only. Add an \"optimizer\" section to train")

    set_sync = lambda self, sync: None  # noqa: E731  (a backward for gradients alone is allowed, as in DeepSpeed)
    finish_gradients = grad_norm = scale_grads_ = step = _refuse

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def state_dict(self, streaming: bool = False) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._refuse()


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Fused torch Adam/AdamW/SGD read a `found_inf` tensor and skip the whole update on the device (they also undo
    their step count), so an overflow verdict needs no host sync before the step."""
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.SGD))   # groups, not defaults: a loaded state
            and all(g.get("fused") for g in optimizer.param_groups))       # dict can turn `fused` off


# How an optimizer runs, not what it computes: torch's load_state_dict copies these from the saved groups, so a
# converted DeepSpeed state or another device's checkpoint would silently switch fused Adam off (slow single-tensor
# path, and no device-side overflow skip: skips_on_device reads the live groups).
IMPL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


@contextlib.contextmanager
def keeping_impl_flags(optimizer: torch.optim.Optimizer):
    """Around an optimizer-state load: afterwards each param group has the implementation flags it had before (the
    ones make_optimizer_factory chose), and fused/capturable groups get their `step` counters on the params' device
    (a state saved unfused keeps them on the CPU, where those kernels cannot read them)."""
    own = [{k: g[k] for k in IMPL_FLAGS if k in g} for g in optimizer.param_groups]
    yield
    for g, flags in zip(optimizer.param_groups, own):
        for key in IMPL_FLAGS:
            if key in flags:
                g[key] = flags[key]
            else:
                g.pop(key, None)
        if not (g.get("fused") or g.get("capturable")):
            continue
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            step = st.get("step")
            if torch.is_tensor(step) and step.device != p.device:
                st["step"] = step.to(p.device, torch.float32)


def drop_unstepped_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """`state`, just read from an optimizer that had not stepped (its state created for it by a zero-gradient step at
    lr 0), marked UNSTEPPED, with its tensors zeroed (a reader that ignores the mark then sees Adam's fresh zeros
    and step 0, not step 1); the optimizer itself gets its empty state back, so its first step is a true first step
    (SGD's momentum buffer starts as the gradient, not wd * p + ...)."""
    optimizer.state.clear()
    for entry in state["state"].values():
        for value in entry.values():
            if torch.is_tensor(value):
                value.zero_()   # no longer the optimizer's: state.clear() let go of them
    return {**state, UNSTEPPED: True}


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None = None) -> None:
    """optimizer.step(), skipped on the device where the 0-dim `found_inf` is 1.0 (see skips_on_device)."""
    if found_inf is None:
        optimizer.step()
        return
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def global_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all grads, over all shards (DTensor grads reduce over their mesh). fp32, same on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # one norm per DTensor mesh: with tensor parallelism the tp-sharded grads live on the (dp, tp) mesh and the rest
    # on dp alone, and DTensor ops refuse to mix meshes; each group's norm is reduced over its own mesh dims
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(getattr(g, "device_mesh", None), []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float())
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_factor(norm: torch.Tensor | float, max_norm: float) -> torch.Tensor | float:
    """DeepSpeed / torch clipping coefficient max_norm / (norm + 1e-6), never above 1 (1.0 when clipping is off).
    A tensor norm gives a tensor (stays on the device: no host sync); a float norm gives a float."""
    if max_norm <= 0:
        return 1.0
    if isinstance(norm, torch.Tensor):
        return (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return min(1.0, max_norm / (norm + 1e-6))
