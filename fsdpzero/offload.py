"""ZeRO-Offload on FSDP2: `offload_optimizer.device: cpu` (stages 1-3) and, with it, `offload_param.device: cpu`.

The gradient path for the engine (contract: fsdpzero.optim.GradPath). The model arrives fully_shard-ed; this module
keeps, for every local shard, an fp32 master and the Adam states in (pinned) CPU memory and steps them with the
fused CPU Adam of ops/cpu_adam.cpp, which reads the low-precision gradient and writes the low-precision param in
the same pass. The device keeps only low-precision shards (`model.to(param_dtype)` after the masters are taken).

One optimizer step, with params on an accelerator:
    finish_gradients  D2H of every sharded grad on a side stream, one event per chunk (chunks of the rank's params,
                      <= sub_group_size and <= CHUNK elements, in model order)
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

Threads: torchrun sets OMP_NUM_THREADS=1, which makes the CPU step ~6x slower. With an accelerator the CPU step gets
usable cores / local ranks threads (FSDPZERO_OFFLOAD_THREADS overrides); FSDPZERO_OFFLOAD_BIND=1 also pins each
local rank to its own slice of cores.
"""
from __future__ import annotations

import logging
import os
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
    d2h_done: object = None
    h2d_done: object = None


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
    """fsdpzero.optim.GradPath with fp32 masters and Adam states on the CPU (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, entries: list[_Entry],
                 chunk_size: int):
        self.model = model
        self.optimizer = optimizer          # a CPUAdam over the masters: schedulers drive its param_groups
        self.entries = entries
        self._by_master = {id(e.master): e for e in entries}
        self._factor = 1.0
        self.staged = any(e.grad_buf is not None for e in entries)
        cuda = self.staged and entries[0].param.device.type == "cuda"
        self.d2h = torch.cuda.Stream() if cuda else None
        self.h2d = torch.cuda.Stream() if cuda else None
        self.chunks: list[_Chunk] = [_Chunk()]
        for e in entries:
            if self.chunks[-1].numel and self.chunks[-1].numel + e.master.numel() > chunk_size:
                self.chunks.append(_Chunk())
            self.chunks[-1].entries.append(e)
            self.chunks[-1].numel += e.master.numel()

    # -- GradPath -------------------------------------------------------------------------------------------------
    def set_sync(self, sync: bool) -> None:
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(sync)

    def finish_gradients(self) -> None:
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

    def scale_grads_(self, factor: float) -> None:
        self._factor *= factor          # applied by the kernel as it reads each gradient

    @torch.no_grad()
    def step(self) -> None:
        factor, self._factor = self._factor, 1.0
        for chunk in self.chunks:
            if chunk.d2h_done is not None:
                chunk.d2h_done.synchronize()
            if chunk.h2d_done is not None:       # last step's H2D must have read the out buffers we overwrite
                chunk.h2d_done.synchronize()
            stepped = []
            for e in chunk.entries:
                if e.param.grad is None:
                    continue
                grad = e.grad_buf if e.grad_buf is not None else _local(e.param.grad)
                out = e.out_buf
                if out is None and e.master is not _local(e.param):
                    out = _local(e.param)      # CPU-resident low-precision shard: written in place
                self.optimizer.step_param(e.master, grad, out=out, grad_scale=factor)
                stepped.append(e)
            if self.staged and stepped:
                with _on(self.h2d):
                    for e in stepped:
                        _local(e.param).copy_(e.out_buf, non_blocking=True)
                    if self.h2d is not None:
                        chunk.h2d_done = torch.cuda.Event()
                        chunk.h2d_done.record(self.h2d)
        if self.h2d is not None:             # the next forward's all-gathers read the updated shards
            torch.cuda.current_stream().wait_stream(self.h2d)

    def zero_grad(self) -> None:
        if self.d2h is not None:              # grads may be freed only after their D2H has read them
            self.d2h.synchronize()
        for e in self.entries:
            e.param.grad = None

    def state_dict(self) -> dict:
        """Per parameter name: step, exp_avg, exp_avg_sq and the fp32 master, as DTensors placed like the param
        (CPU local shards) so DCP saves each rank's own shard; plus the param groups' hyperparameters."""
        state = {}
        for e in self.entries:
            st = self.optimizer.state.get(e.master, {})
            tensors = {k: st[k] for k in ("exp_avg", "exp_avg_sq") if k in st}
            tensors["master"] = e.master
            state[e.name] = {"step": st.get("step", torch.tensor(0.0)),
                             **{k: _like(e.param, v) for k, v in tensors.items()}}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self._by_master[id(m)].name for m in g["params"]]} for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        names = {e.name: e for e in self.entries}
        for name, saved in sd["state"].items():
            e = names[name]
            st = self.optimizer._state(e.master)
            st["step"] = saved["step"].clone()
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].copy_(_local(saved[k]).view(st[k].shape))
            e.master.copy_(_local(saved["master"]).view(e.master.shape))
            _local(e.param).copy_(e.master.view(_local(e.param).shape))   # the device copy follows the master
        for group, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


class _on:
    """torch.cuda.stream(s) when s is a stream, nothing otherwise (CPU-only runs)."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx else False


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


def build_grad_path(model: nn.Module, plan: Plan, make_optimizer: OptimizerFactory, mesh=None,
                    *, stage: bool | None = None) -> OffloadGradPath:
    """The offload gradient path over an already fully_shard-ed model. `stage` forces (True) or forbids (False)
    staging through CPU buffers; default: stage exactly when the shards live on an accelerator."""
    from fsdpzero.ops import CPUAdam
    if plan.offload.optimizer_device != "cpu":
        raise NotImplementedError(f"offload_optimizer.device = {plan.offload.optimizer_device!r}: only \"cpu\" is "
                                  "handled here (NVMe is the aio path)")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("offload: the model has no trainable parameters")
    on_accel = _local(named[0][1]).device.type != "cpu"   # else CPU-only, or offload_param put the shards there
    stage = on_accel if stage is None else stage
    if torch.cuda.is_available():
        local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if os.environ.get("FSDPZERO_OFFLOAD_BIND") == "1":
            bind_cores(local_rank, local_world)
        torch.set_num_threads(cpu_threads(local_world))
    pin = torch.cuda.is_available() and plan.offload.pin_memory is not False   # pinning needs an accelerator
    low = _DTYPES[plan.precision.param_dtype]

    hyper = _hyper_groups(make_optimizer([p for _, p in named]))
    entries, master_of = [], {}
    with torch.no_grad():
        for name, p in named:
            local = _local(p)
            if stage or local.dtype != torch.float32:   # a separate fp32 master, taken before any cast below
                master = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)
                master.copy_(local)
            else:
                master = local                          # fp32 CPU shard: stepped in place
            grad_buf = out_buf = None
            if stage:
                dtype = low if on_accel else local.dtype
                grad_buf = torch.empty(local.shape, dtype=dtype, pin_memory=pin)
                out_buf = torch.empty(local.shape, dtype=dtype, pin_memory=pin)
            entries.append(_Entry(name, p, master, grad_buf, out_buf))
            master_of[id(p)] = master
        if low != torch.float32 and (on_accel or not stage):
            model.to(low)   # device (or CPU-offloaded) shards become low precision; FSDP2 re-registers them
            now = dict(model.named_parameters())
            for e in entries:
                e.param = now[e.name]   # .to() may replace the Parameter objects
    for g in hyper:
        g["params"] = [master_of[id(p)] for p in g["params"]]
    optimizer = CPUAdam(hyper)
    chunk = max(1, min(int(plan.offload.sub_group_size), CHUNK))
    log.info("offload: %d params, %.1f M elements on this rank, %d chunks, %d CPU threads, staged=%s, pinned=%s",
             len(entries), sum(e.master.numel() for e in entries) / 1e6, -(-sum(e.master.numel() for e in entries)
                                                                          // chunk), torch.get_num_threads(),
             stage, pin)
    return OffloadGradPath(model, optimizer, entries, chunk)
