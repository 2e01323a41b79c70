"""What the offload path computes on the device itself: the global grad norm (in fp32) and, with
`offload_optimizer.ratio < 1`, the Adam step of the chunks that stay there."""
from __future__ import annotations

import torch
from torch.optim.adam import adam as torch_adam

from fsdpzero.optim import global_grad_norm
from fsdpzero.dist import local_tensor


def grad_norm(params) -> torch.Tensor:
    """global_grad_norm, but each tensor's norm in fp32 when the grads are low precision: the device keeps bf16
    grads here (the shards are bf16), and torch's foreach norm of bf16 tensors returns bf16 norms, a clip
    coefficient off by up to ~0.4%. DeepSpeed takes the norm in fp32; so does this. fp32 grads: global_grad_norm."""
    grads = [p.grad for p in params if p.grad is not None]
    if all(g.dtype == torch.float32 for g in grads):
        return global_grad_norm(params)
    if grads[0].device.type == "cpu":   # offload_param: asking torch for fp32 would first copy every grad to fp32
        return _cpu_norm(grads)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _cpu_norm(grads) -> torch.Tensor:
    """The norm of CPU grads from the ops' fp32 sum of squares of each local shard (2 bytes read per element),
    reduced over the mesh dims the grads are sharded on (one collective per distinct placement)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from fsdpzero.ops import cpu_adam
    sums: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        sums[key] = sums.get(key, 0.0) + cpu_adam.grad_sumsq(local_tensor(g))
    total = torch.zeros((), dtype=torch.float64)
    for key, value in sums.items():
        local = torch.tensor(value, dtype=torch.float64)
        if key is not None:   # the collective runs on the mesh's device (NCCL on a cuda mesh), the sum stays here
            mesh, placements = key
            dev = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else local.device
            local = DTensor.from_local(local.to(dev), mesh, [Partial() if p.is_shard() else Replicate()
                                                             for p in placements], run_check=False).full_tensor()
        total += local.cpu()
    return total.sqrt().float()


@torch.no_grad()
def adam_step(entries, hyper: dict[int, dict], state: dict, factor: float) -> None:
    """torch's Adam(W) on the entries' device-resident fp32 masters (fused on CUDA), one call per hyperparameter
    set. The grad is read in fp32 and scaled as the CPU kernel reads it (fp32(grad) * factor; fp32 grads in place,
    as FSDPGradPath does), then the param receives the rounded master. `hyper`: per id(master), the group's
    hyperparameters when step() was called; `state`: the optimizer's per-master state (step, exp_avg, exp_avg_sq)."""
    sets: dict[tuple, list] = {}
    for e in entries:
        if e.param.grad is not None:
            h = hyper[id(e.master)]
            key = (h["lr"], tuple(h["betas"]), h["eps"], h["weight_decay"], bool(h.get("decoupled_weight_decay")))
            sets.setdefault(key, []).append(e)
    for (lr, (beta1, beta2), eps, weight_decay, decoupled), es in sets.items():
        grads = [local_tensor(e.param.grad).float() for e in es]
        if factor != 1.0:
            for g in grads:
                g.mul_(factor)
        states = [state[e.master] for e in es]
        torch_adam([e.master for e in es], grads, [st["exp_avg"] for st in states],
                   [st["exp_avg_sq"] for st in states], [], [st["step"] for st in states], foreach=False,
                   fused=True if es[0].master.device.type == "cuda" else None, decoupled_weight_decay=decoupled,
                   amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                   maximize=False)
        for e in es:
            local = local_tensor(e.param)
            if e.master is not local:
                local.copy_(e.master)
