"""Fused CPU Adam/AdamW: one pass over fp32 master + exp_avg + exp_avg_sq + a fp32/bf16/fp16 gradient, writing the
fp32 master and states and, optionally, the low-precision copy of the updated master (the buffer shipped back to
the accelerator in ZeRO-Offload). The casts are what make torch's fused AdamW slow for offload: fused here, they
cost nothing, and the step runs at memory speed (~28 bytes/param).

    opt = CPUAdamW(model.parameters(), lr=1e-4, weight_decay=0.01)     # drop-in torch optimizer for CPU params
    opt.step()
    opt.step_param(master, grad_bf16, out=pinned_bf16)                  # offload: one param, low-precision in/out

Kernels (ops/csrc/cpu_adam.cpp): AVX-512, AVX2 and scalar, picked at run time for the host CPU. Choose one with
`impl=` (the library passes its `cpu_adam_impl` knob, FSDPZERO_CPU_ADAM_IMPL) = auto | avx512 | avx2 | scalar |
reference. "reference" is the pure-torch path below; it also runs, after one warning, when the op cannot be built (no
compiler, or `build=False`: the library's `no_build` knob). Both are arguments: this package keeps no settings, so
two engines in one process each get their own.
Threads: the op uses torch's intra-op pool, i.e. torch.set_num_threads().
"""
from __future__ import annotations

import math
import warnings

import torch

from .build import load_op

_ISA = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2}
IMPLS = ("auto", "avx512", "avx2", "scalar", "reference")
_warned_fallback = False   # the no_build warning is given once per process (a warning latch, not a setting)


def _built(build: bool = True) -> bool:
    """True when the C++ op is loaded (build=False: never compiled, never loaded); otherwise warn once and let
    callers take the reference path."""
    global _warned_fallback
    if load_op("fsdpzero_cpu_adam", ("cpu_adam.cpp",), ("-fopenmp",), ("-fopenmp",), build=build) is not None:
        return True
    if not _warned_fallback and not build:  # load_op warns about failed builds itself
        warnings.warn("fsdpzero: no_build (FSDPZERO_NO_BUILD=1): CPU Adam runs the pure-torch reference path (slower)",
                      RuntimeWarning, stacklevel=3)
    _warned_fallback = True
    return False


def available_impls(build: bool = True) -> list[str]:
    """The implementations this host can run, fastest first; "reference" always (only that one with build=False)."""
    if not _built(build):
        return ["reference"]
    best = torch.ops.fsdpzero.adam_best_isa()
    return [name for name in ("avx512", "avx2", "scalar") if _ISA[name] <= best] + ["reference"]


def _resolve(impl: str | None, build: bool = True) -> str:
    impl = impl or "auto"
    if impl not in IMPLS:
        raise ValueError(f"CPU Adam impl={impl!r} is not one of {IMPLS}")
    if impl != "reference" and not _built(build):
        return "reference"
    return impl


@torch.no_grad()
def reference_adam_step_(param, grad, exp_avg, exp_avg_sq, out=None, *, lr, beta1, beta2, eps, weight_decay,
                         step, adamw=True, bias_correction=True, grad_scale=1.0):
    """Pure-torch Adam/AdamW step with the same contract as the fused op (the torch.optim formulas)."""
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay:
        if adamw:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if out is not None:
        out.copy_(param)


def adam_step_(param, grad, exp_avg, exp_avg_sq, out=None, *, lr, beta1, beta2, eps, weight_decay, step,
               adamw=True, bias_correction=True, grad_scale=1.0, impl=None, build=True, src=None):
    """One fused Adam(W) step in place on contiguous CPU tensors. param/exp_avg/exp_avg_sq: fp32; grad and out
    (optional, written with the updated param rounded to its dtype): fp32, bf16 or fp16, same number of elements.
    grad_scale multiplies the gradient as it is read (fold 1/loss_scale and the clip coefficient in here).
    src=(param_in, exp_avg_in, exp_avg_sq_in): read the master and states from there instead and leave them as they
    are (out of place: param/exp_avg/exp_avg_sq only receive the result; the same bits as the in-place step).
    impl: the kernel (None: auto); build=False: never compile the op (the reference path)."""
    impl = _resolve(impl, build)
    kw = dict(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
              weight_decay=float(weight_decay), step=int(step), adamw=bool(adamw),
              bias_correction=bool(bias_correction), grad_scale=float(grad_scale))
    if impl == "reference":
        if src is not None:
            for dst, s in zip((param, exp_avg, exp_avg_sq), src):
                dst.copy_(s)
        reference_adam_step_(param, grad, exp_avg, exp_avg_sq, out, **kw)
    elif src is not None:
        torch.ops.fsdpzero.adam_step_into(src[0], grad, src[1], src[2], param, exp_avg, exp_avg_sq, out, **kw,
                                          isa=_ISA[impl])
    else:
        torch.ops.fsdpzero.adam_step(param, grad, exp_avg, exp_avg_sq, out, **kw, isa=_ISA[impl])


def grad_sumsq(t: torch.Tensor, build: bool = True) -> float:
    """Sum of squares of a CPU fp32/bf16/fp16 tensor, in fp32 per 1024-element block and in double across blocks
    (the same result for any thread count); reference path (no op, or build=False): in double."""
    t = t.contiguous()
    if _built(build):
        return torch.ops.fsdpzero.grad_sumsq(t)
    return float(t.double().square().sum())


def _local(t):
    """FSDP2 shards are DTensors: the kernel works on the local shard."""
    return t.to_local() if hasattr(t, "to_local") else t


class CPUAdam(torch.optim.Optimizer):
    """Adam on CPU parameters with the fused kernel. adamw_mode=False (default, like torch.optim.Adam) adds
    weight_decay * param to the gradient (L2); adamw_mode=True decays the param directly (AdamW). Unlike
    DeepSpeedCPUAdam, whose default is adamw_mode=True, CPUAdam follows torch.optim.Adam and CPUAdamW follows
    torch.optim.AdamW. Parameters may be fp32 (updated in place) or bf16/fp16 (an fp32 master is kept in the state
    and the param receives the rounded result). The state ("step", "exp_avg", "exp_avg_sq") has torch.optim.Adam's
    layout, so state dicts move between the two."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, adamw_mode=False,
                 bias_correction=True, amsgrad=False, impl=None, build=True):
        if amsgrad:
            raise ValueError("CPUAdam: amsgrad=True is not supported by the fused CPU kernel; set amsgrad=False "
                             "(DeepSpeedCPUAdam does not support it either)")
        if not 0.0 <= lr:
            raise ValueError(f"CPUAdam: lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam: betas={betas} must both lie in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"CPUAdam: eps={eps} must be >= 0")
        if not 0.0 <= weight_decay:
            raise ValueError(f"CPUAdam: weight_decay={weight_decay} must be >= 0")
        # torch.optim.Adam's group key for AdamW mode, so state dicts load into either optimizer unchanged
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.impl = _resolve(impl, build)   # the kernel, chosen once (impl=None: auto)
        self.build = build                  # build=False: never compile the op (grad_sumsq's reference path too)
        self._group_of: dict[int, dict] = {}

    def state_for(self, param):
        state = self.state[param]
        if not state:
            local = _local(param)
            if local.device.type != "cpu":
                raise ValueError(f"CPUAdam: params must live on the CPU, got one on {local.device}; move them "
                                 "with .cpu() or use a GPU optimizer")
            if not local.is_contiguous():
                raise ValueError("CPUAdam: params must be contiguous (got strides "
                                 f"{tuple(local.stride())} for shape {tuple(local.shape)})")
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(local, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(local, dtype=torch.float32)
            if local.dtype != torch.float32:
                state["master"] = local.float()
        return state

    def _update(self, param, grad, out, group, grad_scale=1.0, into=None):
        state = self.state_for(param)
        for key in ("exp_avg", "exp_avg_sq", "master"):  # load_state_dict casts states to the param's dtype
            if key in state and state[key].dtype != torch.float32:
                state[key] = state[key].float()
        local = _local(param)
        master = state.get("master", local)
        if master is not local:  # low-precision param: it receives the rounded master
            if out is not None or into is not None:
                raise ValueError("CPUAdam.step_param: out= and into= are only for fp32 params; a low-precision "
                                 "param receives the rounded master itself")
            out = local
        live = (master, state["exp_avg"], state["exp_avg_sq"])
        if into is None:
            state["step"] += 1
            dst, src, step = live, None, int(state["step"].item())
        else:                    # the step this optimizer would take next, written elsewhere; nothing here moves
            dst, src, step = into, live, int(state["step"].item()) + 1
        beta1, beta2 = group["betas"]
        adam_step_(dst[0], _local(grad).contiguous(), dst[1], dst[2], out,
                   lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                   step=step, adamw=group.get("decoupled_weight_decay", False),
                   bias_correction=group.get("bias_correction", True), grad_scale=grad_scale, impl=self.impl,
                   src=src)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, None, group)
        return loss

    @torch.no_grad()
    def step_param(self, param, grad, out=None, grad_scale=1.0, hyper=None, into=None):
        """Step one of this optimizer's params with an explicit gradient (any of fp32/bf16/fp16, e.g. just copied
        from the GPU) and write the updated param, rounded, into `out` (e.g. a pinned bf16 buffer for the H2D copy).
        Uses the hyperparameters of the param's group, or `hyper` (a snapshot of them, for a step running while a
        scheduler already moves the group on); grad_scale multiplies the gradient as it is read.
        into=(master, exp_avg, exp_avg_sq) (fp32 params only): write the updated master and moments there and
        leave the param, its state and the step count as they are (a speculative step; the caller commits it)."""
        if hyper is not None:
            self._update(param, grad, out, hyper, grad_scale, into)
            return
        group = self._group_of.get(id(param))
        if group is None or not any(g is group for g in self.param_groups):  # new groups after load_state_dict
            self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
            group = self._group_of.get(id(param))
            if group is None:
                raise ValueError("CPUAdam.step_param: this tensor is not one of the optimizer's params")
        self._update(param, grad, out, group, grad_scale, into)


class CPUAdamW(CPUAdam):
    """AdamW (decoupled weight decay) on CPU parameters; drop-in for torch.optim.AdamW, defaults included."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, bias_correction=True,
                 amsgrad=False, impl=None, build=True):
        super().__init__(params, lr, betas, eps, weight_decay, adamw_mode=True, bias_correction=bias_correction,
                         amsgrad=amsgrad, impl=impl, build=build)
