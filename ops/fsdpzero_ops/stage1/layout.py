"""The flat-shard layout of ops/fsdpzero_ops/stage1/optimizer.py: each parameter is flattened, padded to a multiple of the
world size and cut into equal chunks (DTensor's Shard(0) of the flat parameter); runs group consecutive chunks into
buckets."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(eq=False)
class Slot:
    """One parameter's place in the flat shard: chunk `rank` of its flattened, padded values."""
    name: str
    param: nn.Parameter
    numel: int
    chunk: int      # ceil(numel / world): every rank's share, padding included
    offset: int     # where the share starts in the flat group's shard
    local: int      # elements of the share that are real (the rest is padding)


@dataclass(eq=False)
class Run:
    """Consecutive slots moved by one collective: shard range [lo, hi) on every rank."""
    slots: list[Slot]
    lo: int
    hi: int
    pending: int = 0                      # slots whose gradient has not arrived yet in this backward (overlap_comm)


@dataclass(eq=False)
class FlatGroup:
    """The parameters of one param group and one dtype, with this rank's fp32 master shard."""
    group_index: int
    dtype: torch.dtype
    slots: list[Slot]
    master: torch.Tensor
    reduce_runs: list[Run] = field(default_factory=list)
    gather_runs: list[Run] = field(default_factory=list)
    grad_cache: torch.Tensor | None = None   # pinned CPU master grad kept between steps (offload only)


RAMP = (8, 4, 2)   # ramped runs: the first and the last three hold at most bucket/8, /4, /2 elements


def runs(slots: list[Slot], bucket_elements: int, world: int, ramp: bool = False) -> list[Run]:
    """Cut slots into runs of at most `bucket_elements` (counted across all ranks, as DeepSpeed counts); a single
    larger parameter makes a run of its own. `ramp`: the runs grow from bucket/8 at the start and shrink to bucket/8
    at the end. Runs move through a pipeline of two (pack or cast | collective | unpack or copy-out), whose exposed
    time is the first run's copy-in and the last run's copy-out, and, for reductions launched as gradients arrive in
    slot order, the last run's collective: small end runs keep those short, big middle runs keep messages large."""
    if not ramp:
        return _greedy(slots, [bucket_elements], world)
    caps = [max(1, bucket_elements // d) for d in RAMP]
    tail = _greedy(slots[len(slots) // 2:][::-1], caps, world)[:len(caps)]   # from the back half, smallest last
    taken = sum(len(r.slots) for r in tail)
    tail = [Run(r.slots[::-1], r.slots[-1].offset, r.slots[0].offset + r.slots[0].chunk) for r in tail[::-1]]
    return _greedy(slots[:len(slots) - taken], caps + [bucket_elements], world) + tail


def _greedy(slots: list[Slot], caps: list[int], world: int) -> list[Run]:
    """Runs of consecutive slots, run i holding at most caps[min(i, len(caps) - 1)] elements (at least one slot)."""
    runs, cur, size = [], [], 0
    for s in slots:
        if cur and size + s.chunk * world > caps[min(len(runs), len(caps) - 1)]:
            runs.append(Run(cur, cur[0].offset, cur[-1].offset + cur[-1].chunk))
            cur, size = [], 0
        cur.append(s)
        size += s.chunk * world
    if cur:
        runs.append(Run(cur, cur[0].offset, cur[-1].offset + cur[-1].chunk))
    return runs


def pack(dst: torch.Tensor, flat: torch.Tensor | None, scale: float) -> None:
    """dst (world, chunk) <- flat * scale laid out row by row, zeros after the end (one kernel casts and scales)."""
    world, chunk = dst.shape
    if flat is None:
        dst.zero_()
        return
    full, rem = divmod(flat.numel(), chunk)
    torch.mul(flat[: full * chunk].view(full, chunk), scale, out=dst[:full])
    if full < world:
        torch.mul(flat[full * chunk:], scale, out=dst[full, :rem])
        dst[full, rem:].zero_()
        dst[full + 1:].zero_()


def unpack(flat: torch.Tensor, src: torch.Tensor) -> None:
    """Inverse of pack: flat <- the first flat.numel() values of src (world, chunk), row by row."""
    chunk = src.shape[1]
    full, rem = divmod(flat.numel(), chunk)
    flat[: full * chunk].view(full, chunk).copy_(src[:full])
    if rem:
        flat[full * chunk:].copy_(src[full, :rem])


@torch.no_grad()
def take_chunks(master: torch.Tensor, slots: list[Slot], rank: int) -> None:
    """master shard <- chunk `rank` of each slot's parameter (fp32 upcast)."""
    for s in slots:
        start = rank * s.chunk
        master[s.offset: s.offset + s.local].copy_(s.param.detach().view(-1)[start: start + s.local])


def named_groups(params) -> list[dict[str, Any]]:
    """Accept a module, parameters, (name, parameter) pairs, or param-group dicts (with optional "param_names")."""
    if isinstance(params, nn.Module):
        params = params.named_parameters()
    params = list(params)
    if not params:
        raise ValueError("Stage1Optimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    groups = []
    for gi, g in enumerate(params):
        g = dict(g)
        items = list(g.pop("params"))
        names = g.pop("param_names", None)
        if items and isinstance(items[0], tuple):
            names, items = [n for n, _ in items], [p for _, p in items]
        names = names or [f"group{gi}.param{i}" for i in range(len(items))]
        groups.append({"named": list(zip(names, items)), "options": g})
    return groups
