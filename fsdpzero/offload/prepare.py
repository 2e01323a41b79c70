"""The offload path's build, step by step: each function below is one named step of
fsdpzero.offload.path.OffloadGradPath.build (read that first), and the settings it hands the path. The steps take and
return plain values (the plan, the engine's knobs, the model's parameters, Entry objects); none keeps state.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdpzero.offload.chunks import CHUNK, Entry, chunk_layout
from fsdpzero.optim.factory import AdamSection, OptimizerFactory
from fsdpzero.plan import Plan
from fsdpzero.dist import local_tensor
from fsdpzero.log import count
from fsdpzero.precision import DTYPES
from fsdpzero.tuning import Tuning
from fsdpzero.host import place_cpu_step

log = logging.getLogger("fsdpzero")


@dataclass(frozen=True)
class Pipeline:
    """How the CPU step runs beside the device (the offload_* knobs, resolved against the plan by pipeline())."""
    threads: int                     # the CPU step's threads (cpu_step_threads)
    overlap: bool = False            # step in a worker thread while the next forward runs (offload_overlap)
    early_d2h: bool = True           # each unit's grads go D2H right after its reduce-scatter (offload_early_d2h)
    drop_shards: bool = False        # free stage-2 units' device shards between forward and step (drop_shards_default)
    norm_threads: int | None = None  # offload_param cpu: threads summing grad squares during backward (norm_threads)
    profile_file: str | None = None  # offload_profile: the timeline's output (None: no timeline)
    profile: bool = False


@dataclass(frozen=True)
class Speculation:
    """Stepping CPU chunks during backward (fsdpzero.offload.speculate), when the clip factor may turn out 1.0."""
    max_norm: float                  # gradient_clipping (speculate_max_norm)
    budget_bytes: int | None = None  # shadow memory (speculate_budget)
    threads: int | None = None       # offload_speculate_threads
    after_clip: bool = True          # speculate right after a clipped step too (the knob set on, or a rank alone)


@dataclass
class Masters:
    """What take_masters made: one Entry per trainable shard, in forward order, plus what the optimizer is built
    from: NVMe: master id -> the initial fp32 weights to write to disk; ratio < 1: device master -> its Adam state."""
    entries: list[Entry]
    initial: dict = field(default_factory=dict)
    device_states: dict = field(default_factory=dict)


def cpu_threads(local_world_size: int, override: int | None = None) -> int:
    """Threads for the CPU step: `override` (knob offload_threads), else this process's usable cores / local
    ranks."""
    if override is not None:
        return max(1, int(override))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def hyper_groups_of(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Adam-family hyperparameters of each group of the configured optimizer, for CPUAdam."""
    from fsdpzero_ops import CPUAdam   # a client's CPUAdam / CPUAdamW (DeepSpeedCPUAdam under the shim)
    from fsdpzero.optim import AdamNoBiasCorrection
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, AdamNoBiasCorrection)) and \
            not isinstance(optimizer, CPUAdam):
        raise NotImplementedError(
            f"offload_optimizer.device = cpu runs Adam/AdamW on the CPU; the configured optimizer is "
            f"{type(optimizer).__name__}. Use \"type\": \"AdamW\" (or \"Adam\"), or remove offload_optimizer")
    groups = []
    for g in optimizer.param_groups:
        if g.get("amsgrad"):
            raise NotImplementedError("optimizer.params.amsgrad = true is not supported with offload_optimizer; "
                                      "set it to false")
        adamw = bool(g.get("decoupled_weight_decay", g.get("adamw", isinstance(optimizer, torch.optim.AdamW))))
        groups.append(dict(params=list(g["params"]), lr=float(g["lr"]), betas=tuple(g["betas"]), eps=g["eps"],
                           weight_decay=g["weight_decay"], decoupled_weight_decay=adamw,
                           bias_correction=not isinstance(optimizer, AdamNoBiasCorrection)
                           and g.get("bias_correction", True)))
    return groups


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("offload: the model has no trainable parameters")
    return named


def adam_groups(make_optimizer: OptimizerFactory, params: list[torch.Tensor]) -> list[dict]:
    """The Adam hyper-parameters of each param group (params in model order), for the CPU/NVMe Adam: the config
    section's, read as they are (AdamSection.groups: no optimizer is built); a client's optimizer (an instance, or a
    callable called with the params) is asked for its param_groups (hyper_groups_of)."""
    if not isinstance(make_optimizer, AdamSection):
        return hyper_groups_of(make_optimizer(params))
    groups = []
    for g in make_optimizer.groups(params):
        if g.get("amsgrad"):
            raise NotImplementedError("optimizer.params.amsgrad = true is not supported with offload_optimizer; "
                                      "set it to false")
        groups.append(dict(params=g["params"], lr=float(g["lr"]), betas=tuple(g["betas"]), eps=g["eps"],
                           weight_decay=g["weight_decay"], decoupled_weight_decay=bool(g["decoupled_weight_decay"]),
                           bias_correction=bool(g["bias_correction"])))
    return groups


def forward_order(model: nn.Module, named: list) -> list[tuple[nn.Module | None, list[str]]]:
    """The FSDP units in forward order with their parameters' names (units_in_forward_order); `named` is sorted
    into that order in place, the order the chunks are stepped in."""
    units = units_in_forward_order(model, [n for n, _ in named])
    order = {n: i for i, n in enumerate(n for _, ns in units for n in ns)}
    named.sort(key=lambda np_: order[np_[0]])
    return units


def chunk_size(plan: Plan) -> int:
    """Elements per pipeline chunk: sub_group_size, at most CHUNK."""
    return max(1, min(int(plan.offload.sub_group_size), CHUNK))


def copy_buffers_pinned() -> bool:
    """Only the copy buffers take part in DMA: they are pinned whenever there is an accelerator (pageable H2D was
    measured 8x slower). Masters and states never leave the CPU and stay pageable, whatever pin_memory says;
    pin_memory matters for offload_param (FSDP2 CPUOffloadPolicy, see sharding.py)."""
    return torch.cuda.is_available()


def swaps_params(plan: Plan, units) -> bool:
    """offload_param nvme at stage 3 over FSDP units: the shards go to disk (swap_params_to_disk)."""
    return plan.offload.param_device == "nvme" and plan.shard.stage == 3 and units[0][0] is not None


def pipeline(plan: Plan, knobs: Tuning, *, threads: int, staged: bool, on_disk: bool, swap_params: bool,
             overlap: bool | None = None) -> Pipeline:
    """The knobs' pipeline settings for this plan; `overlap` (None: knob offload_overlap) is off when the
    parameters swap (one thread swaps)."""
    overlap = knobs.offload_overlap if overlap is None else overlap
    return Pipeline(threads=threads, overlap=overlap and not swap_params, early_d2h=knobs.offload_early_d2h,
                    drop_shards=not on_disk and drop_shards_default(plan, knobs.offload_drop_shards),
                    norm_threads=None if on_disk else norm_threads(plan, staged, threads),
                    profile=knobs.offload_profile, profile_file=knobs.offload_profile_file)


def speculation(plan: Plan, knobs: Tuning, entries: list[Entry], optimizer, *, no_speculation: bool) \
        -> Speculation | None:
    """Speculative stepping's settings, or None where it cannot run (speculate_max_norm)."""
    max_norm = speculate_max_norm(plan, entries, no_speculation, knobs.offload_speculate)
    if max_norm is None:
        return None
    # auto skips the backward after a clipped step only where ranks share the host's memory bandwidth: on one GPU a
    # clipped step with speculation was no slower (S9: 0.806 s against 0.826 without)
    alone = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) <= 1
    return Speculation(max_norm=max_norm, budget_bytes=speculate_budget(entries, knobs.offload_speculate, optimizer),
                       threads=knobs.offload_speculate_threads,
                       after_clip=knobs.offload_speculate is True or alone)


def log_built(path, plan: Plan, pinned: bool) -> None:
    spec = "off" if path.spec is None else (f"{len(path.spec.covered)} of {len(path.cpu_chunks)} chunks, "
                                            f"{path.spec.shadow_used_bytes / 2**30:.2f} GiB of shadows")
    log.info("offload: %d params, %s elements on this rank, %d chunks, %d CPU threads, staged=%s, pinned "
             "copy buffers=%s, overlap=%s, speculative step: %s, device-stepped chunks=%d (ratio %s)",
             len(path.entries), count(sum(e.master.numel() for e in path.entries)), len(path.chunks), path.threads,
             path.staged, pinned, path.overlap, spec, len(path.device_chunks), float(plan.offload.ratio))


def units_in_forward_order(model: nn.Module, names: list[str]) -> list[tuple[nn.Module | None, list[str]]]:
    """Parameter names grouped by the FSDP module that all-gathers them, in forward order (the root's own params
    first: embeddings are used first). One unit (None) when the model is not fully_shard-ed."""
    from torch.distributed.fsdp import FSDPModule
    prefixes = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not prefixes:
        return [(None, names)]
    owned: dict[str, list[str]] = {n: [] for n, _ in prefixes}
    for name in names:
        owner = max((n for n, _ in prefixes if n == "" or name.startswith(n + ".")), key=len)
        owned[owner].append(name)
    return [(m, owned[n]) for n, m in prefixes if owned[n]]


def nvme_stand_in(local, stage, on_accel, low, pin):
    """(tensor NVMeAdam updates, grad_buf, out_buf) for one shard under offload_optimizer nvme. Staged: the pinned
    out buffer. CPU shards cast to low precision below: a CPU buffer copied into the shard after each step (the
    cast replaces the shard). fp32 CPU shards: the shard itself, stepped in place (its own master, as with cpu)."""
    if stage:
        dtype = low if on_accel else local.dtype
        grad_buf = torch.empty(local.shape, dtype=dtype, pin_memory=pin)
        out_buf = torch.empty(local.shape, dtype=dtype, pin_memory=pin)
        if dtype == torch.float32:
            out_buf.copy_(local)
        return out_buf, grad_buf, out_buf
    final = low if low != torch.float32 else local.dtype
    if final == torch.float32:
        return local, None, None
    return torch.empty(local.shape, dtype=final), None, None


def device_stepped(units: list[list[tuple[str, int]]], chunk_size: int, ratio: float) -> set[str]:
    """offload_optimizer.ratio < 1: the names whose optimizer step stays on the device. The CPU keeps the last
    chunks in forward order, about `ratio` of the elements (a chunk goes to the CPU when its middle element falls in
    that fraction): the next forward needs them last, so the CPU has the most time for them when it overlaps.
    (DeepSpeed keeps the first int(ratio * n) sub-groups on the CPU; which ones does not change the result.)"""
    if ratio >= 1.0:
        return set()
    chunks = chunk_layout(units, chunk_size)
    numel = {n: k for unit in units for n, k in unit}
    sizes = [sum(numel[n] for n in c) for c in chunks]
    budget, seen, device = ratio * sum(sizes), 0, set()
    for names, size in zip(reversed(chunks), reversed(sizes)):
        if seen + size / 2 > budget:
            device.update(names)
        seen += size
    return device


def drop_shards_default(plan: Plan, override: bool | None = None) -> bool:
    """Free the device shards of stage-2 units between forward and the step (fsdp2_internals.DroppableShards): on
    with CUDA and no gradient accumulation (each extra micro-batch would copy them back H2D for its all-gather).
    `override` (knob offload_drop_shards, None = auto): False turns it off, True forces it on (also on CPU)."""
    if override is not None:
        return override
    return torch.cuda.is_available() and plan.batch.gradient_accumulation_steps == 1


def swap_params_to_disk(model: nn.Module, plan: Plan, entries: list[Entry], knobs: Tuning):
    """offload_param nvme: the CPU shards go to disk (fsdpzero.offload.param_swapper). A stand-in NVMeAdam steps
    becomes a view of its shard's storage, so it is swapped with the shard instead of being a second copy in
    memory."""
    from fsdpzero.offload.param_swapper import ParamSwapper
    from fsdpzero.fsdp2_internals import fsdp_units, lazy_init, own_resizable_storages
    lazy_init(model)                           # FSDP2 re-pads (replaces) the shards at lazy init: do it first
    own_resizable_storages(fsdp_units(model))  # resize_(0) evicts; FSDP2's pinned shards refuse it
    with torch.no_grad():
        for e in entries:
            local = local_tensor(e.param)
            if e.master is not local and e.master.dtype == local.dtype and e.grad_buf is None:
                e.master.set_(local)
    return ParamSwapper(fsdp_units(model), offload=plan.offload, tuning=knobs)


def check_plan(plan: Plan) -> bool:
    """Refuse what the offload path cannot run; True for NVMe (masters and moments on disk)."""
    if plan.offload.optimizer_device not in ("cpu", "nvme"):
        raise NotImplementedError(f"offload_optimizer.device = {plan.offload.optimizer_device!r}: only \"cpu\" and "
                                  "\"nvme\" are handled here")
    nvme = plan.offload.optimizer_device == "nvme"
    ratio = float(plan.offload.ratio)
    if ratio < 1.0 and (nvme or plan.offload.param_device != "none"):
        raise NotImplementedError(
            f"zero_optimization.offload_optimizer.ratio = {ratio} is supported with offload_optimizer.device = cpu "
            f"and the params on the accelerator; got offload_optimizer.device = {plan.offload.optimizer_device!r}, "
            f"offload_param.device = {plan.offload.param_device!r}. Set ratio to 1.0 or remove offload_param")
    return nvme


def cpu_step_threads(knobs: Tuning) -> int:
    """The CPU step's threads and this rank's cores (fsdpzero/host.py, knobs offload_threads and offload_bind): with a
    GPU, a slice of whole cores of its own per local rank and one thread per CPU of it; on a CPU-only run only what a
    knob asks (the user's OMP setting otherwise stands). Collective where a process group exists."""
    place_cpu_step(knobs)
    return torch.get_num_threads()


def device_stepped_names(named, units, chunk: int, ratio: float, hyper: list[dict]) -> set[str]:
    """offload_optimizer.ratio < 1: the parameters stepped on the device, with torch's Adam."""
    local_numel = {n: local_tensor(p).numel() for n, p in named}
    on_device = device_stepped([[(n, local_numel[n]) for n in ns] for _, ns in units], chunk, ratio)
    if on_device and any(not g["bias_correction"] for g in hyper):
        raise NotImplementedError("zero_optimization.offload_optimizer.ratio < 1 steps part of the model with "
                                  "torch's Adam, which always applies bias correction; set "
                                  "optimizer.params.bias_correction to true or ratio to 1.0")
    return on_device


@torch.no_grad()
def take_masters(named, on_device: set[str], nvme: bool, stage: bool, on_accel: bool, low: torch.dtype,
                 pin: bool) -> Masters:
    """Each local shard's Entry: its fp32 master (CPU, or on the device for a device-stepped one) and its pinned
    grad and out copy buffers when staged (Masters). Before any cast: the masters are taken from the fp32
    weights."""
    entries, initial, device_states = [], {}, {}
    for name, p in named:
        local = local_tensor(p)
        if nvme:   # NVMeAdam steps a CPU tensor with the param's final dtype; its fp32 master goes to disk
            master, grad_buf, out_buf = nvme_stand_in(local, stage, on_accel, low, pin)
            initial[id(master)] = local
            entries.append(Entry(name, p, master, grad_buf, out_buf))
            continue
        if name in on_device:   # ratio < 1: an fp32 master and its states next to the param, stepped there
            master = local.detach().to(torch.float32, copy=True)
            device_states[master] = {"step": torch.zeros((), dtype=torch.float32, device=master.device
                                                         if master.device.type == "cuda" else "cpu"),
                                     "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
            entries.append(Entry(name, p, master, None, None, on_device=True))
            continue
        if stage or local.dtype != torch.float32:   # a separate fp32 master, taken before any cast below
            master = local.detach().to("cpu", torch.float32, copy=True)
        else:
            master = local                          # fp32 CPU shard: stepped in place
        grad_buf = out_buf = None
        if stage:
            dtype = low if on_accel else local.dtype
            grad_buf = torch.empty(local.shape, dtype=dtype, pin_memory=pin)
            out_buf = torch.empty(local.shape, dtype=dtype, pin_memory=pin)
        entries.append(Entry(name, p, master, grad_buf, out_buf))
    return Masters(entries, initial, device_states)


@torch.no_grad()
def cast_shards(model: nn.Module, entries: list[Entry], low: torch.dtype) -> None:
    """The device (or CPU-offloaded) shards become low precision; only the parameters: rotary inv_freq & co. keep
    their dtype, as with every other path, FSDP2 and DeepSpeed."""
    buffers = [(m, n, b) for m in model.modules() for n, b in m.named_buffers(recurse=False)
               if b is not None and b.is_floating_point()]
    model.to(low)   # FSDP2 re-registers the shards
    for module, name, buffer in buffers:
        setattr(module, name, buffer)
    now = dict(model.named_parameters())
    for e in entries:
        e.param = now[e.name]   # .to() may replace the Parameter objects


def norm_threads(plan: Plan, staged: bool, threads: int) -> int | None:
    """offload_param cpu: threads that sum the grads' squares during backward (device_step.CpuNormPrefetch), as many
    as the speculative step would take (backward keeps the rest); None elsewhere (staged grads are normed on the
    device; Muon's norm is of the orthogonalized updates, which exist only after backward)."""
    if staged or plan.offload.param_device != "cpu" or DTYPES[plan.precision.param_dtype] == torch.float32:
        return None   # fp32 grads are normed by torch's foreach norm (global_grad_norm), not by these sums
    if plan.optimizer.type == "muon":
        return None
    from fsdpzero.offload.speculate import default_spec_threads
    return default_spec_threads(threads)


def speculate_max_norm(plan: Plan, entries, nvme: bool, enabled: bool | None) -> float | None:
    """gradient_clipping when the CPU step may run speculatively during backward (fsdpzero.offload.speculate),
    else None: not with fp16 loss scaling (the grad factor is never 1.0), not with NVMe (the optimizer states and,
    with offload_param nvme, the shards' residency belong to the swappers). The shadows' size: speculate_budget."""
    staged = [e for e in entries if e.grad_buf is not None and not e.on_device]
    if not ((enabled is None or enabled) and staged and plan.precision.loss_scale is None and not nvme):
        return None
    return float(plan.batch.gradient_clipping)


# auto (knob offload_speculate unset): shadows for this fraction of the CPU-stepped bytes. Backward is shorter than
# the CPU step wherever offload is the bottleneck, so the CPU reaches only part of the chunks before the step (about
# 30% measured at 0.89 B on one H100, BENCHMARKS.md S9); more shadow memory would sit idle.
AUTO_SHADOW_FRACTION = 0.4


def speculate_budget(entries, knob: bool | None, optimizer) -> int:
    from fsdpzero.offload import speculate as offload_speculate
    staged = [e for e in entries if e.grad_buf is not None and not e.on_device]
    # the Adam moments (8 bytes/param) are created at the first step: count them as taken already
    pending = sum(8 * e.master.numel() for e in staged if not optimizer.state.get(e.master))
    budget = offload_speculate.shadow_budget(staged, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), pending)
    if knob is None:
        budget = min(budget, int(offload_speculate.shadow_bytes(staged) * AUTO_SHADOW_FRACTION))
    return budget
