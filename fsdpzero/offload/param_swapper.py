"""NVMe offload of the parameters (`offload_param.device: nvme`, ZeRO stage 3): FSDP2's sharded parameters, which
CPUOffloadPolicy keeps in CPU memory, live in a swap file and come back only around their uses.

A unit is one fully_shard-ed module (the root, a block). Its CPU shards are the storages of its FSDPParams'
`_sharded_param_data` (the DTensor local shard is a view of the same storage). FSDP2 frees unsharded parameters by
resizing their storages to 0; we do the same to the shards:

    evict(unit)     write it back if the optimizer changed it, then untyped_storage().resize_(0)
    restore(unit)   resize_(nbytes) and an aio read into the storage (async; waited before FSDP2 reads it)

When units come back:
    forward         a forward pre-hook on each unit, registered to run before fully_shard's own: the unit and the
                    units FSDP2 prefetches from it are made resident, further ones are read ahead
    backward        a hook on each unit's forward outputs, registered before fully_shard's pre-backward hook on the
                    same tensors; backward order is the root, then the blocks in reverse (FSDP2's post-forward order)
    optimizer step  the gradient path calls step_touch(unit) before it updates a unit's shards; units finished in
                    the step are written back asynchronously (read ahead | step | write behind)
    state_dict      restore_all(), and load_state_dict marks every unit dirty; but inside lazy() (the engine's
                    checkpoints) each shard streams through read_shard / write_shard, resident or not

At most `buffer_count` units and `max_in_cpu` elements are resident (reads in flight count); the least recently
used unit outside the current window is evicted first. Gradients stay in memory, as with offload_param cpu.

Host memory really goes back when a unit is evicted: the shards are pageable, not pinned (torch's pinned allocator
keeps freed blocks cached, rounded up to powers of two, so pinned shards would keep every unit resident), and
after every MALLOC_TRIM_BYTES evicted glibc's malloc_trim returns the freed heap pages to the OS.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import threading
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fsdpzero.fsdp2_internals import (fsdp_params, fsdp_prefetch_depth, lazy_init,
                                         own_resizable_storages, shard_data, shard_local)
from fsdpzero.offload.swapdir import SwapDir, aio_config, close_swap_io
from fsdpzero.plan.types import OffloadPlan
from fsdpzero.tuning import Tuning, or_defaults
from fsdpzero_ops.aio import ALIGN, AioHandle, padded_nbytes
from fsdpzero.dist import local_tensor

log = logging.getLogger("fsdpzero")
MALLOC_TRIM_BYTES = 64 << 20      # evicted bytes between two malloc_trim calls (one call: ~0.1-5 ms)


def _load_malloc_trim():
    """glibc's malloc_trim, or None (other C libraries): freed chunks in the middle of the heap otherwise stay in
    the process's resident set, which then does not shrink when units are evicted."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()


@dataclass
class _Unit:
    module: nn.Module
    shards: list                          # FSDPParam objects: their _sharded_param_data storages are what we swap
    nbytes: list[int]                     # each storage's size when resident
    offsets: list[int]                    # and its place in the swap file
    numel: int                            # elements resident (the max_in_cpu unit)
    resident: bool = True                 # memory allocated (maybe still being read)
    reads: list = field(default_factory=list)
    writes: list = field(default_factory=list)
    dirty: bool = False                   # memory differs from the file
    last_use: int = 0


def _storages(unit: _Unit):
    return [shard_data(fp).untyped_storage() for fp in unit.shards]


def _bytes_view(storage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the whole storage (aio needs a contiguous CPU tensor; dtypes vary per param)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


class ParamSwapper:
    """Keeps the CPU shards of `units` (FSDP modules, forward order, root first) on disk between uses."""

    def __init__(self, units: list[nn.Module], *, offload: OffloadPlan, rank: int | None = None,
                 tuning: Tuning | None = None):
        """offload: the plan's offload section (param_nvme_path, param_buffer_count, param_buffer_size, max_in_cpu,
        aio: the schema declares their defaults; this class declares none). tuning: the engine's settings (its aio
        engine; None: the process defaults, built now). How many units FSDP2 prefetches is read from the units."""
        tuning = or_defaults(tuning)
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        buffer_count, max_in_cpu = offload.param_buffer_count, offload.max_in_cpu
        if not units:
            raise ValueError("offload_param.device=nvme: the model has no fully_shard-ed module to swap")
        lazy_init(units[0])   # FSDP2 re-pads the shards at lazy init: in memory, now
        self.units: list[_Unit] = []
        offset = 0
        for module in units:
            shards = fsdp_params(module)
            if not shards:
                continue
            if any(shard_data(fp).device.type != "cpu" for fp in shards):
                raise ValueError("offload_param.device=nvme needs the shards in CPU memory (CPUOffloadPolicy)")
            if not all(shard_data(fp).untyped_storage().resizable() for fp in shards):
                own_resizable_storages([module])
            nbytes = [shard_data(fp).untyped_storage().nbytes() for fp in shards]
            offsets = []
            for n in nbytes:
                offsets.append(offset)
                offset += padded_nbytes(n)
            self.units.append(_Unit(module, shards, nbytes, offsets,
                                    sum(shard_data(fp).numel() for fp in shards)))
        self.depth = max(1, fsdp_prefetch_depth(units))   # FSDP2 unshards the next unit(s) from this one's hooks
        self.buffer_count, self.max_in_cpu = buffer_count, max_in_cpu
        if not self.units:
            raise ValueError("offload_param.device=nvme: the model's FSDP units hold no parameters")
        self.index = {id(u.module): k for k, u in enumerate(self.units)}
        self.forward_order = list(range(len(self.units)))
        # FSDP2's backward: the root's pre-backward first (it holds the head), then the other units in reverse
        root_first = self.units[0].module is units[0]
        self.backward_order = [0] + self.forward_order[:0:-1] if root_first else self.forward_order[::-1]
        self._check_capacity(offload.param_buffer_size)
        self._clock = 0
        self._evicted_bytes = 0     # since the last malloc_trim
        self._in_step: list[int] = []
        self.peak = (0, 0)          # most units / shard elements resident during forward, backward and step
        self._lazy = 0              # > 0 inside lazy(): restore_all() does nothing
        self._io_lock = threading.Lock()     # DCP's writer threads call read_shard concurrently
        self._slots = {shard_data(fp).untyped_storage()._cdata: (k, i)   # shard storage -> (unit, shard)
                       for k, u in enumerate(self.units) for i, fp in enumerate(u.shards)}
        self.swap_dir = SwapDir(offload.param_nvme_path, rank, key="offload_param.nvme_path")
        try:
            self.swap_dir.check_space(offset + ALIGN)
            self._reader, self._writer = (AioHandle(aio_config(offload.aio), **tuning.aio_args()),
                                          AioHandle(aio_config(offload.aio), **tuning.aio_args()))
            self._file = self.swap_dir.create_file("params.swp")
            for u in self.units:                 # everything on disk, then evict down to the budget
                u.dirty = True
                self._write_back(u)
            for u in self.units:
                self._finish_writes(u)
            self._make_room(0, protected=set())
        except BaseException:
            self.close(restore=False)
            raise
        self.swap_bytes = offset
        self._hooks = []
        for k, u in enumerate(self.units):   # prepend: before fully_shard's hooks on the same module
            self._hooks.append(u.module.register_forward_pre_hook(self._pre_forward_hook(k), prepend=True))
            self._hooks.append(u.module.register_forward_hook(self._post_forward_hook(k), prepend=True))
        log.info("offload_param nvme: %d FSDP units, %.1f MiB of shards in %s; at most %d units / %d elements in "
                 "CPU memory", len(self.units), offset / 2**20, self.swap_dir.path, buffer_count, max_in_cpu)
        self._hooks.append(units[0].register_state_dict_pre_hook(lambda *_: self.restore_all()))
        self._hooks.append(units[0].register_load_state_dict_pre_hook(lambda *_: self.restore_all(dirty=True)))

    def _check_capacity(self, buffer_size: int) -> None:
        """Clear errors, before step 1, when the unit in use plus FSDP2's prefetch cannot be resident at once."""
        big = max(u.numel for u in self.units)
        if big > buffer_size:
            raise ValueError(f"offload_param.buffer_size={buffer_size} is smaller than the largest FSDP unit's "
                             f"shard on this rank ({big} elements): set buffer_size >= {big}")
        need = 1 + self.depth
        if self.buffer_count < min(need, len(self.units)):
            raise ValueError(f"offload_param.buffer_count={self.buffer_count}: FSDP2 needs {need} units in CPU "
                             f"memory at once (the one in use and {self.depth} prefetched); set buffer_count >= "
                             f"{need} (or lower stage3_prefetch_bucket_size)")
        window = max(sum(self.units[j].numel for j in order[i:i + need]) for order in
                     (self.forward_order, self.backward_order) for i in range(len(order)))
        if self.max_in_cpu < window:
            raise ValueError(f"offload_param.max_in_cpu={self.max_in_cpu}: the unit in use and the {self.depth} "
                             f"prefetched after it hold up to {window} elements on this rank; set max_in_cpu >= "
                             f"{window}")

    # -- residency --------------------------------------------------------------------------------------------
    def resident_numel(self) -> int:
        return sum(u.numel for u in self.units if u.resident)

    def _evict(self, u: _Unit) -> None:
        self._wait_reads(u)
        if u.dirty:
            self._write_back(u)
        self._finish_writes(u)
        for s in _storages(u):
            s.resize_(0)
        u.resident = False
        self._evicted_bytes += sum(u.nbytes)
        if self._evicted_bytes >= MALLOC_TRIM_BYTES and _malloc_trim is not None:
            _malloc_trim(0)
            self._evicted_bytes = 0

    def _write_back(self, u: _Unit) -> None:
        """Start writing a resident unit to its place in the swap file (FSDP2 keeps no other reference to it)."""
        if not u.dirty:
            return
        self._wait_reads(u)
        self._finish_writes(u)                  # an older write of the same range must not land after this one
        for s, n, off in zip(_storages(u), u.nbytes, u.offsets):
            if n:
                u.writes.append(self._writer.pwrite(_bytes_view(s, n), self._file, off))
        u.dirty = False

    @staticmethod
    def _wait_reads(u: _Unit) -> None:
        for r in u.reads:
            r.wait()
        u.reads = []

    @staticmethod
    def _finish_writes(u: _Unit) -> None:
        for w in u.writes:
            w.wait()
        u.writes = []

    def _start_read(self, u: _Unit) -> None:
        for s, n, off in zip(_storages(u), u.nbytes, u.offsets):
            s.resize_(n)
            if n:
                u.reads.append(self._reader.pread(_bytes_view(s, n), self._file, off))
        u.resident = True

    def _make_room(self, numel: int, protected: set[int]) -> bool:
        """Evict least recently used units outside `protected` until one more unit of `numel` elements fits."""
        while True:
            live = [k for k, u in enumerate(self.units) if u.resident]
            fits = (len(live) + (numel > 0) <= self.buffer_count
                    and sum(self.units[k].numel for k in live) + numel <= self.max_in_cpu)
            if fits:
                return True
            victims = [k for k in live if k not in protected]
            if not victims:
                return False
            self._evict(self.units[min(victims, key=lambda k: self.units[k].last_use)])

    def need(self, ks: list[int], ahead: list[int] = ()) -> None:
        """Make units `ks` resident now (waiting for their reads); start reading `ahead` as far as room allows."""
        self._clock += 1
        protected = set(ks) | set(ahead)
        self._make_room(0, protected)            # back within the budget after a restore_all()
        for k in ks:
            u = self.units[k]
            u.last_use = self._clock
            if not u.resident:
                if not self._make_room(u.numel, set(ks)):
                    raise RuntimeError(f"fsdpzero param swapper: units {ks} do not fit in buffer_count="
                                       f"{self.buffer_count} / max_in_cpu={self.max_in_cpu}")
                self._start_read(u)
        for k in ahead:
            u = self.units[k]
            if u.resident:
                continue
            if not self._make_room(u.numel, protected):
                break
            u.last_use = self._clock
            self._start_read(u)
        live = [u for u in self.units if u.resident]
        self.peak = (max(self.peak[0], len(live)), max(self.peak[1], sum(u.numel for u in live)))
        for k in ks:
            self._wait_reads(self.units[k])

    def _window(self, order: list[int], k: int) -> tuple[list[int], list[int]]:
        i = order.index(k)
        return order[i:i + 1 + self.depth], order[i + 1 + self.depth:i + self.buffer_count]

    def restore_all(self, dirty: bool = False) -> None:
        """Every unit resident (over the budget until the next forward evicts): for state_dict / load_state_dict,
        whose tensors are read or written after the call returns. dirty: the caller will write into them."""
        if self._lazy:
            return
        for u in self.units:
            if not u.resident:
                self._start_read(u)
        for u in self.units:
            self._wait_reads(u)
            u.dirty = u.dirty or dirty

    # -- one shard at a time (streamed checkpoints) -------------------------------------------------------------
    @contextlib.contextmanager
    def lazy(self):
        """restore_all() does nothing inside: the caller reads and writes shards through read_shard/write_shard."""
        self._lazy += 1
        try:
            yield self
        finally:
            self._lazy -= 1

    def slot(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(unit, shard) of the swapped shard whose storage `t` (a param, its DTensor or local view) uses."""
        local = local_tensor(t)
        return self._slots.get(local.untyped_storage()._cdata)

    @property
    def lazy_depth(self) -> int:
        """> 0 inside lazy(): the shards stay where they are and checkpoints stream them."""
        return self._lazy

    def _shard_tensor(self, k: int, i: int) -> torch.Tensor:
        return shard_local(self.units[k].shards[i])

    def _byte_range(self, k: int, i: int) -> slice:
        local = self._shard_tensor(k, i)
        start = local.storage_offset() * local.element_size()
        return slice(start, start + local.numel() * local.element_size())

    @torch.no_grad()
    def read_shard(self, k: int, i: int) -> torch.Tensor:
        """Shard i of unit k as a new tensor (its local shape and dtype): copied from memory when resident, else
        read from the swap file into a buffer of its own; the unit's residency does not change."""
        u, local = self.units[k], self._shard_tensor(k, i)
        with self._io_lock:
            if u.resident:
                self._wait_reads(u)
                return local.clone()
            buf = torch.empty(u.nbytes[i], dtype=torch.uint8)
            if u.nbytes[i]:
                self._reader.pread(buf, self._file, u.offsets[i]).wait()
        return buf[self._byte_range(k, i)].view(local.dtype).view(local.shape)

    @torch.no_grad()
    def write_shard(self, k: int, i: int, value: torch.Tensor) -> None:
        """Shard i of unit k <- value (any dtype, its local numel): into memory when resident (written back
        when evicted), else straight to its place in the swap file (the padding past the shard is zeroed)."""
        u, local = self.units[k], self._shard_tensor(k, i)
        value = value.reshape(local.shape)
        with self._io_lock:
            if u.resident:
                self._wait_reads(u)
                self._finish_writes(u)          # a write of the old value must not land after this one
                local.copy_(value)
                u.dirty = True
                return
            buf = torch.zeros(u.nbytes[i], dtype=torch.uint8)
            buf[self._byte_range(k, i)].view(local.dtype).view(local.shape).copy_(value)
            if u.nbytes[i]:
                self._writer.pwrite(buf, self._file, u.offsets[i]).wait()

    def streamed_shard(self, param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A checkpoint entry (fsdpzero.checkpoint.stream) standing for `param`'s swapped shard, placed like it;
        dtype: the entry's (the shard's by default; reads and writes convert)."""
        from fsdpzero.checkpoint.stream import streamed
        k, i = self.slot(param)
        local, dtype = self._shard_tensor(k, i), dtype or self._shard_tensor(k, i).dtype
        return streamed(param, local.shape, dtype, lambda: self.read_shard(k, i).to(dtype),
                        lambda value: self.write_shard(k, i, value))

    # -- hooks ------------------------------------------------------------------------------------------------
    def _pre_forward_hook(self, k: int):
        def restore_for_forward(module, args):
            self.step_end()
            # a recompute (activation checkpointing) runs inside backward: keep to the backward order
            in_backward = torch._C._current_graph_task_id() != -1
            self.need(*self._window(self.backward_order if in_backward else self.forward_order, k))
        return restore_for_forward

    def _post_forward_hook(self, k: int):
        def restore_for_backward(_grad):
            self.step_end()
            self.need(*self._window(self.backward_order, k))

        def register(module, args, output):
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(restore_for_backward)   # before fully_shard's pre-backward on t
        return register

    # -- the optimizer step -----------------------------------------------------------------------------------
    def step_touch(self, k: int) -> None:
        """The optimizer is about to update unit k's shards: make it resident and dirty, read the next units
        ahead, and start writing back the units this step has finished (steps go in forward order)."""
        if k not in self._in_step:
            for j in self._in_step:
                self._write_back(self.units[j])
            self._in_step.append(k)
        self.need(*self._window(self.forward_order, k))
        self.units[k].dirty = True

    def step_end(self) -> None:
        """After the step: every updated unit on its way to disk (waited for when it is evicted)."""
        for j in self._in_step:
            self._write_back(self.units[j])
        self._in_step = []

    def close(self, restore: bool = True) -> None:
        """Back to plain CPU offload: every shard in memory (unless restore=False), hooks and swap files gone."""
        if restore and getattr(self, "_reader", None) is not None:
            self.step_end()
            self.restore_all()
            for u in self.units:
                self._finish_writes(u)
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
        handles = (getattr(self, "_reader", None), getattr(self, "_writer", None))
        file = getattr(self, "_file", None)
        self._reader = self._writer = self._file = None
        close_swap_io(handles, file, getattr(self, "swap_dir", None))

