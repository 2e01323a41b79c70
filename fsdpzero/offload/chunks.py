"""The offload path's bookkeeping: one entry per parameter (its fp32 master and pinned copy buffers), pipeline
chunks of entries, and the optimizer state dict in the parameters' own placement (DCP saves each rank's shard)."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch import nn
from fsdpzero.dist import local_tensor

CHUNK = 1 << 24     # elements per pipeline chunk (64 MiB of fp32 master): small enough to overlap, large to thread


@dataclass
class Entry:
    name: str
    param: nn.Parameter            # the model's (sharded) parameter
    master: torch.Tensor           # fp32 CPU; the param's own local shard when it is fp32 and on the CPU
    grad_buf: torch.Tensor | None  # pinned CPU landing buffer for the grad (None: read the CPU grad directly)
    out_buf: torch.Tensor | None   # pinned CPU low-precision param written by the kernel, then copied H2D
    on_device: bool = False        # offload_optimizer.ratio < 1: master and states live with the param and
                                   # torch's Adam steps it there (fused on CUDA)


def chunk_layout(units: list[list[tuple[str, int]]], chunk_size: int) -> list[list[str]]:
    """Names per pipeline chunk: consecutive params of one unit, <= chunk_size elements unless one param is larger.
    The builder uses it to decide which chunks stay on the device (ratio < 1) before the path exists."""
    chunks: list[list[str]] = []
    for unit in units:
        size = 0
        for i, (name, numel) in enumerate(unit):
            if i == 0 or size + numel > chunk_size:
                chunks.append([])
                size = 0
            chunks[-1].append(name)
            size += numel
    return chunks


@dataclass
class Chunk:
    entries: list[Entry] = field(default_factory=list)
    numel: int = 0
    d2h_done: object = None        # CUDA event: this chunk's grads have landed in their pinned buffers
    h2d_done: object = None        # CUDA event: this chunk's updated params have been copied back
    ready: threading.Event = field(default_factory=threading.Event)   # CPU side: stepped (and H2D queued)
    unit: nn.Module | None = None  # the FSDP module whose shards these are

    def __post_init__(self):
        self.ready.set()


STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")   # Adam's moments; Muon's (fsdpzero/offload/muon.py)


def offload_state_dict(entries, optimizer, by_master) -> dict:
    """Per parameter name: step, exp_avg and exp_avg_sq (Muon: momentum_buffer) and the fp32 master, as DTensors
    placed like the param (CPU local shards) so DCP saves each rank's own shard; plus the param groups'
    hyperparameters."""
    state = {}
    for e in entries:
        st = optimizer.state_for(e.master)   # created (zeros, step 0) before the first step: DCP loads
        tensors = {k: st[k] for k in STATE_KEYS if k in st}   # into this dict in place
        tensors["master"] = e.master
        state[e.name] = {"step": st["step"], **{k: shard_like(e.param, v) for k, v in tensors.items()}}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [by_master[id(m)].name for m in g["params"]]} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_offload_state_dict(entries, optimizer, sd: dict) -> None:
    names = {e.name: e for e in entries}
    for name, saved in sd["state"].items():
        e = names[name]
        st = optimizer.state_for(e.master)
        st["step"] = saved["step"].to(st["step"].device, torch.float32, copy=True)
        for k in (k for k in STATE_KEYS if k in st):
            st[k].copy_(local_tensor(saved[k]).view(st[k].shape))
        if "master" in saved:   # absent in a non-offload checkpoint: the model weights just loaded are the masters
            e.master.copy_(local_tensor(saved["master"]).view(e.master.shape))
            local_tensor(e.param).copy_(e.master.view(local_tensor(e.param).shape))   # the device copy follows
                                                                                      # the master
    for group, saved in zip(optimizer.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def on_stream(stream):
    """torch.cuda.stream(stream), or nothing on CPU-only runs."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def shard_like(param, local: torch.Tensor):
    """`local` as a DTensor shard placed like `param` (a plain tensor when param is plain)."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local.view(local_tensor(param).shape), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride(), run_check=False)
