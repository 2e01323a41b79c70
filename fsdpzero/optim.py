"""The optimizer and the gradient path the engine drives at each accumulation boundary.

Two things live here:

1. `make_optimizer_factory(plan, client)`: the DeepSpeed `optimizer` section (or a client optimizer) as a function
   `params -> torch.optim.Optimizer`, so whoever owns the parameters (FSDP2 shards, a stage-1 flat shard, CPU copies
   for offload) builds the optimizer over *its* tensors.

2. The gradient path (`GradPath`): the one narrow interface between the engine and "where gradients go and how the
   optimizer consumes them". The engine never touches gradients itself; it calls, per optimizer step:

       for each micro-step:  path.set_sync(is_boundary); loss.backward()
       at the boundary:      path.finish_gradients()
                             norm = path.grad_norm()             # global L2 over every rank, of the *scaled* grads
                             if finite: path.scale_grads_(f)     # unscale and clip in one multiply
                                        path.step()
                             path.zero_grad()

   `path.optimizer` is what LR schedulers drive (its `param_groups` carry lr and betas); `state_dict()` /
   `load_state_dict()` give the optimizer state in a form DCP can save (DTensors or plain local tensors).

   Implementations: `FSDPGradPath` here (ZeRO 0/2/3 on FSDP2: reduction happens inside backward), the stage-1 path
   (`fsdpzero.stage1_path` over ops/stage1.py) and the CPU/NVMe offload path (`fsdpzero.offload`). Each provides a module-level
   `build_grad_path(model, plan, make_optimizer, mesh) -> GradPath`; `select_grad_path(plan)` picks the module.
   How the model is laid out for each path is decided by `fsdpzero.sharding.shard_model`: stage 1 leaves the
   module unwrapped (replicated plain tensors; the stage-1 path reduces gradients in `finish_gradients`), the others
   get `fully_shard`.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch
from torch import nn

from fsdpzero.plan import Plan

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]   # params (or param-group dicts) -> optimizer


@runtime_checkable
class GradPath(Protocol):
    """What the engine needs from the gradient/optimizer side. All calls are collective where noted."""

    optimizer: torch.optim.Optimizer   # schedulers set lr/betas on optimizer.param_groups

    def set_sync(self, sync: bool) -> None:
        """Before each micro-step's backward: False on off-boundary micro-steps (accumulate locally, no comm)."""

    def finish_gradients(self) -> None:
        """After the boundary backward: make the gradients the optimizer will read complete (collective)."""

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients across all ranks, as a 0-dim fp32 tensor; inf/nan on overflow
        (collective: every rank gets the same value, so the skip decision agrees)."""

    def scale_grads_(self, factor: float) -> None:
        """grads *= factor, a float or a 0-dim device tensor (unscale by 1/loss_scale and clip, in one pass)."""

    def step(self) -> None:
        """Optimizer step (after it, the model's parameters hold the updated weights)."""

    def zero_grad(self) -> None:
        """Drop the gradients (set to None)."""

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state for checkpoints (DCP-saveable)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of state_dict."""


# path kind -> module providing build_grad_path(model, plan, make_optimizer, mesh). Stage 1 and offload register
# here by name; the engine never imports them directly.
GRAD_PATHS = {
    "fsdp": "fsdpzero.optim",
    "stage1": "fsdpzero.stage1_path",
    "offload": "fsdpzero.offload",
}


def grad_path_kind(plan: Plan) -> str:
    if plan.shard.stage == 1:
        return "stage1"    # the stage-1 path reduces gradients itself, and offloads its own shards (cpu)
    if plan.offload.optimizer_device != "none":
        return "offload"
    return "fsdp"


def select_grad_path(plan: Plan) -> Callable[..., GradPath]:
    """The `build_grad_path` function for this plan."""
    kind = grad_path_kind(plan)
    if GRAD_PATHS[kind].startswith("fsdpzero_ops"):
        import fsdpzero.ops  # noqa: F401  registers the sibling ops/ folder as fsdpzero_ops
    try:
        module = importlib.import_module(GRAD_PATHS[kind])
    except ImportError as e:
        raise NotImplementedError(f"the {kind!r} gradient path ({GRAD_PATHS[kind]}) is not available: {e}") from e
    return module.build_grad_path


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 path: stages 0 (replicate mesh), 2 and 3. FSDP2 reduces (reduce-scatter / all-reduce) inside backward.

class FSDPGradPath:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self._params = [p for p in model.parameters() if p.requires_grad]

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
        grads = [_local(p.grad) for p in self._params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def can_skip_on_device(self) -> bool:
        return skips_on_device(self.optimizer)

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        step_unless(self.optimizer, found_inf)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        with keeping_impl_flags(self.optimizer):   # the saver's flags (a converted DeepSpeed state: none) are not ours
            set_optimizer_state_dict(self.model, self.optimizer, state)


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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def build_grad_path(model: nn.Module, plan: Plan, make_optimizer: OptimizerFactory, mesh=None) -> FSDPGradPath:
    return FSDPGradPath(model, make_optimizer([p for p in model.parameters() if p.requires_grad]))


def global_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all grads, over all shards (DTensor grads reduce over their mesh). fp32, same on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.float()


# ---------------------------------------------------------------------------------------------------------------
# The optimizer section -> a factory.

# DeepSpeed runs these under ZeRO without `zero_allow_untested_optimizer` (torch Adam/AdamW/Adagrad and its own
# fused/CPU Adam, Adagrad, Lion); every other optimizer needs the flag at stage >= 1.
_ZERO_TESTED = ("adam", "adamw", "adagrad", "lion")
_DS_ONLY_KEYS = ("torch_adam", "adam_w_mode", "adamw_mode", "bias_correction", "legacy_fusion", "set_grad_none")


def check_optimizer(plan: Plan, client: Any = None) -> None:
    """Errors DeepSpeed raises about the optimizer, raised before any process group exists."""
    opt = plan.optimizer
    if opt.type is None and client is None:
        raise ValueError("config key 'optimizer' is missing and no optimizer was passed: add an \"optimizer\" "
                         "section (e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}) or pass optimizer=...")
    if plan.shard.stage >= 1 and not opt.zero_allow_untested_optimizer:
        name = _client_name(client) if client is not None else opt.type
        if name.lower() not in _ZERO_TESTED and name not in ("Adam", "AdamW", "Adagrad"):
            raise ValueError(
                f"optimizer {name!r} is not one DeepSpeed tests with ZeRO (stage {plan.shard.stage}); DeepSpeed "
                "refuses it unless the config sets \"zero_allow_untested_optimizer\": true. Add that key to run it.")
    if opt.type is not None and opt.type not in ("adam", "adamw", "lamb", "sgd", "adagrad") \
            and not hasattr(torch.optim, opt.type):
        raise ValueError(f"config key 'optimizer.type' = {opt.type!r} is neither a DeepSpeed optimizer nor a "
                         "torch.optim class; use e.g. \"AdamW\", \"Lamb\", \"SGD\", or a torch.optim class name")


def _client_name(client: Any) -> str:
    if isinstance(client, torch.optim.Optimizer):
        return type(client).__name__
    return getattr(client, "__name__", type(client).__name__)


def make_optimizer_factory(plan: Plan, client: Any = None, *, device_type: str = "cpu",
                           original_params: list[torch.Tensor] | None = None,
                           param_groups: list[dict] | None = None) -> OptimizerFactory:
    """Returns `params -> optimizer`, where params are the trainable parameters in model order (FSDP2 shards,
    or whatever tensors a gradient path optimises in their place).

    The client's `model_parameters` groups and a client optimizer instance were built over the *original*
    parameters (`original_params`, same order); they are re-pointed at the new tensors by position. A client
    optimizer is rebound in place, so a client LR scheduler built on it keeps working. A callable client is
    called with the params, as DeepSpeed does."""
    def remap(params) -> list[dict] | list[torch.Tensor]:
        params = list(params)
        if original_params is None:
            return params
        if len(params) != len(original_params):
            raise ValueError(f"expected {len(original_params)} trainable tensors, got {len(params)}")
        new_of = {id(o): n for o, n in zip(original_params, params)}
        if param_groups is None:
            return params
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [new_of[id(p)] for p in g["params"] if id(p) in new_of]} for g in param_groups]

    if client is not None:
        if isinstance(client, torch.optim.Optimizer):
            def rebind(params):
                params = list(params)
                if original_params is None or client.state:
                    raise ValueError("the client optimizer must be fresh (no state) and built over the model's "
                                     "parameters")
                new_of = {id(o): n for o, n in zip(original_params, params)}
                for g in client.param_groups:
                    g["params"] = [new_of[id(p)] for p in g["params"] if id(p) in new_of]
                return client
            return rebind
        return lambda params: client(remap(params))
    opt = plan.optimizer
    kwargs = {k: v for k, v in opt.params.items() if k not in _DS_ONLY_KEYS}
    name = opt.type
    if name in ("adam", "adamw"):
        adamw = opt.adam_w_mode if name == "adam" else True
        if not opt.torch_adam:   # DeepSpeed's FusedAdam / CPUAdam default to no weight decay; torch's AdamW to 0.01
            kwargs.setdefault("weight_decay", 0.0)
        if not opt.params.get("bias_correction", True):
            return lambda params: AdamNoBiasCorrection(remap(params), adamw=adamw, **kwargs)
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        return lambda params: cls(remap(params), **_fast_impl(kwargs, device_type, fused_ok=True))
    if name == "lamb":
        from fsdpzero.lamb import Lamb
        lamb_kwargs = {k: v for k, v in opt.params.items() if k == "bias_correction" or k not in _DS_ONLY_KEYS}
        return lambda params: Lamb(remap(params), **lamb_kwargs)
    cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}.get(name) or getattr(torch.optim, name)
    fast = name in ("sgd", "adagrad")
    return lambda params: cls(remap(params), **(_fast_impl(kwargs, device_type) if fast else kwargs))


def _fast_impl(kwargs: dict, device_type: str, fused_ok: bool = False) -> dict:
    """Fused Adam/AdamW kernels (CUDA and CPU; they run on DTensor shards), else multi-tensor foreach, unless the
    user chose."""
    if "fused" in kwargs or "foreach" in kwargs:
        return kwargs
    if fused_ok and not kwargs.get("amsgrad") and device_type in ("cuda", "cpu"):
        return {**kwargs, "fused": True}
    return {**kwargs, "foreach": True}


class AdamNoBiasCorrection(torch.optim.Optimizer):
    """DeepSpeed's FusedAdam with `bias_correction: false`: Adam/AdamW without the 1/(1-beta^t) factors."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True, **unused):
        if unused.pop("amsgrad", False):
            raise ValueError("optimizer.params.amsgrad = true is not supported with bias_correction = false")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            beta1, beta2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad, st = p.grad, self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                if g["weight_decay"]:
                    if g["adamw"]:
                        p.mul_(1 - g["lr"] * g["weight_decay"])
                    else:
                        grad = grad.add(p, alpha=g["weight_decay"])
                st["exp_avg"].lerp_(grad, 1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(g["eps"]), value=-g["lr"])
        return loss


def clip_factor(norm: torch.Tensor | float, max_norm: float) -> torch.Tensor | float:
    """DeepSpeed / torch clipping coefficient max_norm / (norm + 1e-6), never above 1 (1.0 when clipping is off).
    A tensor norm gives a tensor (stays on the device: no host sync); a float norm gives a float."""
    if max_norm <= 0:
        return 1.0
    if isinstance(norm, torch.Tensor):
        return (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return min(1.0, max_norm / (norm + 1e-6))
