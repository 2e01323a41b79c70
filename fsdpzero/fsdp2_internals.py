"""The one module of fsdpzero that touches FSDP2's private state (torch's _fully_shard internals: `_get_fsdp_state`,
`_fsdp_param_group`, `_sharded_param_data`, `_local_tensor`, ...). Everything else reads public API and calls these;
tests/project/test_layout.py fails if a private name appears anywhere else. It sits at the top of the package, not
in a wing, because the whole library shares it (today the offload wing and the parameter swapper call it; a tensor-
or sequence-parallel path would too). What is reached for, and why:

- after_reduce(module, fn): fn(event) after the unit's post-backward has issued its reduce-scatter; `event` (None
  on CPU or when nothing was reduced) completes when the sharded grads hold their values. The offload path starts
  each unit's D2H there, during backward, instead of all of them after backward.
- zero_unused_grads(module): on torch 2.11/2.12, zeros for a unit's params without a gradient on this rank before
  its reduce-scatter (what torch 2.13's set_reduce_scatter_unused_params does), so ranks reduce the same params.
- offloaded_grads(module): under CPUOffloadPolicy, the unit's CPU grads and FSDP2's `grad_offload_event`s (the
  offload path sums their squares during backward, fsdpzero.offload.device_step.CpuNormPrefetch).
- consumer_streams(module): the streams that read a unit's shards (compute and FSDP2's all-gather streams).
- param_groups(module): the unit's FSDP param groups on any torch 2.11-2.14; fsdp_params(module), their params.
- fsdp_units(model), fsdp_prefetch_depth(units), own_resizable_storages(units): what offload_param nvme's swapper
  (fsdpzero.offload.param_swapper) needs: the units in forward order, how far FSDP2 prefetches, shards it can
  resize_(0).
- lazy_init(model), forward_prefetch_modules(module): FSDP2 re-pads the shards at lazy init, so whoever keeps
  references to them runs it first; the units a unit's pre-forward explicitly prefetches.
- shard_data(fsdp_param), shard_local(fsdp_param): a param's padded CPU shard (whose storage is swapped to disk) and
  its unpadded local tensor.
- DroppableShards: a unit that keeps its params unsharded from forward to the end of backward (stage 2,
  reshard_after_forward=False) does not read its low-precision shards again before the next step, and the offload
  path keeps an exact copy of every shard in its pinned out buffer. So the device storage of those shards is freed
  after the unit's forward and allocated again when the step copies the new values in: 2 bytes/param of device
  memory less during forward and backward (DeepSpeed's stage 2 has no sharded copy next to the full params either).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from fsdpzero.dist import local_tensor


def param_group(module: nn.Module):
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    return getattr(state, "_fsdp_param_group", None) if state is not None else None


def param_groups(module: nn.Module) -> list:
    """All FSDP param groups of a unit: torch >= 2.13 keeps a list (_fsdp_param_groups), 2.11/2.12 one group."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    if state is None:
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def consumer_streams(module: nn.Module | None) -> list:
    """The compute stream and FSDP2's all-gather streams of the unit (its copy-in reads the shards on its own
    streams): whatever fills a unit's shards must be waited for on all of them."""
    state = module._get_fsdp_state() if module is not None and hasattr(module, "_get_fsdp_state") else None
    ctx = getattr(state, "_comm_ctx", None)
    return [torch.cuda.current_stream()] + [getattr(ctx, n) for n in (
        "all_gather_copy_in_stream", "all_gather_stream") if hasattr(ctx, n)]


def _post_backward_hooks(group) -> tuple[list, list]:
    """(before, after): callables run around the group's post-backward (after_reduce, zero_unused_grads).

    The one instance override of fsdpzero, installed once per group. It stands in for hooks FSDP2 does not offer:
    the public FSDPModule API (torch.distributed.fsdp.FSDPModule: set_post_optim_event,
    set_reduce_scatter_divide_factor, register_fsdp_forward_method, ...) has no callback around a unit's
    reduce-scatter; the nearest public hook, Tensor.register_post_accumulate_grad_hook, fires before FSDP2 reduces and
    never for a parameter without a gradient. FSDP2 calls FSDPParamGroup.post_backward through the instance (autograd
    node, final callback), so wrapping it there is seen by every call."""
    hooks = group.__dict__.get("_fsdpzero_post_backward_hooks")
    if hooks is None:
        hooks = ([], [])
        original = group.post_backward

        def post_backward(*args, **kwargs):
            for fn in hooks[0]:
                fn()
            out = original(*args, **kwargs)
            for fn in hooks[1]:
                fn()
            return out
        group.post_backward = post_backward
        group._fsdpzero_post_backward_hooks = hooks
    return hooks


def after_reduce(module: nn.Module, fn: Callable[[object], None]) -> bool:
    """Call fn(post-reduce event) after each post-backward of the unit that reduced its grads. False when the unit
    has no FSDP param group to hook (or this torch lacks the internals: the D2H then runs after backward)."""
    group = param_group(module)
    if group is None or not all(hasattr(group, a) for a in ("post_backward", "reduce_grads", "_post_reduce_event")):
        return False
    on_cuda = getattr(group, "device", torch.device("cpu")).type == "cuda"

    def after():
        event = getattr(group, "_post_reduce_event", None)
        if group.reduce_grads and (event is not None or not on_cuda):   # no event: nothing was reduced
            fn(event)
    _post_backward_hooks(group)[1].append(after)
    return True


def zero_unused_grads(module: nn.Module) -> bool:
    """torch 2.11/2.12 (no FSDPModule.set_reduce_scatter_unused_params): before each post-backward of the unit that
    reduces, a trainable param of the unit without a gradient on this rank gets a zero one, so every rank
    reduce-scatters the same params (FSDP2 reduces only the gradients a rank has: ranks would enter different
    reduce-scatters, a hang or an abort). torch 2.13's reduce_scatter_unused_params does the same with its cached
    zero buffer. False when the unit has no FSDP param group. A unit none of whose params ran on a rank is not
    covered (its post-backward never runs there), as with torch's own switch."""
    groups = [g for g in param_groups(module) if hasattr(g, "post_backward") and hasattr(g, "fsdp_params")]

    def zero_filler(group):
        def fill():
            if not getattr(group, "reduce_grads", True):   # an accumulation micro-step: nothing is reduced now
                return
            for fp in group.fsdp_params:
                if not hasattr(fp, "_unsharded_param"):
                    continue
                param = fp.unsharded_param
                if (param.requires_grad and param.grad is None
                        and getattr(fp, "unsharded_accumulated_grad", None) is None):
                    param.grad = torch.zeros_like(param)
        return fill
    for group in groups:
        _post_backward_hooks(group)[0].append(zero_filler(group))
    return bool(groups)


def offloaded_grads(module: nn.Module) -> list[tuple]:
    """Right after a unit's post-backward under CPUOffloadPolicy: (sharded param, its local CPU grad, the event its
    D2H completes or None) per param with a grad. FSDP2 copies non-blocking into pinned memory and waits on
    `grad_offload_event` only in finalize_backward; whoever reads the grad earlier waits on that event."""
    out = []
    for group in param_groups(module):
        for fp in getattr(group, "fsdp_params", ()):
            param = fp.sharded_param
            grad = local_tensor(param.grad) if param.grad is not None else None
            if grad is not None and grad.device.type == "cpu":
                out.append((param, grad, getattr(fp, "grad_offload_event", None)))
    return out


def keeps_unsharded(module: nn.Module) -> bool:
    """True for a unit that does not reshard after forward (its shards are not read during backward)."""
    group = param_group(module)
    try:
        return (group is not None and group.post_forward_mesh_info is None and len(group.fsdp_params) > 0
                and all(isinstance(fp._sharded_param_data, torch.Tensor) and not fp.offload_to_cpu
                        and fp.sharded_param._local_tensor.untyped_storage() is not None
                        for fp in group.fsdp_params))
    except AttributeError:   # another torch's internals: keep the shards
        return False


class DroppableShards:
    """The padded shard storages of one FSDP unit, freed and allocated again (their views stay valid)."""

    def __init__(self, module: nn.Module):
        self.group = param_group(module)
        self.shards = []   # (padded 1-D shard, its storage, bytes, valid elements), read at each drop
        self.dropped = False

    def needs_all_gather(self) -> bool:
        return not self.group.is_unsharded

    def drop(self) -> None:
        if not self.dropped:   # FSDP2 may re-create a shard (lazy init, .to()): take the live ones each time
            self.shards = [(fp._sharded_param_data, fp._sharded_param_data.untyped_storage(),
                            fp._sharded_param_data.untyped_storage().nbytes(), fp.sharded_param._local_tensor.numel())
                           for fp in self.group.fsdp_params]
            for _, storage, _, _ in self.shards:
                storage.resize_(0)
            self.dropped = True

    @torch.no_grad()
    def allocate(self) -> None:
        """Storage back (contents undefined but the padding, which is zeroed: the all-gather sends it)."""
        if self.dropped:
            for padded, storage, nbytes, valid in self.shards:
                storage.resize_(nbytes)
                if valid < padded.numel():
                    padded[valid:].zero_()
            self.dropped = False


@torch.no_grad()   # runs in a forward pre-hook, with grad mode on
def restore_from(entries, stream) -> torch.cuda.Event | None:
    """Copy each entry's out buffer (the exact current low-precision shard) into its device shard on `stream`."""
    ctx = torch.cuda.stream(stream) if stream is not None else None
    if ctx is not None:
        stream.wait_stream(torch.cuda.current_stream())   # the storage was just allocated on the current stream
        with ctx:
            for e in entries:
                e.param.to_local().copy_(e.out_buf, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done
    for e in entries:
        local_tensor(e.param).copy_(e.out_buf)
    return None


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The fully_shard-ed modules in forward order: the root first (its pre-forward runs first), then the others in
    module order."""
    from torch.distributed.fsdp import FSDPModule
    return [m for _, m in model.named_modules() if isinstance(m, FSDPModule)]


def fsdp_params(module: nn.Module) -> list:
    return [fp for g in param_groups(module) for fp in g.fsdp_params]


@torch.no_grad()
def own_resizable_storages(units: list[nn.Module]) -> None:
    """Give each shard a fresh, pageable storage that can be resized: FSDP2 pins shards with Tensor.pin_memory(),
    whose storages refuse resize_(); and a pinned storage freed by resize_(0) only goes back to torch's pinned
    cache (rounded up to a power of two), never to the OS, so eviction would save nothing. Both aliases FSDP2 keeps
    are re-pointed (the padded _sharded_param_data and the DTensor's _local_tensor): call this before anything
    else holds a view. FSDP2 is told the shards are unpinned (CPUOffloadPolicy(pin_memory=False) for them): its
    load_state_dict hook would otherwise re-pin _local_tensor into a copy, splitting the two aliases, and its
    gradient D2H then lands in exact-size pageable memory instead of power-of-two pinned blocks (synchronously)."""
    pinned = False
    for module in units:
        for fp in fsdp_params(module):
            old = fp._sharded_param_data.untyped_storage()
            pinned = pinned or fp._sharded_param_data.is_pinned()
            fresh = torch.empty(old.nbytes(), dtype=torch.uint8).untyped_storage()
            fresh.copy_(old)
            for t in (fp._sharded_param_data, fp.sharded_param._local_tensor):
                t.set_(fresh, t.storage_offset(), t.size(), t.stride())
            fp.pin_memory = False
    if pinned and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()      # FSDP2's pinned originals, now unused, back to the OS


def fsdp_prefetch_depth(units: list[nn.Module]) -> int:
    """How many units FSDP2 unshards ahead of the current one: the explicit prefetch lists set by
    fsdpzero.sharding.set_prefetch, else 1 (its implicit backward prefetch)."""
    states = [m._get_fsdp_state() for m in units]
    return max([1] + [len(getattr(s, a, ())) for s in states
                      for a in ("_states_to_forward_prefetch", "_states_to_backward_prefetch")])


def lazy_init(model: nn.Module) -> None:
    """FSDP2's lazy init of the root state now (it replaces the shards by padded ones)."""
    model._get_fsdp_state()._lazy_init()


def forward_prefetch_modules(module: nn.Module) -> list[nn.Module]:
    """The modules whose unshard this unit's pre-forward issues (set_modules_to_forward_prefetch)."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    return [s._modules[0] for s in getattr(state, "_states_to_forward_prefetch", [])]


def shard_data(fsdp_param) -> torch.Tensor:
    """The FSDPParam's padded local shard (the local DTensor is a view of the same storage)."""
    return fsdp_param._sharded_param_data


def shard_local(fsdp_param) -> torch.Tensor:
    """The FSDPParam's local shard as the model's DTensor parameter holds it (unpadded)."""
    return fsdp_param.sharded_param._local_tensor
