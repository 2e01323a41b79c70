"""ZeRO stages on FSDP2: a fixed sequence, as in torchtitan's parallelize functions.

    1. activation checkpointing on each block (so FSDP2's hooks stay outside the recomputed region)
    2. fully_shard on each transformer block, bottom-up
    3. fully_shard on the root (embeddings, final norm, head and anything not in a block)
    4. explicit prefetch when the plan asks for more than FSDP2's implicit one-block lookahead
    5. (with the `compile` section or knob) torch.compile of each block's forward, inside FSDP2's hooks and around
       the checkpointed region: fsdpzero/compile.py, run by the engine (`Engine.compile`) right after

Stage 0 is FSDP2 on a (world, 1) mesh, i.e. replicate across ranks and shard over a group of one. Why not DDP: the
same `fully_shard` code then carries every stage, so bf16/fp16 `MixedPrecisionPolicy` with fp32 masters,
`set_requires_gradient_sync` accumulation and the DTensor global grad norm work identically at stage 0; the
all-reduce still overlaps backward per block, which is what DDP's buckets do. Stage 1 is left unwrapped: the
stage-1 gradient path (fsdpzero.optim.stage1.Stage1GradPath.lay_out) runs only checkpoint_activations, and reduces
gradients and shards the optimizer itself.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)

from fsdpzero import fsdp2_internals
from fsdpzero.activation import apply_checkpointing
from fsdpzero.parallel.mesh import build_parallel_mesh
from fsdpzero.plan import Plan

log = logging.getLogger("fsdpzero")

BlockPredicate = Callable[[nn.Module], bool]


def build_mesh(plan: Plan, world_size: int, device_type: str) -> DeviceMesh:
    """(dp,) for stages 1-3, (replicate, shard) for stage 0, MiCS and hybrid; with tensor parallelism a "tp"
    dimension after those (fsdpzero.parallel.mesh), and FSDP2 gets the data dimensions (data_mesh)."""
    shape, names = tuple(plan.shard.mesh_shape), tuple(plan.shard.mesh_dim_names)
    tp = plan.tensor_parallel.size
    if world_size % tp:
        raise ValueError(f"tensor_parallel.autotp_size = {tp} does not divide the world size {world_size}: use a "
                         "divisor of it")
    data_world = world_size // tp
    if plan.shard.stage == 0:
        shape, names = (data_world, 1), ("replicate", "shard")
    elif len(shape) == 1:
        shape = (data_world,)
    n = tp
    for s in shape:
        n *= s
    if n != world_size:
        raise ValueError(f"mesh {dict(zip(names, shape))} (from zero_optimization.mics_shard_size / hybrid) needs "
                         f"{n} ranks but the world has {world_size}: pick a shard size that divides {world_size}")
    if tp > 1:
        return build_parallel_mesh(device_type, shape, names, tp=tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def find_blocks(model: nn.Module, block_classes: Iterable[str | type] | None = None,
                predicate: BlockPredicate | None = None) -> list[nn.Module]:
    """Transformer blocks to shard one by one: HF's `_no_split_modules` class names unless the caller names classes
    or gives a predicate. Outermost matches only (a match inside a matched block is part of that block).

    A model that declares nothing (no `_no_split_modules`, no classes, no predicate) is one unit: the root. When
    blocks were declared or asked for and none matched, that is an error, not a silent one-unit model."""
    names: set[str] = set()
    if predicate is None:
        wanted = list(block_classes) if block_classes is not None else list(getattr(model, "_no_split_modules", None)
                                                                           or [])
        if not wanted:
            log.info("%s declares no transformer blocks (no HF _no_split_modules): sharding it as one "
                     "unit; pass block_classes=[...] or block_predicate=fn for per-block sharding",
                     type(model).__name__)
            return []
        names = {c if isinstance(c, str) else c.__name__ for c in wanted}
        predicate = lambda m: type(m).__name__ in names  # noqa: E731
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if m is model or id(m) in inside:
            continue
        if predicate(m):
            blocks.append(m)
            inside.update(id(c) for c in m.modules())
    if not blocks:
        what = f"block classes {sorted(names)}" if names else "block_predicate"
        raise ValueError(f"no submodule of {type(model).__name__} matched {what}: nothing to shard per block. "
                         "Pass block_classes=[...] naming the repeated layer class, or block_predicate=fn")
    return blocks


def reshard_policy(plan: Plan, shard_size: int) -> bool | int:
    """Stage 3: True; stage 2 and 0: False; hpZ k: keep a 1/k copy after forward (k = 1 -> False, k >= shard
    group -> True, as FSDP2 accepts only a proper divisor of the shard group)."""
    raf = plan.shard.reshard_after_forward if plan.shard.stage == 3 else False
    if isinstance(raf, bool):
        return raf
    if raf <= 1:
        return False
    if raf >= shard_size:
        return True
    if shard_size % raf:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size = {raf} must divide the shard group size "
                         f"{shard_size}; use a divisor such as the GPUs per node")
    return int(raf)


def offload_policy(plan: Plan, device_type: str) -> OffloadPolicy:
    if plan.offload.param_device in ("cpu", "nvme"):   # nvme: CPU shards, swapped to disk by offload/param_swapper.py
        # pinning needs an accelerator (pin_memory() raises on CPU-only machines); nvme shards stay pageable, as
        # the swapper needs them (pinned blocks never leave torch's cache: see
        # fsdp2_internals.own_resizable_storages)
        pin = plan.offload.pin_memory and device_type == "cuda" and plan.offload.param_device == "cpu"
        return CPUOffloadPolicy(pin_memory=pin)
    return OffloadPolicy()


def checkpoint_activations(model: nn.Module, plan: Plan, blocks: list[nn.Module]) -> None:
    """The plan's activation checkpointing on each block, before any fully_shard (FSDP2's hooks stay outside)."""
    if plan.activation_checkpointing.enabled:
        how = apply_checkpointing(model, blocks, cpu_offload=plan.activation_checkpointing.cpu_checkpointing)
        log.info("activation checkpointing on %s (%s)", type(model).__name__, how)


def shard_model(model: nn.Module, plan: Plan, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, *,
                device_type: str = "cpu", block_classes=None, block_predicate: BlockPredicate | None = None,
                blocks: list[nn.Module] | None = None) -> tuple[nn.Module, list[nn.Module]]:
    """Apply the plan's FSDP2 layout (stages 0, 2, 3 and offload) to `model` in place. Returns (model, the blocks
    sharded one by one). `blocks`: the transformer blocks found already (find_blocks), else found here."""
    if blocks is None:
        blocks = find_blocks(model, block_classes, block_predicate)
    checkpoint_activations(model, plan, blocks)
    shard_size = mesh.size(mesh.ndim - 1)
    raf = reshard_policy(plan, shard_size)
    offload = offload_policy(plan, device_type)
    threshold = plan.shard.param_persistence_threshold if plan.shard.stage == 3 else 0
    sharded = []
    for block in blocks:
        # DeepSpeed keeps params under stage3_param_persistence_threshold whole; the nearest FSDP2 unit is the
        # block: a small block joins the root group, which stays unsharded between forward and backward.
        if sum(p.numel() for p in block.parameters()) < threshold:
            continue
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=mp_policy, offload_policy=offload)
        sharded.append(block)
    # the root's parameters (head, final norm) are needed first in backward: FSDP2's default keeps them gathered
    fully_shard(model, mesh=mesh, reshard_after_forward=None if raf is not False else False,
                mp_policy=mp_policy, offload_policy=offload)
    # a parameter with a gradient on some ranks only (one rank's batch skips a module): FSDP2 reduce-scatters the
    # gradients each rank has, so the ranks would enter different reduce-scatters (a hang or an abort). Zeros for the
    # unused ones, as DeepSpeed's ignore_unused_parameters reduces a zero gradient: torch >= 2.13's switch, else
    # fsdp2_internals' zero fill before each unit's reduce-scatter
    if hasattr(model, "set_reduce_scatter_unused_params"):
        model.set_reduce_scatter_unused_params(True)
    else:
        for unit in [*sharded, model]:
            fsdp2_internals.zero_unused_grads(unit)
    if callable(getattr(model, "generate", None)):
        # generate may call submodules directly, outside the root's forward (an encoder-decoder runs its encoder
        # first): the root unit is gathered around the whole call, as around a forward
        register_fsdp_forward_method(model, "generate")
    set_prefetch(sharded, prefetch_depth(plan, sharded))
    return model, sharded


def prefetch_depth(plan: Plan, blocks: list[nn.Module]) -> int:
    """stage3_prefetch_bucket_size counts elements fetched ahead: as many blocks as fit in it (at least one, FSDP2's
    implicit lookahead); 0 when the plan turns prefetch off."""
    if plan.shard.prefetch_depth <= 0 or not blocks:
        return plan.shard.prefetch_depth
    per_block = max(1, max(sum(p.numel() for p in b.parameters()) for b in blocks))
    return max(plan.shard.prefetch_depth, min(len(blocks) - 1, plan.shard.prefetch_bucket_size // per_block))


def set_prefetch(blocks: list[nn.Module], depth: int) -> None:
    """depth 1 is FSDP2's implicit behaviour; deeper prefetch issues all-gathers `depth` blocks ahead."""
    if depth <= 1 or len(blocks) < 2:
        return
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
    rev = blocks[::-1]
    for i, block in enumerate(rev):
        block.set_modules_to_backward_prefetch(rev[i + 1:i + 1 + depth])


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def shard_home(plan: Plan, device: torch.device) -> torch.device:
    """Where the parameter shards live: the CPU with offload_param (FSDP2's CPUOffloadPolicy refuses shards
    materialised anywhere else), else the compute device."""
    return torch.device("cpu") if plan.offload.param_device in ("cpu", "nvme") else torch.device(device)


def materialize(model: nn.Module, device: torch.device, full_state_dict: dict | None = None,
                param_device: torch.device | None = None, filled_later: bool = False) -> None:
    """After sharding a meta-device model: allocate its shards (on param_device, default device; buffers always on
    device), rebuild non-persistent buffers (rotary inv_freq is not in any state dict, and `to_empty` leaves
    garbage there silently), then load weights if given (rank 0's full state dict, broadcast)."""
    stale = [(m, n) for m in model.modules() for n in getattr(m, "_non_persistent_buffers_set", ())
             if getattr(m, n, None) is not None and getattr(m, n).is_meta]
    param_device = torch.device(param_device or device)
    model.to_empty(device=param_device)
    if param_device != torch.device(device):
        for m in model.modules():
            for n, b in m._buffers.items():
                if b is not None:
                    m._buffers[n] = b.to(device)
    for m in {id(m): m for m, _ in stale}.values():
        names = [n for mm, n in stale if mm is m]
        if not hasattr(m, "config"):
            raise ValueError(f"{type(m).__name__} has non-persistent buffers {names} built on the meta device and "
                             "fsdpzero cannot rebuild them; build the model on CPU, or give the module a `config`")
        with torch.device(device):
            fresh = type(m)(m.config)
        for n in names:
            setattr(m, n, getattr(fresh, n).to(device))
    if full_state_dict is None:
        if not filled_later:   # filled_later: the caller writes each shard next (zero.Init, HfDeepSpeedConfig)
            log.warning("%s was built on the meta device and no full_state_dict was given: its "
                        "parameters are uninitialised memory until a checkpoint is loaded", type(model).__name__)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(model, full_state_dict,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


