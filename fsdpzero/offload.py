"""ZeRO-Offload on FSDP2: `offload_optimizer.device: cpu` (stages 1-3) and, with it, `offload_param.device: cpu`.

The gradient path for the engine (contract: fsdpzero.optim.GradPath). The model arrives fully_shard-ed; this module
keeps, for every local shard, an fp32 master and the Adam states in CPU memory and steps them with the
fused CPU Adam of ops/cpu_adam.cpp, which reads the low-precision gradient and writes the low-precision param in
the same pass. The device keeps only low-precision shards (`model.to(param_dtype)` after the masters are taken).

One optimizer step, with params on an accelerator:
    finish_gradients  D2H of every sharded grad on a side stream, one event per chunk (a chunk: one FSDP unit's
                      params, <= sub_group_size and <= CHUNK elements; units in forward order, root first)
    grad_norm         from the device grads (global, collective) while the copies run
    scale_grads_      nothing is touched: 1/loss_scale and the clip coefficient are folded into the kernel's read
    step              for each chunk: wait its D2H, CPU step into pinned low-precision buffers, queue the H2D on a
                      second side stream, so the copy of chunk k overlaps the step of chunk k+1
Clipping and fp16 overflow: the norm is taken on the device from the reduced shards *before* any CPU step, so a
skipped step (inf/nan) never touches the masters and clipping is exact; the cost is that the CPU step cannot start
until backward has finished (no speculative stepping).

With `offload_param: cpu` (stage 3, FSDP2 CPUOffloadPolicy, set by sharding.shard_model) the shards and their grads
already live on the CPU: nothing is copied, the kernel reads the CPU grad and writes the param shard in place. The
shards are cast to the low-precision dtype, so FSDP2's per-all-gather H2D carries 2 bytes/param instead of 4.

FSDPZERO_OFFLOAD_OVERLAP=1: step() returns at once and a worker thread steps the chunks while the next forward
runs; a pre-forward hook on each FSDP unit waits for that unit's chunks (see OffloadGradPath).

Threads: torchrun sets OMP_NUM_THREADS=1, which makes the CPU step ~6x slower. With an accelerator the CPU step gets
usable cores / local ranks threads (FSDPZERO_OFFLOAD_THREADS overrides); FSDPZERO_OFFLOAD_BIND=1 also pins each
local rank to its own slice of cores.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdpzero.optim import OptimizerFactory, global_grad_norm
from fsdpzero.plan import Plan

log = logging.getLogger("fsdpzero")

CHUNK = 1 << 24     # elements per pipeline chunk (64 MiB of fp32 master): small enough to overlap, large to thread
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class _Entry:
    name: str
    param: nn.Parameter            # the model's (sharded) parameter
    master: torch.Tensor           # fp32 CPU; the param's own local shard when it is fp32 and on the CPU
    grad_buf: torch.Tensor | None  # pinned CPU landing buffer for the grad (None: read the CPU grad directly)
    out_buf: torch.Tensor | None   # pinned CPU low-precision param written by the kernel, then copied H2D


@dataclass
class _Chunk:
    entries: list[_Entry] = field(default_factory=list)
    numel: int = 0
    d2h_done: object = None        # CUDA event: this chunk's grads have landed in their pinned buffers
    h2d_done: object = None        # CUDA event: this chunk's updated params have been copied back
    ready: threading.Event = field(default_factory=threading.Event)   # CPU side: stepped (and H2D queued)

    def __post_init__(self):
        self.ready.set()


def cpu_threads(local_world_size: int) -> int:
    """Threads for the CPU step: FSDPZERO_OFFLOAD_THREADS, else this process's usable cores / local ranks."""
    if os.environ.get("FSDPZERO_OFFLOAD_THREADS"):
        return max(1, int(os.environ["FSDPZERO_OFFLOAD_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def bind_cores(local_rank: int, local_world_size: int) -> None:
    """Pin this rank to its own contiguous slice of the usable cores (DeepSpeed's --bind_cores_to_rank)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // max(1, local_world_size))
    mine = cores[local_rank * per:(local_rank + 1) * per] or cores
    os.sched_setaffinity(0, mine)


class OffloadGradPath:
    """fsdpzero.optim.GradPath with fp32 masters and Adam states on the CPU (see the module docstring).

    `units` are the FSDP modules in forward order (root first), each with its entries; chunks never span two units.
    With `overlap`, step() hands the chunk loop to a worker thread and returns: a forward pre-hook on each unit
    waits for that unit's chunks (and those of the units it prefetches), so the next forward starts as soon as
    its first parameters are updated while the CPU steps the rest."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, units: list[tuple[nn.Module | None,
                 list[_Entry]]], chunk_size: int, *, threads: int, overlap: bool = False):
        self.model = model
        self.optimizer = optimizer          # a CPUAdam over the masters: schedulers drive its param_groups
        self.entries = [e for _, es in units for e in es]
        self._by_master = {id(e.master): e for e in self.entries}
        self._factor = 1.0
        self._hyper: dict[int, dict] = {}   # per master: the group's hyperparameters when step() was called
        self.threads = threads
        self.staged = any(e.grad_buf is not None for e in self.entries)
        cuda = self.staged and self.entries[0].param.device.type == "cuda"
        self.d2h = torch.cuda.Stream() if cuda else None
        self.h2d = torch.cuda.Stream() if cuda else None
        self.chunks: list[_Chunk] = []
        unit_chunks = []
        for _, entries in units:
            first = len(self.chunks)
            for e in entries:
                if len(self.chunks) == first or self.chunks[-1].numel + e.master.numel() > chunk_size:
                    self.chunks.append(_Chunk())
                self.chunks[-1].entries.append(e)
                self.chunks[-1].numel += e.master.numel()
            unit_chunks.append(self.chunks[first:])
        # loading model weights (e.g. a module-only checkpoint) must reach the masters, or the next step would
        # write the old weights back; a following load_state_dict of the optimizer then restores exact fp32 masters
        model.register_load_state_dict_post_hook(lambda *_: self.refresh_masters())
        self.overlap = overlap and all(m is not None for m, _ in units)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        if self.overlap:
            model.register_state_dict_pre_hook(lambda *_: self.wait())   # saving reads the updated weights
            index = {id(m): i for i, (m, _) in enumerate(units)}
            for i, (module, _) in enumerate(units):
                # explicit forward prefetch (set_modules_to_forward_prefetch) unshards later units from this
                # unit's pre-forward: their chunks must be ready too
                ahead = [index[id(s._modules[0])] for s in getattr(module._get_fsdp_state(),
                                                                   "_states_to_forward_prefetch", [])
                         if id(s._modules[0]) in index]
                waits = [c for j in [i, *ahead] for c in unit_chunks[j]]
                module.register_forward_pre_hook(self._make_wait_hook(module, waits), prepend=True)

    def _make_wait_hook(self, module, chunks):
        def wait_for_update(*_):
            for c in chunks:
                c.ready.wait()
            if self._error is not None:
                raise RuntimeError("fsdpzero offload: the CPU optimizer step failed") from self._error
            if self.h2d is not None:   # FSDP2's all-gather copy-in reads the shards on its own streams
                ctx = getattr(module._get_fsdp_state(), "_comm_ctx", None)
                streams = [torch.cuda.current_stream()] + [getattr(ctx, n) for n in (
                    "all_gather_copy_in_stream", "all_gather_stream") if hasattr(ctx, n)]
                for c in chunks:
                    if c.h2d_done is not None:
                        for s in streams:
                            s.wait_event(c.h2d_done)
        return wait_for_update

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """masters <- the model's (possibly low-precision) shards, e.g. after new weights were loaded."""
        self._join()
        for e in self.entries:
            local = _local(e.param)
            if e.master is not local:
                e.master.copy_(local)

    def wait(self) -> None:
        """Block until an overlapped CPU step has finished (before reading the weights outside a forward)."""
        self._join()

    def _join(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("fsdpzero offload: the CPU optimizer step failed") from err

    # -- GradPath -------------------------------------------------------------------------------------------------
    def set_sync(self, sync: bool) -> None:
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(sync)

    def finish_gradients(self) -> None:
        self._join()                      # the previous step must be done with the grad buffers
        if not self.staged:
            return
        if self.d2h is not None:
            self.d2h.wait_stream(torch.cuda.current_stream())
        for chunk in self.chunks:
            with _on(self.d2h):
                for e in chunk.entries:
                    if e.param.grad is not None:
                        e.grad_buf.copy_(_local(e.param.grad), non_blocking=True)
                if self.d2h is not None:
                    chunk.d2h_done = torch.cuda.Event()
                    chunk.d2h_done.record(self.d2h)

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(e.param for e in self.entries)

    def scale_grads_(self, factor) -> None:
        self._factor = self._factor * factor   # a float or 0-dim tensor; the kernel applies it as it reads grads

    @torch.no_grad()
    def step(self) -> None:
        self._join()
        factor, self._factor = float(self._factor), 1.0   # the CPU needs the value: one sync, after the norm
        # what to step, read now: zero_grad() may drop the grads before an overlapped worker reaches them
        work = [(chunk, [(e, e.grad_buf if e.grad_buf is not None else _local(e.param.grad))
                         for e in chunk.entries if e.param.grad is not None]) for chunk in self.chunks]
        # and the hyperparameters: the engine steps the LR scheduler right after step() returns
        self._hyper = {id(m): {k: v for k, v in g.items() if k != "params"}
                       for g in self.optimizer.param_groups for m in g["params"]}
        if not self.overlap:
            self._step_chunks(work, factor)
            if self.h2d is not None:         # the next forward's all-gathers read the updated shards
                torch.cuda.current_stream().wait_stream(self.h2d)
            return
        for chunk in self.chunks:
            chunk.ready.clear()
        self._worker = threading.Thread(target=self._worker_main, args=(work, factor), daemon=True,
                                        name="fsdpzero-offload-step")
        self._worker.start()

    @torch.no_grad()   # grad mode is per thread
    def _worker_main(self, work, factor) -> None:
        try:
            if self.h2d is not None:   # a new thread starts on GPU 0, whatever this rank's device is
                torch.cuda.set_device(self.h2d.device)
            torch.set_num_threads(max(1, self.threads - 1))   # OpenMP settings are per thread; leave one core
            self._step_chunks(work, factor)                     # to the thread that launches the forward
        except BaseException as e:
            self._error = e
        finally:
            for chunk in self.chunks:
                chunk.ready.set()

    def _step_chunks(self, work, factor) -> None:
        for chunk, items in work:
            if chunk.d2h_done is not None:
                chunk.d2h_done.synchronize()
            if chunk.h2d_done is not None:       # last step's H2D must have read the out buffers we overwrite
                chunk.h2d_done.synchronize()
            for e, grad in items:
                out = e.out_buf
                if out is None and e.master is not _local(e.param):
                    out = _local(e.param)      # CPU-resident low-precision shard: written in place
                self.optimizer.step_param(e.master, grad, out=out, grad_scale=factor, hyper=self._hyper[id(e.master)])
            if self.staged and items:
                with _on(self.h2d):
                    for e, _ in items:
                        _local(e.param).copy_(e.out_buf, non_blocking=True)
                    if self.h2d is not None:
                        chunk.h2d_done = torch.cuda.Event()
                        chunk.h2d_done.record(self.h2d)
            chunk.ready.set()

    def zero_grad(self) -> None:
        if self.d2h is not None:              # grads may be freed only after their D2H has read them
            self.d2h.synchronize()
        for e in self.entries:
            e.param.grad = None

    def state_dict(self) -> dict:
        """Per parameter name: step, exp_avg, exp_avg_sq and the fp32 master, as DTensors placed like the param
        (CPU local shards) so DCP saves each rank's own shard; plus the param groups' hyperparameters."""
        self._join()
        state = {}
        for e in self.entries:
            st = self.optimizer._state(e.master)   # created (zeros, step 0) before the first step: DCP loads
            tensors = {k: st[k] for k in ("exp_avg", "exp_avg_sq")}  # into this dict in place
            tensors["master"] = e.master
            state[e.name] = {"step": st["step"],
                             **{k: _like(e.param, v) for k, v in tensors.items()}}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self._by_master[id(m)].name for m in g["params"]]} for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        self._join()
        names = {e.name: e for e in self.entries}
        for name, saved in sd["state"].items():
            e = names[name]
            st = self.optimizer._state(e.master)
            st["step"] = saved["step"].clone()
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].copy_(_local(saved[k]).view(st[k].shape))
            if "master" in saved:   # absent in a non-offload checkpoint: the model weights just loaded are the masters
                e.master.copy_(_local(saved["master"]).view(e.master.shape))
                _local(e.param).copy_(e.master.view(_local(e.param).shape))   # the device copy follows the master
        for group, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


def _on(stream):
    """torch.cuda.stream(stream), or nothing on CPU-only runs."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _like(param, local: torch.Tensor):
    """`local` as a DTensor shard placed like `param` (a plain tensor when param is plain)."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local.view(_local(param).shape), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride(), run_check=False)


def _hyper_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Adam-family hyperparameters of each group of the configured optimizer, for CPUAdam."""
    from fsdpzero.optim import AdamNoBiasCorrection
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, AdamNoBiasCorrection)) and \
            type(optimizer).__name__ not in ("CPUAdam", "CPUAdamW"):
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


def _units(model: nn.Module, names: list[str]) -> list[tuple[nn.Module | None, list[str]]]:
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


def _nvme_stand_in(local, stage, on_accel, low, pin):
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


def overlap_default() -> bool:
    """FSDPZERO_OFFLOAD_OVERLAP=1 overlaps the CPU step with the next forward (see OffloadGradPath)."""
    return os.environ.get("FSDPZERO_OFFLOAD_OVERLAP", "0") == "1"


def build_grad_path(model: nn.Module, plan: Plan, make_optimizer: OptimizerFactory, mesh=None,
                    *, stage: bool | None = None, overlap: bool | None = None) -> OffloadGradPath:
    """The offload gradient path over an already fully_shard-ed model. `stage` forces (True) or forbids (False)
    staging through CPU buffers; default: stage exactly when the shards live on an accelerator. `overlap`: step
    the CPU side in a worker thread while the next forward runs (default: overlap_default())."""
    from fsdpzero.ops import CPUAdam
    if plan.offload.optimizer_device not in ("cpu", "nvme"):
        raise NotImplementedError(f"offload_optimizer.device = {plan.offload.optimizer_device!r}: only \"cpu\" and "
                                  "\"nvme\" are handled here")
    nvme = plan.offload.optimizer_device == "nvme"   # masters and moments on disk: fsdpzero.nvme
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("offload: the model has no trainable parameters")
    on_accel = _local(named[0][1]).device.type != "cpu"   # else CPU-only, or offload_param put the shards there
    stage = on_accel if stage is None else stage
    threads = torch.get_num_threads()
    if torch.cuda.is_available():
        local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if os.environ.get("FSDPZERO_OFFLOAD_BIND") == "1":
            bind_cores(local_rank, local_world)
        threads = cpu_threads(local_world)
        torch.set_num_threads(threads)
    # Only the copy buffers take part in DMA: they are pinned whenever there is an accelerator (pageable H2D was
    # measured 8x slower). Masters and states never leave the CPU and stay pageable, whatever pin_memory says;
    # pin_memory matters for offload_param (FSDP2 CPUOffloadPolicy, see sharding.py).
    pin = torch.cuda.is_available()
    low = _DTYPES[plan.precision.param_dtype]
    hyper = _hyper_groups(make_optimizer([p for _, p in named]))   # the factory maps params by model order
    units = _units(model, [n for n, _ in named])
    order = {n: i for i, n in enumerate(n for _, ns in units for n in ns)}
    named.sort(key=lambda np_: order[np_[0]])                        # then step them in forward order
    entries, master_of, initial = [], {}, {}
    with torch.no_grad():
        for name, p in named:
            local = _local(p)
            if nvme:   # NVMeAdam steps a CPU tensor with the param's final dtype; its fp32 master goes to disk
                master, grad_buf, out_buf = _nvme_stand_in(local, stage, on_accel, low, pin)
                initial[id(master)] = local
                entries.append(_Entry(name, p, master, grad_buf, out_buf))
                master_of[id(p)] = master
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
            entries.append(_Entry(name, p, master, grad_buf, out_buf))
            master_of[id(p)] = master
        if nvme:    # written to disk now, while `initial` still holds the fp32 weights
            for g in hyper:
                g["params"] = [master_of[id(p)] for p in g["params"]]
            from fsdpzero.nvme import nvme_optimizer
            optimizer = nvme_optimizer(hyper, plan, initial)
            initial.clear()
        if low != torch.float32 and (on_accel or not stage):
            model.to(low)   # device (or CPU-offloaded) shards become low precision; FSDP2 re-registers them
            now = dict(model.named_parameters())
            for e in entries:
                e.param = now[e.name]   # .to() may replace the Parameter objects
    if not nvme:
        for g in hyper:
            g["params"] = [master_of[id(p)] for p in g["params"]]
        optimizer = CPUAdam(hyper)
    chunk = max(1, min(int(plan.offload.sub_group_size), CHUNK))
    by_name = {e.name: e for e in entries}
    path_class = OffloadGradPath
    if nvme:
        from fsdpzero.nvme import NVMeGradPath as path_class
    path = path_class(model, optimizer, [(m, [by_name[n] for n in ns]) for m, ns in units], chunk,
                      threads=threads, overlap=overlap_default() if overlap is None else overlap)
    log.info("offload: %d params, %.1f M elements on this rank, %d chunks, %d CPU threads, staged=%s, pinned "
             "copy buffers=%s, "
             "overlap=%s", len(entries), sum(e.master.numel() for e in entries) / 1e6, len(path.chunks), threads,
             stage, pin, path.overlap)
    return path
