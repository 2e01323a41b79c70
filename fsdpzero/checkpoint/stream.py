"""Streamed checkpoint entries: state that lives on disk (NVMe-offloaded optimizer states, and the param shards of
offload_param nvme) goes through DCP one tensor at a time instead of being read into host memory all at once.

A streamed entry is a meta-device tensor (a DTensor placed like its parameter, or a plain tensor) carrying a
`StreamedState`: DCP plans from its shape alone. Saving, `StreamingSavePlanner.resolve_data` reads the entry when a
writer thread reaches it, and the tensor is dropped once written. Loading, `StreamingLoadPlanner` gives DCP a CPU
buffer for the entry, and writes it back to the swap file once its last piece has landed. A load onto the world
size it was saved with fills each entry from one piece, so one entry at a time is in memory; a resharded load may
hold several partly filled entries at once (as many as the saved pieces it interleaves).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

from fsdpzero.checkpoint.trust import SafeLoadPlanner

_ATTR = "_fsdpzero_streamed"


@dataclass
class StreamedState:
    read: Callable[[], torch.Tensor]                # -> the rank's local tensor (a new CPU tensor)
    write: Callable[[torch.Tensor], None]           # <- the rank's local tensor, whole
    local_shape: tuple[int, ...]
    dtype: torch.dtype


def streamed(like: torch.Tensor, local_shape, dtype: torch.dtype, read, write) -> torch.Tensor:
    """A meta tensor standing for on-disk state: placed like `like` when that is a DTensor (its local shard has
    `local_shape` elements in the same order), else plain with `local_shape`."""
    local = torch.empty(tuple(local_shape), dtype=dtype, device="meta")
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import DTensor
        local = local.view(like.to_local().shape)
        t = DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
                               run_check=False)
    else:
        t = local
    setattr(t, _ATTR, StreamedState(read, write, tuple(local.shape), dtype))
    return t


def streamed_state(t) -> StreamedState | None:
    return getattr(t, _ATTR, None)


def materialize(t: torch.Tensor) -> torch.Tensor:
    """The real tensor for a streamed entry (async saves stage everything up front), placed as it is."""
    s = streamed_state(t)
    local = s.read().view(s.local_shape)
    if not hasattr(t, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)


class _Peak:
    """Bytes of streamed tensors alive at once (read for a save, or filling for a load), for the log and tests."""

    def __init__(self):
        self.now = self.peak = self.total = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.now += n
            self.total += n
            self.peak = max(self.peak, self.now)

    def sub(self, n: int) -> None:
        with self._lock:
            self.now -= n


class StreamingSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner that reads streamed entries when DCP's writer reaches them.

    DCP's FileSystemWriter keeps a reference to every tensor of a file until the file is closed, so dropping ours
    would free nothing. Its serial loader (the writer must be built with per_thread_copy_ahead=0) writes an item
    before it resolves the next one in that thread: the storage of the thread's previous streamed tensor is
    released then, and the last ones by finish()."""

    def __init__(self, streamed_keys: dict[str, StreamedState]):
        super().__init__()
        self.streamed, self.bytes = streamed_keys, _Peak()
        self._held: dict[int, torch.Tensor] = {}      # writer thread -> its streamed tensor being written

    def resolve_data(self, write_item: WriteItem):
        s = self.streamed.get(write_item.index.fqn)
        if s is None:
            return super().resolve_data(write_item)
        self._release(threading.get_ident())
        t = s.read()
        want = math.prod(write_item.tensor_data.chunk.sizes)
        if t.numel() != want:
            raise RuntimeError(f"checkpoint entry {write_item.index.fqn}: read {t.numel()} elements, DCP plans {want}")
        self.bytes.add(t.numel() * t.element_size())
        self._held[threading.get_ident()] = t
        return t.view(s.local_shape)

    def _release(self, thread: int) -> None:
        t = self._held.pop(thread, None)
        if t is not None:
            self.bytes.sub(t.numel() * t.element_size())
            t.untyped_storage().resize_(0)

    def finish(self) -> None:
        """After dcp.save: release what the writer threads still hold."""
        for thread in list(self._held):
            self._release(thread)


class StreamingLoadPlanner(SafeLoadPlanner):
    """SafeLoadPlanner (no pickled entries) that fills streamed entries in CPU buffers and writes each back when
    complete."""

    def __init__(self, streamed_keys: dict[str, StreamedState], **options):
        super().__init__(**options)
        self.streamed, self.bytes = streamed_keys, _Peak()
        self._filling: dict[str, list] = {}          # fqn -> [buffer, elements still to land]

    def set_up_planner(self, state_dict, *args, **kwargs):
        # DefaultLoadPlanner allocates meta entries on the process group's device: keep ours out of that
        held = {k: state_dict.pop(k) for k in self.streamed if k in state_dict}
        super().set_up_planner(state_dict, *args, **kwargs)
        state_dict.update(held)
        self.state_dict.update(held)
        if isinstance(getattr(self, "mappings", None), dict):
            self.mappings.update({k: (k,) for k in held})

    def resolve_tensor(self, read_item: ReadItem):
        fqn = read_item.dest_index.fqn
        s = self.streamed.get(fqn)
        if s is None:
            return super().resolve_tensor(read_item)
        if fqn not in self._filling:
            buf = torch.empty(s.local_shape, dtype=s.dtype)
            self._filling[fqn] = [buf, buf.numel()]
            self.bytes.add(buf.numel() * buf.element_size())
        buf = self._filling[fqn][0]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            buf = buf.narrow(dim, start, length)
        return buf

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        if fqn not in self.streamed:
            return super().commit_tensor(read_item, tensor)
        entry = self._filling[fqn]
        entry[1] -= math.prod(read_item.lengths)
        if entry[1] == 0:
            buf = self._filling.pop(fqn)[0]
            self.streamed[fqn].write(buf)
            self.bytes.sub(buf.numel() * buf.element_size())

    def finish(self) -> None:
        """After dcp.load: every streamed entry must have been written whole."""
        if self._filling:
            raise RuntimeError(f"checkpoint load: {sorted(self._filling)} were only partly in the checkpoint")
