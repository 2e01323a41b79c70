"""The checkpoint view of a Stage1Optimizer: per-parameter logical tensors that DCP reshards.

A rank's share of parameter p is chunk `rank` of the flattened p (ceil(numel/world) elements, the tail padded):
exactly DTensor's Shard(0) of a 1-D tensor of p.numel(). So the master and every elementwise optimizer state of p
is exposed as `DTensor.from_local(view of the flat shard, mesh, [Shard(0)], shape=(numel,))`: no copies, and DCP
writes each rank's piece and reads whatever pieces another world size needs. Keys are parameter names, so the
layout (world size, bucket sizes, param-group split by dtype) may change between save and load.

    {"state": {name: {"master": DTensor, "exp_avg": DTensor, ..., "step": scalar}}, "param_groups": [...]}

`shard_whole_state` cuts a state kept per whole parameter (an optimizer wrapped after construction) the same way.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _mesh(opt):
    from torch.distributed.device_mesh import DeviceMesh
    if opt.logical_mesh is None:
        device = opt.flat_groups[0].master.device.type
        opt.logical_mesh = DeviceMesh.from_group(opt.group or dist.group.WORLD, device)
    return opt.logical_mesh


def _logical(opt, s, flat: torch.Tensor, copies: bool = False) -> torch.Tensor:
    """This rank's piece of one parameter's flat tensor, as a 1-D DTensor (a plain tensor on one rank): a view, or
    with `copies` a copy of its own (see logical_state_dict)."""
    piece = flat[s.offset: s.offset + s.local]
    if copies:
        piece = piece.clone()
    if opt.world == 1:
        return piece
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(piece, _mesh(opt), [Shard(0)], run_check=False, shape=torch.Size([s.numel]),
                              stride=(1,))


def _elementwise(inner: dict, master: torch.Tensor) -> list[str]:
    keys = []
    for key, value in inner.items():
        if torch.is_tensor(value) and value.shape == master.shape:
            keys.append(key)
        elif not (torch.is_tensor(value) and value.dim() == 0):
            raise NotImplementedError(f"optimizer state {key!r} of shape {tuple(getattr(value, 'shape', ()))} is not "
                                      "elementwise; Stage1Optimizer cannot shard it")
    return keys


@torch.no_grad()
def shard_whole_state(opt, whole: dict[torch.Tensor, dict[str, Any]]) -> None:
    """Inner optimizer state <- this rank's chunks of a state kept per whole parameter (`whole`: param -> state),
    e.g. what an optimizer built over the whole parameters created at construction (Adagrad's sums)."""
    for fg in opt.flat_groups:
        first = whole.get(fg.slots[0].param)
        if not first:
            continue
        new = {}
        for key, value in first.items():
            if torch.is_tensor(value) and value.shape == fg.slots[0].param.shape:
                new[key] = torch.zeros_like(fg.master)
                for s in fg.slots:
                    start = opt.rank * s.chunk
                    piece = whole[s.param][key].reshape(-1)[start: start + s.local]
                    new[key][s.offset: s.offset + s.local].copy_(piece)
            else:
                new[key] = value.clone() if torch.is_tensor(value) else value
        opt.optimizer.state[fg.master] = new


@torch.no_grad()
def ensure_state(opt) -> None:
    """Create the inner optimizer's state (a zero-gradient step at lr 0) so there is something to load into. Its
    scalar counters go back to 0, so the next real step still behaves as the first (Adam's bias correction)."""
    inner = opt.optimizer
    if all(fg.master in inner.state for fg in opt.flat_groups):
        return
    saved = [g["lr"] for g in inner.param_groups]
    for g in inner.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
    for fg in opt.flat_groups:
        fg.master.grad = torch.zeros_like(fg.master)
    inner.step()
    for g, lr in zip(inner.param_groups, saved):
        g["lr"] = lr
    for fg in opt.flat_groups:
        fg.master.grad = None
        for value in inner.state[fg.master].values():
            if torch.is_tensor(value) and value.dim() == 0:
                value.zero_()


def logical_state_dict(opt, copies: bool = False) -> dict[str, Any]:
    """copies: each tensor a copy of its own instead of a view of the flat shards, for a save that reads them later
    while training goes on (DCP's async save). Its staging also deep-copies CPU DTensors, which fails on a view at
    a storage offset ("invalid python storage", torch 2.13) and would copy the whole flat shard for each view."""
    ensure_state(opt)
    state: dict[str, dict[str, Any]] = {}
    for fg in opt.flat_groups:
        inner = opt.optimizer.state[fg.master]
        keys = _elementwise(inner, fg.master)
        for s in fg.slots:
            entry = {"master": _logical(opt, s, fg.master, copies)}
            for key, value in inner.items():
                if key in keys:
                    entry[key] = _logical(opt, s, value, copies)
                else:   # scalars repeat per parameter
                    entry[key] = value.clone() if copies and torch.is_tensor(value) else value
            state[s.name] = entry
    groups = []
    for index, g in enumerate(opt.optimizer.param_groups):
        names = [s.name for fg in opt.flat_groups if fg.group_index == index for s in fg.slots]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "param_names": names})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_logical_state_dict(opt, state_dict: dict[str, Any]) -> None:
    """Copy each parameter's pieces into the flat shards. A piece may be this rank's DTensor (from DCP) or a full
    plain tensor of the parameter's numel (e.g. a consolidated checkpoint): the rank slices its chunk."""
    ensure_state(opt)
    state = state_dict["state"]
    missing = [s.name for fg in opt.flat_groups for s in fg.slots if s.name not in state]
    if missing:
        raise KeyError(f"optimizer state dict lacks parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for fg in opt.flat_groups:
        inner = opt.optimizer.state[fg.master]
        keys = _elementwise(inner, fg.master)
        for key in inner:
            if key not in keys:
                inner[key].copy_(state[fg.slots[0].name][key])    # one scalar per flat group
        for s in fg.slots:
            for key, target in [("master", fg.master)] + [(k, inner[k]) for k in keys]:
                src = state[s.name][key]
                src = src.to_local() if hasattr(src, "to_local") else src
                if src.numel() != s.local:
                    src = src.reshape(-1)[opt.rank * s.chunk: opt.rank * s.chunk + s.local]
                target[s.offset: s.offset + s.local].copy_(src)
    for g, saved in zip(opt.optimizer.param_groups, state_dict["param_groups"]):
        g.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
