"""NVMe offload of the optimizer (`offload_optimizer.device: nvme`, ZeRO-Infinity): the fp32 master weights and
both Adam moments live in a swap file on disk; gradients and the model's parameters stay in (CPU) memory.

    opt = NVMeAdam(model.parameters(), lr=1e-4, adamw_mode=True,
                   offload=OffloadPlan(optimizer_nvme_path="/local_nvme", sub_group_size=100_000_000))
    ...backward...
    opt.step()          # per sub-group: read(i+1) | fused CPU Adam step(i) | write(i-1), on `buffer_count` buffers
    opt.close()         # removes the swap directory (also done at exit and when the optimizer is collected)

The parameters (plain CPU tensors or FSDP2 DTensor shards; fp32, bf16 or fp16) are cut into sub-groups of at most
`sub_group_size` elements, in parameter order, splitting a parameter where needed. A bf16/fp16 parameter gets an fp32
master on disk, and the updated master is rounded into the parameter; an fp32 parameter is its own master (it must
be in memory anyway, as with CPUAdam), so only its two moments go to disk. A sub-group occupies one contiguous range
of the swap file (per slice: [master] exp_avg exp_avg_sq, each padded to the O_DIRECT alignment) and moves in one
read and one write, on separate read and write engines. The update is `fsdpzero_ops.cpu_adam.adam_step_`, the
kernel CPUAdam runs with its states in memory: the results are bit-identical.

Swap space: one directory per optimizer under nvme_path (fsdpzero.offload.swapdir: checked before anything is written,
removed on close/exit, cleaned after a kill; never a checkpoint). Checkpoints go through state_dict().
"""
from __future__ import annotations

import logging
import threading

import torch

from fsdpzero.offload.swapdir import SwapDir, aio_config, close_swap_io
from fsdpzero.plan.types import OffloadPlan
from fsdpzero.tuning import Tuning, or_defaults
from fsdpzero_ops.aio import ALIGN, AioHandle, aligned_empty
from fsdpzero_ops.cpu_adam import adam_step_
from fsdpzero.dist import local_tensor

_ELEMS = ALIGN // 4                       # fp32 elements per alignment unit
log = logging.getLogger("fsdpzero")


# --------------------------------------------------------------------------------------------------- the optimizer

class _SubGroup:
    """Slices (param, group, start, stop, at) of at most sub_group_size parameter elements; `at` is the slice's
    first segment in the sub-group's buffer (segments: [master,] exp_avg, exp_avg_sq, each padded)."""

    def __init__(self):
        self.slices: list[tuple[torch.Tensor, dict, int, int, int]] = []
        self.numel = 0                    # fp32 elements of buffer (and file) space
        self.file_offset = 0


def state_segments(p: torch.Tensor) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq") if local_tensor(p).dtype == torch.float32 else ("master", "exp_avg", "exp_avg_sq")


def _padded(n: int) -> int:
    return -(-n // _ELEMS) * _ELEMS


class NVMeAdam(torch.optim.Optimizer):
    """Adam/AdamW with master weights and moments on disk. Hyperparameters and state_dict layout as CPUAdam
    (torch.optim.Adam's keys); adamw_mode=True is AdamW. See the module docstring for the swap layout."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, offload: OffloadPlan,
                 adamw_mode=False, bias_correction=True, rank: int | None = None,
                 initial: dict[int, torch.Tensor] | None = None, tuning: Tuning | None = None):
        """offload: the plan's offload section (optimizer_nvme_path, buffer_count, sub_group_size, aio: the
        schema declares their defaults; this class declares none). tuning: the engine's settings (its CPU Adam
        kernel and aio engine, passed to fsdpzero_ops as arguments; None: the process defaults, built now).
        initial: id(param) -> the starting value of its fp32 master, when not the param itself (the offload path
        hands in low-precision CPU buffers and keeps the fp32 weights only until they are on disk)."""
        tuning = or_defaults(tuning)
        sub_group_size, buffer_count = offload.sub_group_size, offload.buffer_count
        if sub_group_size < 1:
            raise ValueError(f"zero_optimization.sub_group_size={sub_group_size}: must be >= 1")
        if buffer_count < 1:
            raise ValueError(f"offload_optimizer.buffer_count={buffer_count}: must be >= 1 (4 overlaps fully)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.impl, self.build = tuning.cpu_adam_impl, not tuning.no_build
        self.before_update = None   # callback(param) before a slice is stepped (offload_param nvme swaps it in)
        self._ring_pos, self._writes, self._prefetched = 0, [], []    # the swap pipeline, across steps
        self._io_lock = threading.Lock()       # DCP's writer threads read states concurrently
        self._groups = self._plan_sub_groups(int(sub_group_size))
        self.swap_bytes = sum(g.numel for g in self._groups) * 4
        self.swap_dir = SwapDir(offload.optimizer_nvme_path, rank)    # may raise: before any state is written
        try:
            self.swap_dir.check_space(self.swap_bytes + ALIGN)
            self._reader, self._writer = (AioHandle(aio_config(offload.aio), **tuning.aio_args()),
                                          AioHandle(aio_config(offload.aio), **tuning.aio_args()))
            self._file = self.swap_dir.create_file("optimizer_states.swp")
            size = max((g.numel for g in self._groups), default=0)
            # the swap buffers never meet the GPU: pinning them (offload_optimizer.pin_memory) buys nothing
            self._buffers = [aligned_empty(size, torch.float32, pin=False)
                             for _ in range(min(buffer_count, len(self._groups)))]
            self._warn_if_buffers_hold_the_state(int(sub_group_size))
            self._write_initial_states(initial or {})
        except BaseException:
            self.close()
            raise

    def _warn_if_buffers_hold_the_state(self, sub_group_size: int) -> None:
        """With few sub-groups (sub_group_size near this rank's share, DeepSpeed's default 1e9 included), the ring
        buffers hold most of the state in memory: NVMe offload then saves little host memory."""
        held = sum(b.numel() for b in self._buffers) * 4
        if self.swap_bytes >= 1 << 26 and held >= self.swap_bytes / 2:
            log.warning("offload_optimizer nvme: the %d swap buffers take %.2f GiB of host memory, %.0f%% of this "
                        "rank's %.2f GiB of optimizer state on disk (zero_optimization.sub_group_size=%d): lower "
                        "sub_group_size (each buffer holds 12 B x sub_group_size for bf16 params)",
                        len(self._buffers), held / 2**30, 100 * held / self.swap_bytes, self.swap_bytes / 2**30,
                        sub_group_size)

    # -- layout
    def _plan_sub_groups(self, limit: int) -> list[_SubGroup]:
        groups, cur, used, offset = [], _SubGroup(), 0, 0
        for group in self.param_groups:
            for p in group["params"]:
                n, start = local_tensor(p).numel(), 0
                while start < n:
                    take = min(n - start, limit - used)
                    cur.slices.append((p, group, start, start + take, cur.numel))
                    cur.numel += len(state_segments(p)) * _padded(take)
                    start, used = start + take, used + take
                    if used == limit:
                        groups.append(cur)
                        cur, used = _SubGroup(), 0
        if cur.slices:
            groups.append(cur)
        for g in groups:
            g.file_offset, offset = offset, offset + g.numel * 4
        return groups

    @staticmethod
    def _views(buf: torch.Tensor, s) -> dict[str, torch.Tensor]:
        """The slice's state segments in a sub-group buffer; an fp32 param's master is the param itself."""
        p, _, start, stop, at = s
        n, step = stop - start, _padded(stop - start)
        views = {k: buf[at + i * step:at + i * step + n] for i, k in enumerate(state_segments(p))}
        views.setdefault("master", local_tensor(p).view(-1)[start:stop])
        return views

    def _write_initial_states(self, initial: dict[int, torch.Tensor]) -> None:
        """masters = the params (in fp32), moments = 0; streamed out through the buffers before step 1."""
        writes = [None] * len(self._buffers)
        for i, g in enumerate(self._groups):
            b = i % len(self._buffers)
            if writes[b] is not None:
                writes[b].wait()
            buf = self._buffers[b][:g.numel]
            buf.zero_()
            for s in g.slices:
                views = self._views(buf, s)
                src = local_tensor(initial.get(id(s[0]), s[0])).detach().reshape(-1)[s[2]:s[3]]
                if local_tensor(s[0]).dtype != torch.float32:
                    views["master"].copy_(src)
                elif id(s[0]) in initial:
                    views["master"].copy_(src)               # an fp32 param is its own master: set it
            writes[b] = self._writer.pwrite(buf, self._file, g.file_offset)
        for w in writes:
            if w is not None:
                w.wait()

    # -- the step
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, grads: dict[int, torch.Tensor] | None = None,
             hyper: dict[int, dict] | None = None):
        """grads: id(param) -> gradient, instead of param.grad (any of fp32/bf16/fp16, CPU). hyper: id(param) ->
        the group's hyperparameters to use instead of the live ones (an overlapped step runs while the scheduler
        already sets the next step's lr)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grads is None:
            grads = {id(p): p.grad for g in self.param_groups for p in g["params"] if p.grad is not None}
        todo = [g for g in self._groups if any(id(s[0]) in grads for s in g.slices)]
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in grads:
                    st = self.state[p]
                    st["step"] = st.get("step", torch.tensor(0.0)) + 1
        flat = {k: local_tensor(g).contiguous().view(-1) for k, g in grads.items()}
        self._pipeline(todo, lambda buf, g: self._compute(buf, g, flat, grad_scale, hyper or {}), carry=True)
        return loss

    def _pipeline(self, todo: list[_SubGroup], compute, write_back: bool = True, carry: bool = False) -> None:
        """read(i+k) | compute(i) | write(i-1) on a ring of buffers; k = buffers - 2 (1 with two, 0 with one).
        carry (the optimizer step): the ring goes on across calls, so the last writes drain and the next step's
        first reads run while the model computes; every other caller drains the ring first and last."""
        if not carry:
            self._drain()
        nb, pos = len(self._buffers), self._ring_pos
        ahead = 0 if nb == 1 else max(1, nb - 2)
        reads = {}
        for k, (g, b, req) in enumerate(self._prefetched):      # the previous step's look-ahead, if it fits
            if k < len(todo) and todo[k] is g and b == (pos + k) % nb:
                reads[k] = req
            else:
                req.wait()
        self._prefetched = []

        def start_read(j, groups=todo, at=pos):
            b, g = (at + j) % nb, groups[j]
            # the buffer's previous group, and this group's last write, must be on disk first
            self._wait_writes(lambda wb, wg: wb == b or wg is g)
            return self._reader.pread(self._buffers[b][:g.numel], self._file, g.file_offset)

        try:
            for i, g in enumerate(todo):
                for j in range(i, min(i + ahead, len(todo) - 1) + 1):
                    if j not in reads:
                        reads[j] = start_read(j)
                reads.pop(i).wait()
                b = (pos + i) % nb
                buf = self._buffers[b][:g.numel]
                compute(buf, g)
                if write_back:
                    self._writes.append((b, g, self._writer.pwrite(buf, self._file, g.file_offset)))
        finally:
            for r in reads.values():
                r.wait()
        self._ring_pos = (pos + len(todo)) % nb
        if carry:
            for j in range(min(ahead, len(self._groups))):
                self._prefetched.append((self._groups[j], (self._ring_pos + j) % nb,
                                         start_read(j, self._groups, self._ring_pos)))
        else:
            self._drain()

    def _wait_writes(self, which) -> None:
        pending, self._writes = self._writes, []
        for b, g, req in pending:
            if which(b, g):
                req.wait()
            else:
                self._writes.append((b, g, req))

    def _drain(self) -> None:
        """Wait for every write and look-ahead read still in flight (before reading states any other way)."""
        self._wait_writes(lambda b, g: True)
        for _, _, req in self._prefetched:
            req.wait()
        self._prefetched = []

    def _compute(self, buf, g: _SubGroup, grads: dict, grad_scale: float, hyper: dict | None = None) -> None:
        """grads: id(param) -> flat contiguous gradient."""
        for s in g.slices:
            p, group, start, stop, _ = s
            if id(p) not in grads:
                continue
            if self.before_update is not None:
                self.before_update(p)
            v = self._views(buf, s)
            out = None if local_tensor(p).dtype == torch.float32 else local_tensor(p).view(-1)[start:stop]
            group = (hyper or {}).get(id(p), group)
            beta1, beta2 = group["betas"]
            adam_step_(v["master"], grads[id(p)][start:stop], v["exp_avg"], v["exp_avg_sq"], out, lr=group["lr"],
                       beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                       step=int(self.state[p]["step"].item()), adamw=group["decoupled_weight_decay"],
                       bias_correction=group["bias_correction"], grad_scale=grad_scale, impl=self.impl,
                       build=self.build)

    # -- checkpoints: the normal path, with the states read from disk
    def state_dict(self):
        """torch.optim.Adam's layout (+ "master" for low-precision params, like CPUAdam), read from disk."""
        filled = []

        def gather(buf, g):
            for s in g.slices:
                p, _, start, stop, _ = s
                st = self.state[p]
                if "exp_avg" not in st:
                    filled.append(p)
                    st.setdefault("step", torch.tensor(0.0))
                    for k in state_segments(p):
                        st[k] = torch.empty(local_tensor(p).shape, dtype=torch.float32)
                for k in state_segments(p):
                    st[k].view(-1)[start:stop].copy_(self._views(buf, s)[k])
        self._pipeline(self._groups, gather, write_back=False)
        try:
            sd = super().state_dict()
            sd["state"] = {i: dict(st) for i, st in sd["state"].items()}   # ours, before the pops below
            return sd
        finally:
            for p in filled:
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    self.state[p].pop(k, None)

    # -- one parameter's state at a time (streamed checkpoints, fsdpzero.checkpoint.stream)
    def _segment_io(self, p, key: str, fill=None) -> torch.Tensor | None:
        """Read (fill None) or write (fill: p's local numel of fp32) p's `key` segments, slice by slice, through an
        aligned bounce buffer; the pipeline is drained first, so no ring buffer holds an older copy."""
        with self._io_lock:
            self._drain()
            out = torch.empty(local_tensor(p).shape, dtype=torch.float32) if fill is None else None
            for g in self._groups:
                for sl in g.slices:
                    if sl[0] is not p:
                        continue
                    _, _, start, stop, at = sl
                    n, step = stop - start, _padded(stop - start)
                    offset = g.file_offset + (at + state_segments(p).index(key) * step) * 4
                    bounce = aligned_empty(step, torch.float32)
                    if fill is None:
                        self._reader.pread(bounce, self._file, offset).wait()
                        out.view(-1)[start:stop].copy_(bounce[:n])
                    else:
                        bounce[n:].zero_()
                        bounce[:n].copy_(fill.reshape(-1)[start:stop])
                        self._writer.pwrite(bounce, self._file, offset).wait()
            return out

    def read_state(self, p, key: str) -> torch.Tensor:
        """p's fp32 `key` on disk (one of state_segments(p)), a new tensor shaped like p's local shard."""
        return self._segment_io(p, key)

    def write_state(self, p, key: str, value: torch.Tensor) -> None:
        self._segment_io(p, key, value.to(torch.float32))

    def load_state_dict(self, state_dict):
        """Loads hyperparameters and steps, and writes the moments (and masters) to the swap file, in fp32."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)               # param groups; states arrive cast to the param dtype
        by_param = {p: saved.get(i, {}) for i, p in zip(ids, [p for g in self.param_groups for p in g["params"]])}

        def scatter(buf, g):
            for s in g.slices:
                p, _, start, stop, _ = s
                src, views = by_param.get(p, {}), self._views(buf, s)
                for k in state_segments(p):
                    if k in src:
                        views[k].copy_(src[k].reshape(-1)[start:stop])
                    elif k == "master":
                        views[k].copy_(local_tensor(p).reshape(-1)[start:stop])
                    else:
                        views[k].zero_()
        self._pipeline(self._groups, scatter)
        for p, st in self.state.items():                 # keep only the step counters in memory (own copies)
            for k in ("master", "exp_avg", "exp_avg_sq"):
                st.pop(k, None)
            if "step" in st:
                st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).clone()

    def write_masters(self) -> None:
        """Disk masters <- the low-precision params (the offload path's stand-ins), moments kept: new weights were
        loaded without the optimizer state."""
        def take(buf, g):
            for s in g.slices:
                if local_tensor(s[0]).dtype != torch.float32:
                    self._views(buf, s)["master"].copy_(local_tensor(s[0]).reshape(-1)[s[2]:s[3]])
        self._pipeline(self._groups, take)

    def close(self) -> None:
        """Finish I/O, close the swap file and remove the swap directory (errors of pending writes are moot)."""
        try:
            self._drain()
        except (OSError, AttributeError):
            pass
        handles = (getattr(self, "_reader", None), getattr(self, "_writer", None))
        file = getattr(self, "_file", None)
        self._reader = self._writer = self._file = None
        close_swap_io(handles, file, getattr(self, "swap_dir", None))

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  interpreter shutdown
            pass


def nvme_optimizer_from_plan(params, plan, rank: int | None = None, tuning: Tuning | None = None) -> NVMeAdam:
    """`offload_optimizer.device: nvme`: the optimizer section (Adam/AdamW) over `params`, states on disk."""
    opt = plan.optimizer
    if opt.type not in ("adam", "adamw"):
        raise ValueError(f"offload_optimizer.device=nvme needs optimizer.type Adam or AdamW (the fused CPU Adam "
                         f"swaps its states), got {opt.type!r}; use device \"cpu\" for other optimizers")
    kw = {k: v for k, v in opt.params.items() if k in ("lr", "betas", "eps", "weight_decay", "bias_correction")}
    adamw = opt.adam_w_mode if opt.type == "adam" else True
    return NVMeAdam(params, **kw, offload=plan.offload, adamw_mode=adamw, rank=rank, tuning=tuning)
