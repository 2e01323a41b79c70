"""`deepspeed.zero` on FSDP2: `Init` builds a model with each rank keeping only its rows of every parameter, and
`GatheredParameters` gives the full values of sharded parameters for reading, or for an edit that one rank makes
and every shard receives. `import fsdpzero as deepspeed` makes `deepspeed.zero.Init()` this module's.

How `Init` builds (DeepSpeed's design, one module at a time): each module is constructed for real, so it consumes
the random generator exactly as a plain construction does; as soon as it is registered in its parent (or at the
context's exit, for the top module), rank 0's values are broadcast and each rank keeps its rows of dim 0 (the rows
FSDP2 will give it: ceil(n / world) per rank), the parameter itself becoming a placeholder that keeps its shape but
no storage. Initialisation a parent runs afterwards on its children (`Module.apply`, transformers' `post_init`)
sees the full values, one module at a time. `initialize`/`wrap` then shards the model per the config and writes
each rank's rows into its FSDP2 shard: peak host memory is one module in full plus 1/N of the model. Why not build
on the meta device and initialise at `initialize`: the weights would not be those of a plain construction with the
same seed (the random draws of constructors and of `post_init` could not be replayed in order), and a model built
under `zero.Init` must be the model the script asked for.

Limits (docs/inference.md): a parameter is held as soon as its module is registered, so writing to a child's weight
from the parent's `__init__` outside `apply`/`post_init` fails loudly ("more than one element of the written-to
tensor refers to a single memory location"): wrap the edit in `GatheredParameters(..., modifier_rank=0)`. Before
`initialize` the model does not compute (placeholders read as NaN). Parameters are never cast (`dtype` and the
config's precision apply at `initialize`: fp32 masters, bf16/fp16 compute).
"""
from __future__ import annotations

import gc
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fsdpzero.dist import clean_fqn, local_tensor

HELD = "fsdpzero_held"                  # attribute of a parameter built under Init: its Held rows
DEFERRED = "fsdpzero_deferred_weights"  # attribute of a model whose weights come after sharding: prepare(model)


@dataclass
class Held:
    """This rank's rows of a parameter built under Init: rows [rank*per, (rank+1)*per) of dim 0 (fewer, or none,
    at the end), or the whole tensor for a 0-dim one (per = 0)."""
    rows: torch.Tensor
    shape: torch.Size
    per: int
    world: int


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _placeholder(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The shape without the storage: one element, expanded. Reads give NaN (a forward before initialize shows it);
    an in-place write fails loudly instead of silently initialising nothing."""
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((1,) if len(shape) else (), fill, dtype=dtype).expand(shape)


def is_held(p: torch.Tensor) -> bool:
    return getattr(p, HELD, None) is not None


@torch.no_grad()
def hold(p: nn.Parameter) -> None:
    """Keep this rank's rows of p (rank 0's values, as DeepSpeed's Init broadcasts) and free the rest."""
    if is_held(p) or p.is_meta or type(p.data) is not torch.Tensor:   # meta, DTensor: not ours to hold
        return
    rank, world = _rank_world()
    full = p.data.contiguous()
    if world > 1:
        dist.broadcast(full, 0)
    if full.dim() == 0:
        rows, per = full.clone(), 0
    else:
        per = math.ceil(full.shape[0] / world)
        rows = full[rank * per:(rank + 1) * per].clone()
    setattr(p, HELD, Held(rows, full.shape, per, world))
    p.data = _placeholder(full.shape, full.dtype)


@torch.no_grad()
def gather_held(h: Held) -> torch.Tensor:
    """The full tensor from every rank's rows (collective when the world is larger than one)."""
    if h.per == 0 or h.world == 1:
        return h.rows.clone()
    padded = h.rows.new_zeros((h.per,) + tuple(h.shape[1:]))
    padded[:h.rows.shape[0]] = h.rows
    parts = [torch.empty_like(padded) for _ in range(h.world)]
    dist.all_gather(parts, padded)
    return torch.cat(parts)[:h.shape[0]]


def _rehold(p: nn.Parameter, full: torch.Tensor) -> None:
    """p was gathered (p.data full): keep its rows of `full` again."""
    h = getattr(p, HELD)
    rank = dist.get_rank() if dist.is_initialized() else 0
    h.rows = full.clone() if h.per == 0 else full[rank * h.per:(rank + 1) * h.per].clone()
    p.data = _placeholder(h.shape, full.dtype)


def _unhold_all(module: nn.Module, recurse: bool = False, gathered: list[nn.Parameter] = ()) -> list[nn.Parameter]:
    """Gather the held direct (or all) parameters of module (p.data full), except those already `gathered`;
    returns them, for _rehold_all."""
    done = {id(p) for p in gathered}
    params = [p for p in module.parameters(recurse=recurse) if is_held(p) and id(p) not in done]
    for p in params:
        p.data = gather_held(getattr(p, HELD))
    return params


@torch.no_grad()
def _rehold_all(params: list[nn.Parameter]) -> None:
    _, world = _rank_world()
    for p in params:
        full = p.data.contiguous()
        if world > 1:
            dist.broadcast(full, 0)
        _rehold(p, full)


def _gathered_call(fn: Callable, module: nn.Module, *args: Any) -> Any:
    """fn(module, ...) with module's own held parameters full; afterwards rank 0's values are held again.
    Some models' init writes a child's parameter from the parent (GPT-2's `c_proj.weight`, T5's attention): the
    write into a held (one-element) parameter fails before drawing any random number, and the call is repeated
    with the module's whole subtree gathered, so the weights still equal a plain build's."""
    params = _unhold_all(module)
    try:
        return fn(module, *args)
    except RuntimeError as e:
        if "refers to a single memory location" not in str(e):
            raise
        deeper = _unhold_all(module, recurse=True, gathered=params)
        try:
            return fn(module, *args)
        finally:
            _rehold_all(deeper)
    finally:
        _rehold_all(params)


# -- Init ------------------------------------------------------------------------------------------------------

_depth = 0
_state: dict[str, Any] = {}


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement): the initialisation entry points a parent runs on children already held,
    wrapped to gather them one module at a time. Module.apply (torch); transformers' per-module init (post_init's
    smart_apply calls _initialize_weights directly, not through apply) when transformers is loaded."""
    import sys
    orig_apply = nn.Module.apply

    def apply(self, fn):
        if getattr(fn, "fsdpzero_gathers", False):
            return orig_apply(self, fn)
        gathering = lambda m: _gathered_call(fn, m)  # noqa: E731
        gathering.fsdpzero_gathers = True
        return orig_apply(self, gathering)

    out = [(nn.Module, "apply", apply)]
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    orig_init = getattr(pretrained, "_initialize_weights", None)
    if orig_init is not None:
        def initialize_weights(self, module, *args, **kwargs):
            return _gathered_call(lambda m: orig_init(self, m, *args, **kwargs), module)
        out.append((pretrained, "_initialize_weights", initialize_weights))
    return out


def _begin_init() -> None:
    from torch.nn.modules import module as torch_module
    touched: list[weakref.ref] = []

    def on_child(parent, name, child):   # a registered child is fully built: hold its tree
        if child is not None:
            for p in child.parameters():
                hold(p)

    def on_param(module, name, param):   # remember modules with direct parameters (the top one is held at exit)
        touched.append(weakref.ref(module))

    _state["touched"] = touched
    _state["hooks"] = [torch_module.register_module_module_registration_hook(on_child),
                       torch_module.register_module_parameter_registration_hook(on_param)]
    _state["patched"] = []
    for owner, attr, new in _patches():
        _state["patched"].append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, new)


def _end_init(hold_rest: bool) -> None:
    for h in _state.pop("hooks", []):
        h.remove()
    for owner, attr, old in _state.pop("patched", []):
        setattr(owner, attr, old)
    touched = _state.pop("touched", [])
    if hold_rest:
        seen: set[int] = set()
        for ref in touched:
            module = ref()
            if module is None or id(module) in seen:
                continue
            seen.add(id(module))
            for p in module.parameters(recurse=False):
                hold(p)


class Init:
    """`deepspeed.zero.Init`: models built inside are held sharded (see the module docstring) and `initialize`
    shards them per the config. DeepSpeed's arguments are accepted; those that choose devices, precision or
    kernels are no-ops here (the config decides them at initialize), and those naming model-parallel or quantised
    layouts are refused. `Init(module=model)` holds an already built model's parameters now."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None,
                 zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None, tensor_overrides=None):
        self.enabled = enabled
        refused = {"mpu": mpu, "zero_param_parallel_group": zero_param_parallel_group,
                   "sequence_data_parallel_group": sequence_data_parallel_group, "param_swapper": param_swapper,
                   "zero_quantized_weights": zero_quantized_weights or None,
                   "zero_quantized_nontrainable_weights": zero_quantized_nontrainable_weights or None}
        for name, value in refused.items():
            if value is not None:
                raise ValueError(f"zero.Init({name}={value!r}): not supported by fsdpzero (parameters are sharded "
                                 "over all ranks, unquantised); remove the argument")
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): use None, 'cpu' or 'nvme' (held rows "
                             "stay in host memory until initialize places them per the config)")
        if not enabled:
            return
        from fsdpzero.dist import init_distributed
        init_distributed()   # as DeepSpeed's Init: join the launcher's process group if none exists
        if data_parallel_group is not None and dist.get_world_size(data_parallel_group) != dist.get_world_size():
            raise ValueError("zero.Init(data_parallel_group=...): fsdpzero shards over all ranks; pass None")
        if module is not None:
            for p in module.parameters():
                hold(p)

    def __enter__(self):
        global _depth
        if self.enabled:
            if _depth == 0:
                _begin_init()
            _depth += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        global _depth
        if self.enabled:
            _depth -= 1
            if _depth == 0:
                _end_init(hold_rest=exc_type is None)   # after an error no collective: ranks may disagree
        return False


# -- deferred weights: wrap() fills a model built without its values once it is sharded ----------------------------

def defer_weights(model: nn.Module, prepare: Callable[[nn.Module], Callable[[nn.Module], None]]) -> None:
    """Mark a model whose weights come after sharding: `prepare(model)` runs before sharding (with the model on the
    meta device when it returns) and gives `fill(model)`, run once the shards exist (fsdpzero.hf's sharded
    from_pretrained uses it; zero.Init's models need no mark)."""
    model.__dict__[DEFERRED] = prepare


def take_deferred(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """For wrap(): None for an ordinary model; else fill(model), to call after sharding and materialising (the
    model is left on the meta device for the sharding, its values kept aside)."""
    prepare = model.__dict__.pop(DEFERRED, None)
    if prepare is not None:
        return prepare(model)
    if any(is_held(p) for p in model.parameters()):
        return _prepare_held(model)
    return None


def _prepare_held(model: nn.Module) -> Callable[[nn.Module], None]:
    """Held rows and every other real tensor by name; the parameters become meta (ties kept: one new parameter per
    old one), so wrap shards the model as a meta-device build."""
    held: dict[str, Held] = {}
    kept: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if is_held(p):
            held[clean_fqn(name)] = getattr(p, HELD)
        elif not p.is_meta:
            kept[clean_fqn(name)] = p.detach()
    buffers = {clean_fqn(n): b.detach() for n, b in model.named_buffers() if not b.is_meta}
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.is_meta:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                           requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]

    @torch.no_grad()
    def fill(sharded: nn.Module) -> None:
        for name, p in sharded.named_parameters():
            key = clean_fqn(name)
            if key in held:
                write_full(p, held=held[key])
            elif key in kept:
                write_full(p, full=kept[key])
            else:
                raise KeyError(f"zero.Init: parameter {key!r} appeared after the model was built; build it inside "
                               "the context too")
        for name, b in sharded.named_buffers():
            if clean_fqn(name) in buffers:
                b.copy_(buffers[clean_fqn(name)])

    return fill


def write_full(p: torch.Tensor, *, full: torch.Tensor | None = None, held: Held | None = None) -> None:
    """Write a full value (given, or gathered from held rows) into p's local part: a DTensor's shard, or a plain
    tensor whole. Collective when held rows must be gathered."""
    from torch.distributed.tensor import DTensor, Shard
    local = local_tensor(p)
    if isinstance(p, DTensor):
        mesh, placements = p.device_mesh, tuple(p.placements)
        if held is not None and held.per and mesh.ndim == 1 and mesh.size() == held.world \
                and placements == (Shard(0),):
            # FSDP2's Shard(0) gives rank r rows [r*ceil(n/W), ...): the rows this rank holds
            local.copy_(held.rows.to(local.dtype))
            return
        if full is None:
            full = gather_held(held)
        from torch.distributed.tensor import distribute_tensor
        part = distribute_tensor(full.to(local.device), mesh, placements, src_data_rank=None).to_local()
        local.copy_(part.to(local.dtype))
        return
    local.copy_((gather_held(held) if full is None else full).to(local.dtype))


# -- GatheredParameters ----------------------------------------------------------------------------------------

_owner_index: dict[int, list[tuple[weakref.ref, str]]] = {}
_fsdp_units: list[weakref.ref] = []


def _index_modules() -> None:
    """Parameter id -> the (module, attribute) pairs that hold it, over every live module, and the live FSDP2 units
    (one pass over the garbage collector's objects; a parameter carries no link to its module)."""
    from torch.distributed.fsdp import FSDPModule
    _owner_index.clear()
    _fsdp_units.clear()
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__ through the object's own __getattribute__, and
        # some objects answer with a side effect (torch.distributed.reduce_op warns "deprecated" on every rank)
        if not issubclass(type(obj), nn.Module):
            continue
        if issubclass(type(obj), FSDPModule):
            _fsdp_units.append(weakref.ref(obj))
        for name, p in obj._parameters.items():
            if p is not None:
                _owner_index.setdefault(id(p), []).append((weakref.ref(obj), name))


def reshard_holders(holders: list[tuple[nn.Module, str]]) -> None:
    """Reshard the FSDP2 units around these modules: a unit that keeps its parameters gathered after forward (the
    root at stage 3, every unit at stage 2) has its full, unsharded copies registered until then, and an edit of
    those would not reach the shards (FSDP2's public FSDPModule.reshard; the next forward gathers again)."""
    if not _fsdp_units:
        return
    wanted = {id(m) for m, _ in holders}
    for ref in list(_fsdp_units):
        unit = ref()
        if unit is not None and any(id(m) in wanted for m in unit.modules()):
            unit.reshard()


def owners(p: torch.Tensor) -> list[tuple[nn.Module, str]]:
    """The live modules (and attribute names) that hold parameter p; tied parameters have several."""
    def look():
        out = [(ref(), name) for ref, name in _owner_index.get(id(p), ())]
        return [(m, n) for m, n in out if m is not None and m._parameters.get(n) is p]
    found = look()
    if not found:
        _index_modules()
        found = look()
    return found


_active: set[int] = set()   # ids of the parameters an open GatheredParameters has gathered


class GatheredParameters:
    """`deepspeed.zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)`.

    Inside the context the parameters hold their full values: zero.Init's held parameters in place; FSDP2 shards
    (DTensors) by registering a full copy in each module that holds the parameter, so read and edit them through
    the module (`module.weight`; a reference taken before the context still names the shard). Parameters that are
    not sharded are left as they are. On exit with modifier_rank set, that rank's values are broadcast and written
    into every rank's shard (and into unsharded parameters, which would otherwise differ between ranks); with
    modifier_rank None the gathered copies are dropped. Collective: every rank enters with the same parameters."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        if fwd_module is not None:
            raise NotImplementedError(
                "GatheredParameters(fwd_module=...): a parameter used in another module's forward is not gathered "
                "for autograd under FSDP2; put the modules in one FSDP unit (block_classes=...) instead")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is None:
            params = []
        seen, self.params = set(), []
        for p in params:
            if isinstance(p, torch.Tensor) and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.modifier_rank = modifier_rank
        self._swapped: list[tuple[torch.Tensor, list[tuple[nn.Module, str]], nn.Parameter]] = []
        self._resharded: dict[int, torch.Tensor] = {}   # id(given) -> the shard FSDP2 registered instead of it

    def __enter__(self):
        if not self.enabled:
            return None
        again = [p for p in self.params if id(p) in _active]
        if again:
            raise RuntimeError(f"GatheredParameters: {len(again)} parameter(s) are already gathered by an enclosing "
                               "GatheredParameters; nested contexts cannot overlap")
        try:
            self._gather()
        except BaseException:
            self._restore()                          # no write-back: a rank that failed here sends nothing
            raise
        return None

    @torch.no_grad()
    def _gather(self) -> None:
        """Full values in place of each parameter (see the class docstring)."""
        from torch.distributed.tensor import DTensor
        for p in self.params:
            _active.add(id(p))
            if is_held(p):
                p.data = gather_held(getattr(p, HELD))
                continue
            holders = owners(p)
            for module, _ in holders:   # an overlapped offload step may still be writing it: parameters() waits
                module.parameters()     # (fsdpzero/offload/access.py guards it); a no-op everywhere else
            if holders:   # an FSDP2 unit may hold its gathered copy now: back to the shards first
                reshard_holders(holders)
                module, name = holders[0]
                shard = module._parameters[name]
                if shard is not p:
                    self._resharded[id(p)] = shard
                p = shard
            if isinstance(p, DTensor):
                if not holders:
                    raise RuntimeError("GatheredParameters: a sharded parameter (DTensor) that no live module "
                                       "holds; gather it through the model (e.g. model.lm_head.weight)")
                full = p.full_tensor()
                if full.untyped_storage().data_ptr() == local_tensor(p).untyped_storage().data_ptr():
                    full = full.clone()   # a group of one returns the shard itself: edits stay on the copy
                full = nn.Parameter(full, requires_grad=p.requires_grad)
                for module, name in holders:
                    module._parameters[name] = full
                self._swapped.append((p, holders, full))

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        try:
            if exc_type is None:
                self._write_back()
        finally:
            self._restore()
        return False

    def _restore(self) -> None:
        for p, holders, _ in self._swapped:       # the shards are the parameters again
            for module, name in holders:
                module._parameters[name] = p
        self._swapped = []
        for p in self.params:
            if is_held(p):
                p.data = _placeholder(getattr(p, HELD).shape, p.dtype)
            _active.discard(id(p))

    @torch.no_grad()
    def _write_back(self) -> None:
        src = self.modifier_rank
        world = dist.get_world_size() if dist.is_initialized() else 1
        swapped = {id(p): (holders, full) for p, holders, full in self._swapped}
        for p in self.params:
            p = self._resharded.get(id(p), p)
            if id(p) in swapped:
                holders, full = swapped[id(p)]
                module, name = holders[0]
                value = module._parameters[name]     # the user may have assigned a new Parameter
                value = (value if value is not None else full).detach()
            else:
                value = p.data
            if src is None:
                continue                             # the gathered copies are dropped (finally, in __exit__)
            value = value.contiguous()
            if world > 1:
                dist.broadcast(value, src)
            if is_held(p):
                _rehold(p, value)
            elif id(p) in swapped:
                write_full(p, full=value)
            elif value.data_ptr() != p.data.data_ptr():
                p.data.copy_(value)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """`deepspeed.zero.register_external_parameter`: not needed for parameters used inside their own FSDP unit;
    one used by another unit's forward is not gathered there, as with GatheredParameters(fwd_module=...)."""
    raise NotImplementedError("zero.register_external_parameter: under FSDP2 put the modules that share a "
                              "parameter in one unit (block_classes=... / block_predicate=...) instead")


__all__ = ["Init", "GatheredParameters", "register_external_parameter", "defer_weights", "take_deferred",
           "write_full", "owners", "is_held", "hold", "gather_held", "Held"]
