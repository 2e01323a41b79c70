"""Stage 1's optimizer step with torch's fused kernels: the clip/unscale factor applied inside the update
(`takes_grad_scale`), and the update run one all-gather bucket at a time, so the all-gather of bucket k overlaps the
update of bucket k+1 (`BucketStep`, `Stage1Optimizer(pipeline_step=True)`).

optimizer.step() updates a whole flat shard in one kernel, and the all-gather can only start after it. The update
is HBM-bound and the all-gather is NVLink-bound, so they can run side by side. For torch's fused Adam/AdamW this
module runs the same update kernel (torch._fused_adam_ / torch._fused_adamw_) on one bucket's slice of the master,
gradient and moment tensors at a time, with the same arguments, and counts the step once. On CUDA every element
gets the same arithmetic wherever a slice starts: bit-identical to optimizer.step()
(tests/optim/test_stage1.py::test_pipelined_step_is_bit_identical_on_gpu). On the CPU the kernel's vectorized body and
scalar tail round differently, and slicing moves elements between them: ulp-level differences. Any other optimizer
or option (amsgrad, tensor hyperparameters, differentiable, offloaded masters) takes the plain step.
"""
from __future__ import annotations

import warnings

import torch


def pipelinable(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """torch's fused Adam/AdamW with float hyperparameters and no amsgrad (the cases BucketStep reproduces), and
    update kernels that take BucketStep's call on this device (checked once: they are torch-internal ops)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or _global_optimizer_pre_hooks
            or _global_optimizer_post_hooks):
        return False   # step() runs hooks; the bucketed step would bypass them
    for g in optimizer.param_groups:
        if not g.get("fused") or g.get("amsgrad") or g.get("differentiable"):
            return False
        if any(torch.is_tensor(v) for v in (g["lr"], g["eps"], g["weight_decay"], *g["betas"])):
            return False
    return _kernels_work(torch.device(device))


_KERNELS_WORK: dict[torch.device, bool] = {}


def _kernels_work(device: torch.device) -> bool:
    if device not in _KERNELS_WORK:
        try:
            t = [torch.ones(4, device=device) for _ in range(4)]
            step = torch.zeros((), device=device)
            for update in (torch._fused_adam_, torch._fused_adamw_):
                update([t[0]], [t[1]], [t[2]], [t[3]], [], [step], amsgrad=False, lr=0.0, beta1=0.9, beta2=0.99,
                       weight_decay=0.0, eps=1e-8, maximize=False, grad_scale=None, found_inf=None)
            _KERNELS_WORK[device] = True
        except (AttributeError, TypeError, RuntimeError, NotImplementedError) as exc:
            warnings.warn(f"fsdpzero stage 1: the bucket-by-bucket step is off, torch's fused Adam kernels do not take "
                          f"its call here ({exc})", RuntimeWarning, stacklevel=3)
            _KERNELS_WORK[device] = False
    return _KERNELS_WORK[device]


def takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused Adam/AdamW/SGD read `optimizer.grad_scale` (GradScaler's hook) and divide the gradients by it
    inside the update kernel; a caller-set grad_scale (an AMP GradScaler's) is left alone."""
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.SGD)) and not hasattr(optimizer, "grad_scale")
            and all(g.get("fused") for g in optimizer.param_groups))


class BucketStep:
    """One optimizer step in pieces: construct (counts the step), call with each bucket's (master, lo, hi), finish()."""

    @torch.no_grad()
    def __init__(self, optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None):
        self.optimizer, self.grad_scale = optimizer, grad_scale
        found_inf = getattr(optimizer, "found_inf", None)
        self.group_of: dict[int, dict] = {}
        self.steps: list[torch.Tensor] = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = optimizer.state[p]
                if not st:   # what Adam creates on its first fused step
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.group_of[id(p)] = g
                self.steps.append(st["step"])
        device = self.steps[0].device if self.steps else None
        self.found_inf = found_inf.to(device) if found_inf is not None else None
        if self.grad_scale is not None:
            self.grad_scale = self.grad_scale.to(device)
        if self.steps:
            torch._foreach_add_(self.steps, 1)     # once per step, before any bucket's update (bias correction)

    @torch.no_grad()
    def __call__(self, master: torch.Tensor, lo: int, hi: int) -> None:
        g = self.group_of.get(id(master))
        if g is None:
            return
        st = self.optimizer.state[master]
        beta1, beta2 = g["betas"]
        decoupled = g.get("decoupled_weight_decay", type(self.optimizer) is torch.optim.AdamW)   # older torch: no key
        update = torch._fused_adamw_ if decoupled else torch._fused_adam_
        update([master[lo:hi]], [master.grad[lo:hi]], [st["exp_avg"][lo:hi]], [st["exp_avg_sq"][lo:hi]], [],
               [st["step"]], amsgrad=False, lr=g["lr"], beta1=beta1, beta2=beta2, weight_decay=g["weight_decay"],
               eps=g["eps"], maximize=g.get("maximize", False), grad_scale=self.grad_scale, found_inf=self.found_inf)

    @torch.no_grad()
    def finish(self) -> None:
        if self.found_inf is not None and self.steps:   # a skipped step does not count (as torch's fused Adam)
            torch._foreach_sub_(self.steps, [self.found_inf] * len(self.steps))
        self.optimizer._opt_called = True   # what step() tells an LR scheduler (else it warns of a missing step)
