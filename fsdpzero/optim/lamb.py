"""LAMB with DeepSpeed FusedLamb's math, for plain tensors and for FSDP2's DTensor-sharded parameters.

Per parameter p with gradient g, step t (DeepSpeed's CUDA kernel, restated):
    m = β1·m + (1−β1)·g            v = β2·v + (1−β2)·g²          (no bias correction applied to m,
                                                                 v themselves)
    u = m / (√v + ε)   [or m / √(v + ε) with eps_inside_sqrt]  + weight_decay·p     (decay enters the update,
                                                                                    not the gradient or moments)
    r = clamp(‖p‖ / ‖u‖, min_coeff, max_coeff), or 1 when either norm is 0 (clamped to max first, then min)
    p ← p − step_size·r·u,   step_size = lr·√(1−β2^t)/(1−β1^t) with bias_correction, else lr
The norms are of the whole parameter: for a sharded DTensor the local sums of squares are all-reduced over the
mesh dimensions it is sharded on (one collective per mesh layout per step, not one per parameter).

max_grad_norm > 0 divides the group's gradients by (‖g‖ + 1e-6)/max_grad_norm when that exceeds 1 (FusedLamb's
formula; DeepSpeed's engine never feeds it a norm and rejects the key, the engine's `gradient_clipping` is the
usual way). The update direction is recomputed rather than stored, to keep memory at Adam's level.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from fsdpzero.dist import local_tensor


def _sharded_dims(p: torch.Tensor):
    """(mesh, mesh dims that split p) for a DTensor; None for a plain tensor (its norm is already whole)."""
    if not isinstance(p, DTensor):
        return None
    dims = tuple(i for i, pl in enumerate(p.placements) if isinstance(pl, Shard))
    return (p.device_mesh, dims) if dims else None


def _sq_norm(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares, accumulated in at least fp32, returned as fp64 so mixed-dtype groups stack."""
    return torch.linalg.vector_norm(x, dtype=torch.promote_types(x.dtype, torch.float32)).double().square()


def global_sum_(sums: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """Row i of `sums` holds local partial sums for params[i]; complete them across shards in place."""
    layouts = defaultdict(list)
    for i, p in enumerate(params):
        key = _sharded_dims(p)
        if key is not None:
            layouts[(id(key[0]), key[1])].append((i, key[0]))
    for (_, dims), rows in layouts.items():
        idx = torch.tensor([i for i, _ in rows], device=sums.device)
        part = sums.index_select(0, idx)
        mesh = rows[0][1]
        for d in dims:
            dist.all_reduce(part, group=mesh.get_group(d))
        sums.index_copy_(0, idx, part)
    return sums


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's `"type": "Lamb"` (FusedLamb) semantics; see the module docstring for the update."""

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 eps_inside_sqrt: bool = False, amsgrad: bool = False):
        if amsgrad:
            raise ValueError("optimizer.params.amsgrad=true: Lamb has no AMSGrad variant (DeepSpeed's neither); "
                             "remove the key")
        for name, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("max_grad_norm", max_grad_norm)):
            if not float(v) >= 0:
                raise ValueError(f"optimizer.params.{name}={v!r}: must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"optimizer.params.betas={betas!r}: both must be in [0, 1)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                        min_coeff=min_coeff, eps_inside_sqrt=eps_inside_sqrt)
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []   # trust ratios of the last step, one per updated param

    def get_lamb_coeffs(self) -> list[float]:
        return [c.item() for c in self.lamb_coeffs]

    @staticmethod
    def _direction(p, m, v, group) -> torch.Tensor:
        denom = (v + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
        u = m / denom
        if group["weight_decay"] != 0:
            u.add_(p, alpha=group["weight_decay"])
        return u

    def _grad_clip_divisor(self, group, params) -> torch.Tensor | None:
        if group["max_grad_norm"] <= 0:
            return None
        sq = torch.stack([_sq_norm(local_tensor(p.grad)) for p in params])
        total = global_sum_(sq.unsqueeze(1), params).sum().sqrt()
        return ((total + 1e-6) / group["max_grad_norm"]).clamp(min=1.0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lamb does not support sparse gradients")
            beta1, beta2 = group["betas"]
            divisor = self._grad_clip_divisor(group, params)
            norms_sq, locals_ = [], []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                pl, m, v = local_tensor(p), local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
                g = local_tensor(p.grad)
                if divisor is not None:
                    g = g / divisor.to(g.dtype)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                u = self._direction(pl, m, v, group)
                norms_sq.append(torch.stack([_sq_norm(pl), _sq_norm(u)]))
                locals_.append((pl, m, v, int(state["step"].item())))
            w_norm, u_norm = global_sum_(torch.stack(norms_sq), params).sqrt().unbind(1)
            ratio = (w_norm / u_norm).clamp(max=group["max_coeff"]).clamp(min=group["min_coeff"])
            ratio = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))
            lr = float(group["lr"])
            for (pl, m, v, t), r in zip(locals_, ratio.unbind(0)):
                step_size = lr
                if group["bias_correction"]:
                    step_size = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
                u = self._direction(pl, m, v, group)   # recomputed: p is unchanged until now
                pl.sub_(u.mul_((r * step_size).to(u.dtype)))
                self.lamb_coeffs.append(r)
        return loss
