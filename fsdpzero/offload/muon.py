"""`optimizer.type: "Muon"` with `offload_optimizer.device: cpu` on the offload path (stages 2 and 3; stage 1 offloads
its own flat shards and runs fsdpzero.optim.muon.MuonWithAuxAdam on them). DeepSpeed 0.19.8 runs Muon with CPU
offload at stages 1-3 (stage_1_and_2._apply_muon_updates_cpu_offload, stage3._muon_update_sub_group) and computes
what it computes without offload.

The fp32 masters and Muon's momentum live on the CPU. When the gradients are complete (MuonGradPath.finish_gradients,
before the global norm), each Muon matrix's momentum goes to the gradient's device for its nesterov blend, whose
Newton-Schulz runs once, on one owner rank (fsdpzero.optim.muon.Orthogonalizer: gathered there, batched with the
owner's other matrices of its shape, scattered back; a window of matrices at a time, so the device holds a bounded
number of blends);
the update replaces the gradient on the device, so the global norm and the clip cover it as DeepSpeed's do, and an
fp32 copy of it goes to the CPU for the step. The new momentum lands when the step happens (commit_staged), not on
a skipped one. The CPU step: master *= 1 - lr * weight_decay; master -= lr * clip * update; the AdamW half is CPU
Adam's fused kernel, as without Muon.
"""
from __future__ import annotations

import torch

from fsdpzero.dist import local_tensor
from fsdpzero.optim.muon import NS_WINDOW_BYTES, MuonWithAuxAdam, Orthogonalizer
from fsdpzero_ops.cpu_adam import CPUAdam

MUON_ONLY = ("momentum", "ns_method")


def muon_groups(make_optimizer, params: list[torch.Tensor]) -> list[dict]:
    """The configured MuonWithAuxAdam's param groups (DeepSpeed's split and hyper-parameters) as the offload path's
    hyper groups: the Muon halves keep use_muon, lr, momentum, weight_decay, ns_method; the AdamW halves are CPU
    Adam's (decoupled weight decay as adam_w_mode says, bias correction as DeepSpeed's adam_update)."""
    optimizer = make_optimizer(params)
    if not isinstance(optimizer, MuonWithAuxAdam):
        raise TypeError(f"optimizer.type Muon built a {type(optimizer).__name__}")
    groups = []
    for g in optimizer.param_groups:
        if g["use_muon"]:
            groups.append(dict(params=list(g["params"]), use_muon=True, lr=float(g["lr"]), momentum=g["momentum"],
                               weight_decay=g["weight_decay"], ns_method=g["ns_method"]))
        else:
            groups.append(dict(params=list(g["params"]), use_muon=False, lr=float(g["lr"]), betas=tuple(g["betas"]),
                               eps=g["eps"], weight_decay=g["weight_decay"],
                               decoupled_weight_decay=optimizer.adam_w_mode, bias_correction=True))
    return groups


class CPUMuonWithAuxAdam(CPUAdam):
    """CPU Adam over the offload path's masters, whose use_muon groups take Muon (the module docstring).
    bind_params(entries) names each master's model parameter (its gradient, its shard layout)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._param_of: dict[int, torch.nn.Parameter] = {}
        self._staged: dict | None = None      # master -> (new momentum, fp32 update), from orthogonalize_grads
        self._updates: dict[int, torch.Tensor] = {}   # the step's updates, read by step_param (maybe in a worker)
        self.ns_window_bytes = NS_WINDOW_BYTES        # the Orthogonalizer's window (0: one matrix at a time)

    def bind_params(self, entries) -> None:
        self._param_of = {id(e.master): e for e in entries}

    def _is_muon(self, master) -> bool:
        return any(g["use_muon"] and any(p is master for p in g["params"]) for g in self.param_groups)

    def state_for(self, param):
        state = self.state[param]
        if not state and self._is_muon(param):
            state["step"] = torch.tensor(0.0)
            state["momentum_buffer"] = torch.zeros_like(param, dtype=torch.float32)
        return super().state_for(param)

    @torch.no_grad()
    def orthogonalize_grads(self) -> None:
        """Each Muon gradient becomes its orthogonalized update (on the device, and an fp32 CPU copy for the step);
        once per boundary, as MuonWithAuxAdam.orthogonalize_grads."""
        if self._staged is not None:
            return
        muon = [(g, m) for g in self.param_groups if g["use_muon"] for m in g["params"]]
        if any(self._param_of[id(m)].param.device.type == "cuda" for _, m in muon):
            torch.cuda.synchronize()   # the early D2H copies of the gradients rewritten below are done
        self._staged = staged = {}
        ortho = Orthogonalizer(self.ns_window_bytes)
        for group, master in muon:
            param = self._param_of[id(master)].param
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad, beta, made = local_tensor(param.grad), group["momentum"], {}

            # made when its window starts: the momentum is on the device only for its window
            def blend(grad=grad, beta=beta, master=master, made=made):
                g = grad.float()
                m = self.state_for(master)["momentum_buffer"].to(g.device).lerp(g, 1 - beta)
                made["m"] = m.to("cpu")
                return g.lerp(m, beta)

            def done(update, grad=grad, master=master, made=made):
                grad.copy_(update)
                staged[master] = (made["m"], update.to("cpu", torch.float32).view(master.shape))
            ortho.add_rows(blend, param, group["ns_method"], done)
        ortho.run()

    def commit_staged(self) -> None:
        """The step happens (MuonGradPath.step): the new momentum lands; the updates wait for step_param."""
        staged, self._staged = self._staged or {}, None
        for master, (m, update) in staged.items():
            self.state_for(master)["momentum_buffer"].copy_(m.view(master.shape))
            self._updates[id(master)] = update

    def drop_staged(self) -> None:
        """A skipped step (or zero_grad after a step): nothing of this boundary's orthogonalization lands."""
        self._staged = None

    @torch.no_grad()
    def step_param(self, param, grad, out=None, grad_scale=1.0, hyper=None, into=None):
        group = hyper if hyper is not None else next(g for g in self.param_groups if any(p is param for p in
                                                                                         g["params"]))
        if not group.get("use_muon"):
            return super().step_param(param, grad, out, grad_scale, hyper, into)
        if into is not None:
            raise ValueError("Muon's CPU step is not speculative")
        update = self._updates.pop(id(param))
        state = self.state_for(param)
        state["step"] += 1
        if float(grad_scale) != 1.0:
            update = update * float(grad_scale)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(update, alpha=-group["lr"])
        if out is not None:
            out.copy_(param.view(out.shape))
