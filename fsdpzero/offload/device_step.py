"""What the offload path computes on the device itself: the global grad norm (in fp32) and, with
`offload_optimizer.ratio < 1`, the Adam step of the chunks that stay there."""
from __future__ import annotations

import queue
import threading

import torch
from torch.optim.adam import adam as torch_adam

from fsdpzero.optim import global_grad_norm
from fsdpzero.dist import local_tensor


def grad_norm(params, cached: dict | None = None, build: bool = True) -> torch.Tensor:
    """global_grad_norm, but each tensor's norm in fp32 when the grads are low precision: the device keeps bf16
    grads here (the shards are bf16), and torch's foreach norm of bf16 tensors returns bf16 norms, a clip
    coefficient off by up to ~0.4%. DeepSpeed takes the norm in fp32; so does this. fp32 grads: global_grad_norm.
    `cached` (CPU grads only): sums of squares already taken during backward (CpuNormPrefetch.take). build: the
    engine's no_build knob, negated (False: the ops' reference sum, never a compiled op)."""
    grads = [p.grad for p in params if p.grad is not None]
    if all(g.dtype == torch.float32 for g in grads):
        return global_grad_norm(params)
    if grads[0].device.type == "cpu":   # offload_param: asking torch for fp32 would first copy every grad to fp32
        return _cpu_norm(grads, cached, build)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _tensor_key(t: torch.Tensor) -> tuple:
    """What identifies a local grad across to_local() calls (each returns a new Python object over the same
    memory)."""
    return t.data_ptr(), t.numel(), t.dtype


def _cpu_norm(grads, cached: dict | None = None, build: bool = True) -> torch.Tensor:
    """The norm of CPU grads from the ops' fp32 sum of squares of each local shard (2 bytes read per element),
    reduced over the mesh dims the grads are sharded on (one collective per distinct placement). `cached`:
    _tensor_key(local grad) -> its sum of squares, for the ones summed during backward; the sums are added in the
    same order either way, so the norm has the same bits."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from fsdpzero_ops import cpu_adam
    sums: dict = {}
    cached = cached or {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        loc = local_tensor(g)
        hit = cached.get(_tensor_key(loc))
        sums[key] = sums.get(key, 0.0) + (hit if hit is not None else cpu_adam.grad_sumsq(loc, build))
    total = torch.zeros((), dtype=torch.float64)
    for key, value in sums.items():
        local = torch.tensor(value, dtype=torch.float64)
        if key is not None:   # the collective runs on the mesh's device (NCCL on a cuda mesh), the sum stays here
            mesh, placements = key
            dev = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else local.device
            local = DTensor.from_local(local.to(dev), mesh, [Partial() if p.is_shard() else Replicate()
                                                             for p in placements], run_check=False).full_tensor()
        total += local.cpu()
    return total.sqrt().float()


@torch.no_grad()
def adam_step(entries, hyper: dict[int, dict], state: dict, factor: float) -> None:
    """torch's Adam(W) on the entries' device-resident fp32 masters (fused on CUDA), one call per hyperparameter
    set. The grad is read in fp32 and scaled as the CPU kernel reads it (fp32(grad) * factor; fp32 grads in place,
    as FSDPGradPath does), then the param receives the rounded master. `hyper`: per id(master), the group's
    hyperparameters when step() was called; `state`: the optimizer's per-master state (step, exp_avg, exp_avg_sq)."""
    sets: dict[tuple, list] = {}
    for e in entries:
        if e.param.grad is not None:
            h = hyper[id(e.master)]
            key = (h["lr"], tuple(h["betas"]), h["eps"], h["weight_decay"], bool(h.get("decoupled_weight_decay")))
            sets.setdefault(key, []).append(e)
    for (lr, (beta1, beta2), eps, weight_decay, decoupled), everything in sets.items():
        # in groups of about STEP_GROUP elements: the fp32 copies of low-precision grads exist one group at a time
        # (4 B/param of transient device memory for the group, not for every device-stepped param at once);
        # Adam is elementwise per tensor, so the grouping changes no bit
        for es in _groups(everything):
            grads = [local_tensor(e.param.grad).float() for e in es]
            if factor != 1.0:
                for g in grads:
                    g.mul_(factor)
            states = [state[e.master] for e in es]
            torch_adam([e.master for e in es], grads, [st["exp_avg"] for st in states],
                       [st["exp_avg_sq"] for st in states], [], [st["step"] for st in states], foreach=False,
                       fused=True if es[0].master.device.type == "cuda" else None, decoupled_weight_decay=decoupled,
                       amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                       maximize=False)
            for e in es:
                local = local_tensor(e.param)
                if e.master is not local:
                    local.copy_(e.master)


STEP_GROUP = 1 << 27   # elements per device Adam call (512 MiB of fp32 grad copies)


def _groups(entries):
    group, size = [], 0
    for e in entries:
        n = e.master.numel()
        if group and size + n > STEP_GROUP:
            yield group
            group, size = [], 0
        group.append(e)
        size += n
    if group:
        yield group


class CpuNormPrefetch:
    """offload_param: FSDP2 copies each unit's reduced grads to the host behind its reduce-scatter, during backward,
    while the CPU has nothing to do until step() (the overlapped step of the last iteration ended before this
    forward did). A worker thread takes each grad's sum of squares as soon as its copy lands, so the norm after
    backward only adds cached sums (about 30 ms a step at 0.89 B on one H100 otherwise). Exact: the same op on
    the same tensor, added in the same order by _cpu_norm. One worker takes the submissions in order, so a grad
    submitted again (a later micro-step's post-backward) ends with the sum of its latest state."""

    def __init__(self, threads: int, build: bool = True):
        self.threads, self.build = threads, build   # build: as grad_norm's
        self.hits = 0                   # grads whose sum came from the worker (tests)
        self._queue: queue.Queue = queue.Queue()
        self._sums: dict[int, tuple] = {}          # id(param) -> (local grad, sum of squares)
        self._thread = threading.Thread(target=self._main, daemon=True, name="fsdpzero-offload-norm")
        self._thread.start()

    def submit(self, grads) -> None:
        """grads: (param, its local grad tensor, the CUDA event its D2H completes, or None)."""
        for item in grads:
            self._queue.put(item)

    def _main(self) -> None:
        from fsdpzero_ops import cpu_adam
        torch.set_num_threads(self.threads)
        while True:
            item = self._queue.get()
            if item is None:   # close()
                self._queue.task_done()
                return
            param, loc, event = item
            try:
                if event is not None:
                    event.synchronize()
                self._sums[id(param)] = (loc, cpu_adam.grad_sumsq(loc, self.build))
            except Exception:   # noqa: BLE001  the norm then sums this grad itself
                self._sums.pop(id(param), None)
            finally:
                self._queue.task_done()

    def take(self) -> dict[tuple, float]:
        """Wait for the queued sums; _tensor_key(local grad) -> its sum. Clears (the grads outlive the norm: their
        memory cannot be another grad's within the step)."""
        self._queue.join()
        out = {_tensor_key(loc): v for loc, v in self._sums.values()}
        self._sums.clear()
        self.hits += len(out)
        return out

    def clear(self) -> None:
        self._queue.join()
        self._sums.clear()

    def close(self) -> None:
        """Finish the queued sums and end the worker (the grad path's close: engine.destroy(), collection, exit).
        A thread still inside a torch op when the interpreter finalizes aborts the process (docs/engine.md,
        "Shutdown"); in a forked child the worker does not exist and there is nothing to join."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._sums.clear()
