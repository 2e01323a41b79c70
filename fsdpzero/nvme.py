"""NVMe offload of the optimizer (`offload_optimizer.device: nvme`, ZeRO-Infinity): the fp32 master weights and
both Adam moments live in a swap file on disk; gradients and the model's parameters stay in (CPU) memory.

    opt = NVMeAdam(model.parameters(), lr=1e-4, adamw_mode=True, nvme_path="/local_nvme", sub_group_size=1e8)
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

Swap directories (`SwapDir`): <nvme_path>/fsdpzero_swap/<host>.<pid>.rank<r>/, created at start with a marker
naming the owning process; free space and writability are checked before anything is written; the directory is
removed on close/exit, and one left by a killed process (dead pid, or another boot) is removed by the next start
on the same host. The marker file says it is not a checkpoint; checkpoints go through state_dict().
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import weakref
from pathlib import Path

import torch

import fsdpzero.ops  # noqa: F401  registers fsdpzero_ops from a source checkout
from fsdpzero_ops.aio import ALIGN, AioConfig, AioHandle, aligned_empty, padded_nbytes
from fsdpzero_ops.cpu_adam import adam_step_

SWAP_ROOT = "fsdpzero_swap"
MARKER = "FSDPZERO_SWAP_NOT_A_CHECKPOINT.json"
_ELEMS = ALIGN // 4                       # fp32 elements per alignment unit


# ------------------------------------------------------------------------------------------------ swap directory

def _proc_start_time(pid: int) -> str | None:
    """Start time of a live process (field 22 of /proc/<pid>/stat), None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def is_swap_dir(path) -> bool:
    """True for a directory made by SwapDir (checkpoint loaders should refuse these)."""
    path = Path(path)
    return path.name == SWAP_ROOT or (path / MARKER).exists() or (path.parent.name == SWAP_ROOT)


def remove_stale_swap_dirs(nvme_path) -> list[Path]:
    """Remove swap directories under nvme_path left by dead processes of this host (killed runs). Returns them."""
    base, host, removed = Path(nvme_path) / SWAP_ROOT, socket.gethostname(), []
    if not base.is_dir():
        return removed
    for d in base.iterdir():
        try:
            owner_host, pid, _ = d.name.rsplit(".", 2)
            pid = int(pid)
        except ValueError:
            continue                       # not ours: leave it alone
        if owner_host != host:
            continue                       # another node's process: we cannot tell whether it is alive
        try:
            marker = json.loads((d / MARKER).read_text())
        except (OSError, ValueError):
            marker = {}
        alive = (_proc_start_time(pid) is not None and marker.get("boot_id", _boot_id()) == _boot_id()
                 and marker.get("start_time", _proc_start_time(pid)) == _proc_start_time(pid))
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class SwapDir:
    """This process's swap directory under nvme_path; `key` names the config key in error messages."""

    def __init__(self, nvme_path, rank: int = 0, key: str = "offload_optimizer.nvme_path"):
        if nvme_path is None:
            raise ValueError(f"config key '{key}' is not set: NVMe offload needs a directory on a fast local disk, "
                             f"e.g. \"{key.rsplit('.', 1)[-1]}\": \"/local_nvme\"")
        self.key, self.root = key, Path(nvme_path)
        try:
            if not self.root.exists():
                raise FileNotFoundError(errno.ENOENT, f"config key '{key}' = {str(self.root)!r}: the directory "
                                        "does not exist; create it (mkdir -p) or point it at a directory on the "
                                        "NVMe disk", str(self.root))
            if not self.root.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"config key '{key}' = {str(self.root)!r} is not a "
                                         "directory", str(self.root))
            base = self.root / SWAP_ROOT
            base.mkdir(exist_ok=True)
            remove_stale_swap_dirs(self.root)
            self.path = base / f"{socket.gethostname()}.{os.getpid()}.rank{rank}"
            self.path.mkdir(exist_ok=True)
            (self.path / MARKER).write_text(json.dumps(
                {"what": "fsdpzero NVMe swap space (optimizer states of a running job); not a checkpoint",
                 "pid": os.getpid(), "start_time": _proc_start_time(os.getpid()), "boot_id": _boot_id(),
                 "rank": rank}))
        except PermissionError:
            raise PermissionError(errno.EACCES, f"config key '{key}' = {str(self.root)!r}: not writable (or not "
                                  f"reachable) by this user (uid {os.getuid()}); fix its permissions or choose "
                                  "another directory", str(self.root)) from None
        self._finalizer = weakref.finalize(self, _remove_swap_dir, self.path)

    def check_space(self, nbytes: int) -> None:
        """Fail now, not mid-step: the file system must take an O_DIRECT write and have `nbytes` free."""
        probe = self.path / ".write_probe"
        try:
            with AioHandle(AioConfig(block_size=ALIGN), backend="python") as h, h.open(probe, write=True) as f:
                h.pwrite(aligned_empty(ALIGN), f).wait()
                os.fsync(f.fd)
        except OSError as e:
            raise OSError(e.errno, f"config key '{self.key}' = {str(self.root)!r}: cannot write swap files in "
                          f"{self.path}: {e.strerror or e}") from None
        finally:
            probe.unlink(missing_ok=True)
        free = shutil.disk_usage(self.path).free
        if free < nbytes:
            raise OSError(errno.ENOSPC, f"config key '{self.key}' = {str(self.root)!r}: NVMe offload of this rank "
                          f"needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of swap space, the file system has "
                          f"{free} bytes ({free / 2**30:.2f} GiB) free; free space, use a bigger disk, or offload "
                          "to \"cpu\"")

    def close(self) -> None:
        self._finalizer()


def _remove_swap_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()               # the fsdpzero_swap folder too, once no rank uses it
    except OSError:
        pass


# --------------------------------------------------------------------------------------------------- the optimizer

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _SubGroup:
    """Slices (param, group, start, stop, at) of at most sub_group_size parameter elements; `at` is the slice's
    first segment in the sub-group's buffer (segments: [master,] exp_avg, exp_avg_sq, each padded)."""

    def __init__(self):
        self.slices: list[tuple[torch.Tensor, dict, int, int, int]] = []
        self.numel = 0                    # fp32 elements of buffer (and file) space
        self.file_offset = 0


def _segments(p: torch.Tensor) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq") if _local(p).dtype == torch.float32 else ("master", "exp_avg", "exp_avg_sq")


def _padded(n: int) -> int:
    return -(-n // _ELEMS) * _ELEMS


class NVMeAdam(torch.optim.Optimizer):
    """Adam/AdamW with master weights and moments on disk. Hyperparameters and state_dict layout as CPUAdam
    (torch.optim.Adam's keys); adamw_mode=True is AdamW. See the module docstring for the swap layout."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, adamw_mode=False,
                 bias_correction=True, nvme_path, rank: int | None = None, sub_group_size: int = 1_000_000_000,
                 buffer_count: int = 4, aio: AioConfig | None = None, pin_memory: bool | None = None,
                 impl: str | None = None):
        if sub_group_size < 1:
            raise ValueError(f"zero_optimization.sub_group_size={sub_group_size}: must be >= 1")
        if buffer_count < 1:
            raise ValueError(f"offload_optimizer.buffer_count={buffer_count}: must be >= 1 (4 overlaps fully)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.impl = impl
        self._groups = self._plan_sub_groups(int(sub_group_size))
        self.swap_bytes = sum(g.numel for g in self._groups) * 4
        self.swap_dir = SwapDir(nvme_path, rank)                       # may raise: before any state is written
        try:
            self.swap_dir.check_space(self.swap_bytes + ALIGN)
            self._reader, self._writer = AioHandle(aio or AioConfig()), AioHandle(aio or AioConfig())
            self._file = self._writer.open(self.swap_dir.path / "optimizer_states.swp", write=True)
            size = max((g.numel for g in self._groups), default=0)
            self._buffers = [aligned_empty(size, torch.float32, pin=pin_memory)
                             for _ in range(min(buffer_count, len(self._groups)))]
            self._write_initial_states()
        except BaseException:
            self.close()
            raise

    # -- layout
    def _plan_sub_groups(self, limit: int) -> list[_SubGroup]:
        groups, cur, used, offset = [], _SubGroup(), 0, 0
        for group in self.param_groups:
            for p in group["params"]:
                n, start = _local(p).numel(), 0
                while start < n:
                    take = min(n - start, limit - used)
                    cur.slices.append((p, group, start, start + take, cur.numel))
                    cur.numel += len(_segments(p)) * _padded(take)
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
        views = {k: buf[at + i * step:at + i * step + n] for i, k in enumerate(_segments(p))}
        views.setdefault("master", _local(p).view(-1)[start:stop])
        return views

    def _write_initial_states(self) -> None:
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
                if _local(s[0]).dtype != torch.float32:
                    views["master"].copy_(_local(s[0]).detach().reshape(-1)[s[2]:s[3]])
            writes[b] = self._writer.pwrite(buf, self._file, g.file_offset)
        for w in writes:
            if w is not None:
                w.wait()

    # -- the step
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [g for g in self._groups if any(s[0].grad is not None for s in g.slices)]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    st = self.state[p]
                    st["step"] = st.get("step", torch.tensor(0.0)) + 1
        grads = {}
        self._pipeline(todo, lambda buf, g: self._compute(buf, g, grads, grad_scale))
        return loss

    def _pipeline(self, todo: list[_SubGroup], compute, write_back: bool = True) -> None:
        """read(i+k) | compute(i) | write(i-1) on a ring of buffers; k = buffers - 2 (1 with two, 0 with one)."""
        nb = len(self._buffers)
        ahead = 0 if nb == 1 else max(1, nb - 2)
        reads, writes = {}, [None] * nb

        def start_read(j):
            b = j % nb
            if writes[b] is not None:                 # the buffer's previous group must be on disk first
                writes[b].wait()
                writes[b] = None
            reads[j] = self._reader.pread(self._buffers[b][:todo[j].numel], self._file, todo[j].file_offset)

        try:
            for j in range(min(ahead, len(todo))):
                start_read(j)
            for i, g in enumerate(todo):
                if i not in reads:
                    start_read(i)
                if i + ahead < len(todo) and i + ahead not in reads and ahead:
                    start_read(i + ahead)
                reads.pop(i).wait()
                buf = self._buffers[i % nb][:g.numel]
                compute(buf, g)
                if write_back:
                    writes[i % nb] = self._writer.pwrite(buf, self._file, g.file_offset)
        finally:
            for r in list(reads.values()) + [w for w in writes if w is not None]:
                r.wait()

    def _compute(self, buf, g: _SubGroup, grads: dict, grad_scale: float) -> None:
        for s in g.slices:
            p, group, start, stop, _ = s
            if p.grad is None:
                continue
            if id(p) not in grads:
                grads[id(p)] = _local(p.grad).contiguous().view(-1)
            v = self._views(buf, s)
            out = None if _local(p).dtype == torch.float32 else _local(p).view(-1)[start:stop]
            beta1, beta2 = group["betas"]
            adam_step_(v["master"], grads[id(p)][start:stop], v["exp_avg"], v["exp_avg_sq"], out, lr=group["lr"],
                       beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                       step=int(self.state[p]["step"].item()), adamw=group["decoupled_weight_decay"],
                       bias_correction=group["bias_correction"], grad_scale=grad_scale, impl=self.impl)

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
                    for k in _segments(p):
                        st[k] = torch.empty(_local(p).shape, dtype=torch.float32)
                for k in _segments(p):
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
                for k in _segments(p):
                    if k in src:
                        views[k].copy_(src[k].reshape(-1)[start:stop])
                    elif k == "master":
                        views[k].copy_(_local(p).reshape(-1)[start:stop])
                    else:
                        views[k].zero_()
        self._pipeline(self._groups, scatter)
        for p, st in self.state.items():                 # keep only the step counters in memory (own copies)
            for k in ("master", "exp_avg", "exp_avg_sq"):
                st.pop(k, None)
            if "step" in st:
                st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).clone()

    def close(self) -> None:
        """Finish I/O, close the swap file and remove the swap directory (errors of pending writes are moot)."""
        for name in ("_reader", "_writer"):
            handle = getattr(self, name, None)
            setattr(self, name, None)
            if handle is not None:
                try:
                    handle.close()
                except OSError:
                    pass
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None
        if hasattr(self, "swap_dir"):
            self.swap_dir.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  interpreter shutdown
            pass


def nvme_optimizer_from_plan(params, plan, rank: int | None = None) -> NVMeAdam:
    """`offload_optimizer.device: nvme`: the optimizer section (Adam/AdamW) over `params`, states on disk."""
    opt, off = plan.optimizer, plan.offload
    if opt.type not in ("adam", "adamw"):
        raise ValueError(f"offload_optimizer.device=nvme needs optimizer.type Adam or AdamW (the fused CPU Adam "
                         f"swaps its states), got {opt.type!r}; use device \"cpu\" for other optimizers")
    kw = {k: v for k, v in opt.params.items() if k in ("lr", "betas", "eps", "weight_decay", "bias_correction")}
    adamw = opt.adam_w_mode if opt.type == "adam" else True
    return NVMeAdam(params, **kw, adamw_mode=adamw, nvme_path=off.optimizer_nvme_path, rank=rank,
                    sub_group_size=off.sub_group_size, buffer_count=off.buffer_count,
                    aio=AioConfig.from_plan(off.aio), pin_memory=off.pin_memory and torch.cuda.is_available())
