"""AutoTP training: the resolved plan (tp_plan.resolve_tp_plan) applied over the mesh's "tp" dimension, before
activation checkpointing and fully_shard over the data dimensions (torchtitan's order: TP, AC, FSDP). Each sharded
weight is a DTensor on the tp mesh; FSDP2 then shards it over dp as well: a 2-D (dp, tp) parameter.

    column         weight (and bias) Shard(0)   output features sharded, output left sharded
    column_gather  as column                    ... its output all-gathered over tp (an untied LM head)
    row            weight Shard(1), bias whole  input features sharded, output all-reduced over tp

A plain nn.Linear computes on its local shards (ParallelLinear, as Megatron's and DeepSpeed's LinearLayer /
LinearAllreduce): in backward one all-reduce of the input gradient per column-layer input (column layers reading one
tensor, q/k/v or gate/up, share it: SharedInput), in forward one all-reduce of the output per row layer, nothing else.
The weights stay DTensors (checkpoints, export, clipping and FSDP2 see them as before), read through to_local once per
forward. DTensor's ColwiseParallel / RowwiseParallel (parallelize_module) compute the same thing through DTensor
dispatch of every aten op of every layer, forward and backward (13 per Linear), and one all-reduce per column layer:
the suspected cause of tp 2 on 2 H200s taking 1.47x DeepSpeed's step time (BENCHMARKS.md S12). They remain the path
for Linear subclasses, whose own forward the local path would bypass (`dtensor_styles=True` forces them everywhere:
the reference the tests and bench/autotp.py's fsdpzero_dtensor compare with).

Activations between layers are plain local tensors: the transformers attention reshapes with -1 heads, so each rank
runs its heads. Everything the plan leaves out (embeddings, norms, a tied head) stays whole on every tp rank; its
gradient is the same on each (the inputs and output gradients it sees are replicated).
"""
from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdpzero.parallel.tp_plan import style_counts

log = logging.getLogger("fsdpzero")


def parallel_style(style: str):
    """DTensor's style for `style`: the path of Linear subclasses, and the reference the local path is tested on."""
    if style == "column":
        return ColwiseParallel()
    if style == "column_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "row":
        return RowwiseParallel()
    raise ValueError(f"unknown tensor-parallel style {style!r}")


# ---------------------------------------------------------------------------------------------------------------
# The collectives of a tensor-parallel Linear, on local tensors (Megatron's f / g operators)

class CopyToTP(torch.autograd.Function):
    """Forward: the replicated input as it is. Backward: the input gradient summed over tp (each rank's output
    features contribute a part of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()   # the Linear's fresh input gradient: this function is its only reader
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Forward: the partial outputs of a row-parallel Linear summed over tp. Backward: the replicated gradient as
    it is."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        y = y.contiguous()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GatherFromTP(torch.autograd.Function):
    """Forward: the last-dimension shards all-gathered whole on every tp rank. Backward: this rank's slice of the
    (replicated) gradient."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        size, n = dist.get_world_size(group), y.shape[-1]
        ctx.start, ctx.n = dist.get_rank(group) * n, n
        out = y.new_empty((size * y.shape[0], *y.shape[1:]))   # the ranks' shards stacked on dim 0
        dist.all_gather_into_tensor(out, y.contiguous(), group=group)
        return out.view(size, *y.shape).movedim(0, -2).reshape(*y.shape[:-1], size * n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.start, ctx.n).contiguous(), None


class SharedInput:
    """The CopyToTP of the last input a column layer read, reused by the next column layers that read the same tensor
    (q, k and v read one hidden state, gate and up another): autograd sums their input gradients first, so one
    all-reduce per shared input replaces one per layer (per block 2 instead of 5). Holds the last input until the
    next column layer reads another one."""

    def __init__(self):
        self.key: tuple | None = None
        self.value: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, group) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x   # no backward: CopyToTP is the identity
        key = self.key
        if key is not None and key[0]() is x and key[1] == x._version and key[2] is group:
            return self.value
        self.key, self.value = (weakref.ref(x), x._version, group), CopyToTP.apply(x, group)
        return self.value


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor parameter's local shard, differentiably (its gradient comes back as a DTensor of the same layout)."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


shared_input = SharedInput()


class ParallelLinear(nn.Linear):
    """An nn.Linear whose weight is sharded over tp, computing on local shards. `tp_style` is "column",
    "column_gather" or "row"; `tp_group` the tp process group. Made by apply_tensor_parallel from an nn.Linear
    (its class swapped, as fully_shard swaps a module's class): isinstance(m, nn.Linear) still holds."""

    tp_style: str
    tp_group: dist.ProcessGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_style == "row":
            y = ReduceFromTP.apply(F.linear(x, local(self.weight)), self.tp_group)
            return y if self.bias is None else y + local(self.bias)
        y = F.linear(shared_input(x, self.tp_group), local(self.weight), local(self.bias))
        return GatherFromTP.apply(y, self.tp_group) if self.tp_style == "column_gather" else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp_style={self.tp_style}"


def shard_linear(module: nn.Linear, style: str, tp_mesh: DeviceMesh) -> None:
    """module's weight (and bias) as DTensors on tp_mesh, laid out as ColwiseParallel / RowwiseParallel lay them
    (the same checkpoints either way); then its class swapped to ParallelLinear."""
    weight_placement = Shard(1) if style == "row" else Shard(0)
    for name, placement in (("weight", weight_placement), ("bias", Replicate() if style == "row" else Shard(0))):
        param = getattr(module, name)
        if param is not None:
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, tp_mesh, [placement]),
                                                         requires_grad=param.requires_grad))
    module.__class__ = ParallelLinear
    module.tp_style, module.tp_group = style, tp_mesh.get_group()


def apply_tensor_parallel(model: nn.Module, styles: dict[str, str], tp_mesh: DeviceMesh | None, *,
                          dtensor_styles: bool = False) -> nn.Module:
    """Shard the Linear layers of `styles` (from resolve_tp_plan) over tp_mesh: a plain nn.Linear becomes a
    ParallelLinear, a subclass gets DTensor's style (parallelize_module), every one with dtensor_styles; then a
    one-time check, on the first forward, that every rank of a tp group got the same batch. Nothing to do without
    styles or a tp mesh."""
    if not styles or tp_mesh is None:
        return model
    modules = dict(model.named_modules())
    dtensor = {name: parallel_style(s) for name, s in styles.items()
               if dtensor_styles or type(modules[name]) is not nn.Linear}
    for name, style in styles.items():
        if name not in dtensor:
            shard_linear(modules[name], style, tp_mesh)
    if dtensor:
        parallelize_module(model, tp_mesh, dtensor)
    check_same_batch_once(model, tp_mesh)
    log.info("tensor parallelism over %d ranks: %s", tp_mesh.size(), style_counts(styles))
    return model


def batch_digest(args: tuple, kwargs: dict) -> torch.Tensor:
    """A float64 digest of the tensors of one forward call: per tensor, its shape and position-weighted sum."""
    parts = []
    for value in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if torch.is_tensor(value) and not value.is_meta:
            flat = value.detach().reshape(-1).to(torch.float64)
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
            parts += [float(flat.numel()), float(value.dim()), float((flat * weights).sum())]
    return torch.tensor(parts or [0.0], dtype=torch.float64)


def check_same_batch_once(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """DeepSpeed's first-forward check (check_dataloader_inputs_same_across_ranks): the ranks of one tensor-parallel
    group compute one model replica, so they must see the same batch; a loader sharded over every rank would train on
    garbage without an error. The digest is compared on the CPU over the tp group (gloo-safe)."""
    group = tp_mesh.get_group()

    def hook(module, args, kwargs):
        handle.remove()
        mine = batch_digest(args, kwargs)
        digests = [None] * tp_mesh.size()
        dist.all_gather_object(digests, mine.tolist(), group=group)
        if any(d != digests[0] for d in digests):
            raise RuntimeError("the ranks of one tensor-parallel group got different batches: with "
                               "tensor_parallel.autotp_size each data-parallel replica is tp ranks, which must read "
                               "the same samples -> shard the data over fsdpzero.parallel.data_rank_and_size(mesh) "
                               "(fsdpzero.make_dataloader, fsdpzero's Hugging Face Trainer and accelerate's DeepSpeed "
                               "door do), not over every rank (a torch DistributedSampler's default)")
    handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


__all__ = ["CopyToTP", "GatherFromTP", "ParallelLinear", "ReduceFromTP", "apply_tensor_parallel", "batch_digest",
           "check_same_batch_once", "parallel_style", "shard_linear"]
