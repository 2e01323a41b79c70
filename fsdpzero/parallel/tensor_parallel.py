"""AutoTP training on DTensor: the resolved plan (tp_plan.resolve_tp_plan) applied with parallelize_module over the
mesh's "tp" dimension, before activation checkpointing and fully_shard over the data dimensions (torchtitan's order:
TP, AC, FSDP). FSDP2 then shards each tensor-parallel DTensor over dp as well: a 2-D (dp, tp) parameter.

    column         ColwiseParallel()                          output features sharded, output left sharded
    column_gather  ColwiseParallel(output_layouts=Replicate)  ... its output all-gathered (an untied LM head)
    row            RowwiseParallel()                          input features sharded, output all-reduced

Activations between layers are plain local tensors (use_local_output): the transformers attention reshapes with -1
heads, so each rank runs its heads. Everything the plan leaves out (embeddings, norms, a tied head) stays whole on
every tp rank; its gradient is the same on each (the inputs and output gradients it sees are replicated).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdpzero.parallel.tp_plan import style_counts

log = logging.getLogger("fsdpzero")


def parallel_style(style: str):
    if style == "column":
        return ColwiseParallel()
    if style == "column_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "row":
        return RowwiseParallel()
    raise ValueError(f"unknown tensor-parallel style {style!r}")


def apply_tensor_parallel(model: nn.Module, styles: dict[str, str], tp_mesh: DeviceMesh | None) -> nn.Module:
    """parallelize_module(model, tp_mesh, plan) with `styles` from resolve_tp_plan; then a one-time check, on the
    first forward, that every rank of a tp group got the same batch. Nothing to do without styles or a tp mesh."""
    if not styles or tp_mesh is None:
        return model
    parallelize_module(model, tp_mesh, {name: parallel_style(s) for name, s in styles.items()})
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
                               "(fsdpzero.make_dataloader does), not over every rank (the Hugging Face Trainer's and "
                               "accelerate's loaders shard over every rank: not supported with autotp_size yet)")
    handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


__all__ = ["apply_tensor_parallel", "batch_digest", "check_same_batch_once", "parallel_style"]
