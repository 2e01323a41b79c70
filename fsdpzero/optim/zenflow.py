"""ZenFlow (`zero_optimization.zenflow`): DeepSpeed 0.19.8's stale-update offload (runtime/zenflow/*,
ops/adam/zenflow_*.py, ops/csrc/adam/cpu_adam_impl.cpp's ZenFlowAdam) as a gradient path on FSDP2.

Every micro-batch is one ZenFlow step k = 0, 1, ... (DeepSpeed sets gradient_accumulation_steps to update_interval U
and divides the loss by it; here the engine runs gradient_accumulation_steps 1 and the path multiplies each
gradient by 1/U in its own dtype as it reads it, which is the same arithmetic for U a power of two; the gradients
themselves stay unscaled, the selection's ranking does not depend on it, and grad_norm() reports the scaled norm).
With W = full_warm_up_rounds, S = select_interval:

- selection boundary (k >= W and k == W or k % S == 0): the fp32 CPU masters are resynced from the device weights
  (not at k = 0) and the selective AdamW moments restart at zero (its step count goes on). The step's gradient
  picks, per 2-D parameter, the topk_ratio columns (input features) with the largest sum of |gradient|. DeepSpeed
  picks them per piece of its ZeRO-1/2 flat partition: each rank takes the top max(1, int(n * topk_ratio)) of the n
  whole columns inside its piece of the parameter (columns cut by a partition boundary are never picked), so the
  pieces are computed here from the same partition (ds_column_pieces) and the sums over FSDP2's row shards are
  all-reduced into whole columns first. ZeRO 3 partitions each parameter on its own and picks the top
  max(1, int(n * topk_ratio)) of all n whole columns of its rank parts together (ds3_column_pieces).
- every step k >= W: the selected columns and every 1-D parameter take an AdamW step on the device (torch's
  single-tensor AdamW's arithmetic by foreach kernels, unclipped gradient) -- at an update boundary after the CPU step,
  from their values before it.
- every step: the gradient accumulates on the host in its own dtype (2 bytes per parameter with bf16, 4 in fp32;
  twice that with overlap_step; pinned), as DeepSpeed keeps its sum on the CPU in the model's dtype. Each FSDP
  unit's gradients join it right after the unit's reduce-scatter, during backward (fsdp2_internals.after_reduce;
  finish_gradients takes any left). With an accelerator they are added on the device, chunk by chunk through two
  staging buffers, and the sum goes back (_DeviceRoundTrip): its bytes each way per step (only back at an
  interval's first step), on side streams beside backward, the step and the next forward; the CPU step reads the
  host sum in place. The device holds the selective state alone (DeepSpeed's: the selected columns' and the
  vectors' gradient, moments and restore copy) and two staging chunks.
- update boundary (k + 1 < W, or (k + 1 - W) % U == 0, or (k + 1) % S == 0): the accumulated gradient, clipped by
  its own global norm (gradient_clipping), takes a CPU Adam step on the masters with bias correction at step k + 1
  (DeepSpeed's step_id) and the masters replace the device weights; the selected columns and 1-D parameters then
  get their device values back before their own step.
- overlap_step: the CPU step runs in a thread while the next interval's forward/backward run, and its result lands
  at the next boundary (DeepSpeed's optimizer process: the first boundary after the warm-up, and with W = 0 the
  first two, land nothing); it alternates between two gradient buffers and two sets of Adam moments, as
  DeepSpeed's ZenFlowAdam does. Warm-up steps are synchronous.
- offload: the selective moments live on the CPU between steps (moved to the device for each step), and so does
  the selected values' copy restored at an update (DeepSpeed's temp_selected_param).

The CPU step is placed as the offload path's (fsdpzero/host.py place_cpu_step, knobs offload_threads and
offload_bind): this rank's own slice of cores, one thread per CPU of it. With overlap_step, pt_reserved_cores_perc
leaves ceil(pt_reserved_cores_perc x n) of those n threads to the training thread (DeepSpeed's _split_affinity);
the knob offload_threads sets the CPU step's threads outright.
"""
from __future__ import annotations

import contextlib
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fsdpzero import fsdp2_internals
from fsdpzero.dist import local_tensor
from fsdpzero.host import build_cpu_adam_op, place_cpu_step
from fsdpzero.optim.grad_path import MASTER, GradPath, global_grad_norm
from fsdpzero.precision import DTYPES
from fsdpzero.tuning import or_defaults


def ds_column_pieces(shapes: list[tuple[int, ...]], world: int) -> list[list[tuple[int, int]]]:
    """DeepSpeed ZeRO-1/2's flat partition of one param group (the parameters in order, padded to a multiple of
    2 x world, one equal partition per rank) cut into each parameter's pieces; per 2-D parameter, the (first, end)
    whole columns of each piece in ZenFlow's transposed flat layout, where a column is `rows` consecutive elements
    (stage_1_and_2.initialize_gradient_partition, zenflow_stage_1_and_2.update_selected_channels). Empty for 1-D."""
    numels = [math.prod(s) for s in shapes]
    align = 2 * world
    psize = -(-sum(numels) // align) * align // world
    out, cur = [], 0
    for shape, n in zip(shapes, numels):
        offsets = sorted(0 if p * psize <= cur < (p + 1) * psize else p * psize - cur
                         for p in range(world) if p * psize <= cur < (p + 1) * psize or cur < p * psize < cur + n)
        pieces = []
        if len(shape) == 2:
            rows = shape[0]
            for i, off in enumerate(offsets):
                end = offsets[i + 1] if i + 1 < len(offsets) else n
                pieces.append((0 if not off else (off - 1) // rows + 1, end // rows))
        out.append(pieces)
        cur += n
    return out


def ds3_column_pieces(shape: tuple[int, ...], world: int) -> list[tuple[int, int]]:
    """DeepSpeed ZeRO-3's partition of one parameter (ceil(numel / world) elements per rank, in ZenFlow's transposed
    layout): the (first, end) whole columns of each rank's part (engine_stage3.update_selected_channels). Empty for
    1-D."""
    if len(shape) != 2:
        return []
    rows, n = shape[0], math.prod(shape)
    size = -(-n // world)
    return [(-(-(r * size) // rows), min((r + 1) * size, n) // rows) for r in range(world) if r * size < n]


def cpu_step_threads(placed: int, pt_reserved_cores_perc: float, overlap: bool, knob_set: bool) -> int:
    """The CPU step's threads, from the `placed` threads of this rank's slice (host.place_cpu_step): with
    overlap_step, DeepSpeed's split of the n cores (zenflow_utils._split_affinity): ceil(pt_reserved_cores_perc x n)
    stay with the training thread, the rest step Adam, and both share all n where that rounds to 0 or n. Without
    overlap the step runs alone, on every thread; the knob offload_threads (knob_set) is taken as it is."""
    if knob_set or not overlap:
        return placed
    reserved = math.ceil(pt_reserved_cores_perc * placed)
    return placed - reserved if 0 < reserved < placed else placed


def num_selected(columns: int, ratio: float) -> int:
    return 0 if columns <= 0 else max(1, int(columns * ratio))


def select_columns(colsum: torch.Tensor, pieces: list[tuple[int, int]], ratio: float,
                   per_piece: bool = True) -> torch.Tensor:
    """The selected column indices, ascending: the top num_selected of each piece's columns by |grad| sum (ZeRO 1/2),
    or of all the pieces' columns together (per_piece=False: ZeRO 3, which gathers the whole columns' sums)."""
    if not per_piece:
        candidates = torch.cat([torch.arange(a, e, device=colsum.device) for a, e in pieces if e > a] or
                               [torch.zeros(0, dtype=torch.long, device=colsum.device)])
        k = num_selected(candidates.numel(), ratio)
        return candidates[torch.topk(colsum[candidates], k).indices].sort().values if k else candidates
    picked = []
    for first, end in pieces:
        k = num_selected(end - first, ratio)
        if k:
            picked.append(torch.topk(colsum[first:end], k).indices.sort().values + first)
    return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long, device=colsum.device)


@torch.no_grad()
def adamw_many_(ps, gs, ms, vs, t: float, *, lr, beta1, beta2, eps, weight_decay) -> None:
    """torch's single-tensor AdamW (ZenFlowSelectiveAdamW's `adamw`) on lists of tensors at one step count t
    (already counted), its operations in its order, by foreach kernels: on a GPU one launch covers many tensors, and
    the selective step of a model's ~150 slices would otherwise be bound by launching ~8 kernels per slice."""
    torch._foreach_mul_(ps, 1 - lr * weight_decay)
    torch._foreach_lerp_(ms, gs, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, (1 - beta2 ** t) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(ps, ms, denom, value=-(lr / (1 - beta1 ** t)))


CHUNK = 1 << 24   # elements per round-trip chunk (64 MiB of fp32 staging, 32 MiB of bf16, twice)
DEVICE, HOST, SELECTIVE = "device", "host", "selective"
# Where each tensor of a slot lives: DEVICE is the parameter's device, HOST the CPU (pinned with an accelerator),
# SELECTIVE the device, or the CPU with zenflow.offload. ZenFlowGradPath.resident_bytes() counts by it.
PLACEMENT = {"master": HOST, "m": HOST, "v": HOST, "acc": HOST, "out": HOST, "selected": DEVICE,
             "sel_m": SELECTIVE, "sel_v": SELECTIVE, "sel_step": HOST, "sel_grad": DEVICE, "temp": SELECTIVE}


class _DeviceRoundTrip:
    """With an accelerator, each step's gradient joins the host-resident accumulation on the device: per chunk of
    CHUNK elements, the sum comes in (H2D, on one side stream), the gradient is added and the sum goes back (D2H, on
    a second), through two staging buffers, so chunk c+1 comes in while chunk c goes out (DeepSpeed's
    async_accumulate_grad_in_cpu_via_gpu, per parameter, on one stream). An interval's first gradient only goes out.
    Each FSDP unit's gradients are queued behind its reduce-scatter, during backward, the rest at finish_gradients;
    it runs on beside the step and the next forward. The gradients stay allocated until it ends (record_stream),
    `done` marks its end, and the next step's begin() waits for it on the host."""

    def __init__(self, device: torch.device, numel: int, dtype: torch.dtype = torch.float32):
        self.stage = [torch.empty(min(CHUNK, numel), dtype=dtype, device=device) for _ in range(2)]
        self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.freed: list = [None, None]   # per staging buffer: its last D2H is done
        self.j = 0                        # the staging buffer next in turn
        self.sq = self.done = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stage)

    def begin(self, norm: bool) -> None:
        """A step's round trip starts (with norm: the sum of squares of its new sums, float64, on the device)."""
        self.wait()   # one step's round trip at a time: a late one holds its gradients, and would pile them up
        self.h2d.wait_stream(self.d2h)
        with torch.cuda.stream(self.d2h):
            self.sq = torch.zeros((), dtype=torch.float64, device=self.stage[0].device) if norm else None

    def add(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], fresh: bool, scale: float, event) -> None:
        """acc (host) = g x scale (fresh) or acc + g x scale, per (acc, g), once `event` (else the current stream)
        has the gradients final."""
        cur = torch.cuda.current_stream()
        if event is not None:
            self.d2h.wait_event(event)
        if event is None or any(not g.is_contiguous() for _, g in pairs):
            self.d2h.wait_stream(cur)   # (a reshape below copies on the current stream)
        pairs = [(acc.view(-1), g.reshape(-1)) for acc, g in pairs]
        j, sq = self.j, self.sq
        for acc, g in pairs:
            g.record_stream(self.d2h)
            for a in range(0, acc.numel(), CHUNK):
                b = min(a + CHUNK, acc.numel())
                st = self.stage[j][:b - a]
                if not fresh:
                    with torch.cuda.stream(self.h2d):
                        if self.freed[j] is not None:
                            self.h2d.wait_event(self.freed[j])
                        st.copy_(acc[a:b], non_blocking=True)
                        loaded = torch.cuda.Event()
                        loaded.record(self.h2d)
                    self.d2h.wait_event(loaded)
                with torch.cuda.stream(self.d2h):
                    part = g[a:b] if scale == 1.0 else g[a:b] * scale   # (in the gradient's dtype, as a scaled loss)
                    if fresh:
                        st.copy_(part)
                    else:
                        st.add_(part)
                    if sq is not None:
                        sq += st.double().square().sum()
                    acc[a:b].copy_(st, non_blocking=True)
                    self.freed[j] = torch.cuda.Event()
                    self.freed[j].record(self.d2h)
                j ^= 1
        self.j = j

    def end(self) -> torch.Tensor | None:
        self.done = torch.cuda.Event()
        self.done.record(self.d2h)
        sq, self.sq = self.sq, None
        return sq

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


class _Slot:
    """One trainable parameter: its CPU masters and moments, and its selective state on the device."""

    def __init__(self, name: str, param: nn.Parameter, group: dict, sets: int, sel_device: torch.device,
                 acc_dtype: torch.dtype = torch.float32):
        self.name, self.param, self.group = name, param, group
        local = local_tensor(param)
        self.matrix = param.ndim == 2
        self.master = local.detach().to("cpu", torch.float32, copy=True)
        self.m = [torch.zeros_like(self.master) for _ in range(sets)]
        self.v = [torch.zeros_like(self.master) for _ in range(sets)]
        self.pin = local.device.type == "cuda"
        # the accumulated gradient, on the host and in the gradient's dtype as DeepSpeed's (pinned: the round trip's
        # copies are asynchronous); with overlap_step the CPU step reads one set while the next interval fills the other
        self.acc = [torch.zeros(local.shape, dtype=acc_dtype, pin_memory=self.pin) for _ in range(sets)]
        self.out = None
        self.pieces: list[tuple[int, int]] = []
        self.selected: torch.Tensor | None = None      # column indices (matrices); a fixed count (allocate)
        self.sel_m = self.sel_v = None
        self.sel_step = torch.zeros((), dtype=torch.float32)
        self.sel_device = sel_device                    # offload: the CPU
        self.sel_grad = self.temp = None

    def allocate(self, ratio: float, dtype: torch.dtype, per_piece: bool = True) -> None:
        """The selection's tensors: their sizes are fixed by the pieces (so a checkpoint loads in place). And the CPU
        step's result in the device dtype, written by the fused kernel in its pass (out=): what lands on the device
        (with overlap_step: DeepSpeed's stale snapshot, landing one interval late)."""
        local = local_tensor(self.param)
        self.out = torch.empty(self.master.shape, dtype=dtype, pin_memory=self.pin)
        if self.matrix:
            count = sum(num_selected(end - first, ratio) for first, end in self.pieces) if per_piece else \
                num_selected(sum(max(0, end - first) for first, end in self.pieces), ratio)
            self.selected = torch.zeros(count, dtype=torch.long, device=local.device)
            shape = (local.shape[0], count)
        else:
            shape = tuple(local.shape)
        self.sel_m = torch.zeros(shape, dtype=dtype, device=self.sel_device)
        self.sel_v = torch.zeros_like(self.sel_m)


class ZenFlowGradPath(GradPath):
    """The ZenFlow gradient path (module docstring). The engine's clip factor is not applied: DeepSpeed's selective
    step takes the raw gradient and its CPU step clips the accumulated one by that one's norm. grad_norm() is the
    step's gradient norm (overflow checks and reporting)."""

    name = "zenflow"

    def __init__(self, model: nn.Module, named: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer,
                 plan, threads: int | None = None, acc_dtype: torch.dtype = torch.float32):
        zf = plan.zenflow
        self.model, self.optimizer, self.zf = model, optimizer, zf
        self.max_norm = plan.batch.gradient_clipping
        self.adamw = isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.param_groups[0].get(
            "decoupled_weight_decay"))
        self.k = -1                    # the ZenFlow step (DeepSpeed's micro_step)
        self.fresh = True              # the next gradient starts a new accumulation
        self.after_warmup = 0          # update boundaries at k >= W so far (overlap: which ones land a result)
        self.pending = None            # overlap: the CPU step in flight (a Future)
        self.pending_buf = 0           # the accumulation set it reads
        self.refresh_on_load = True
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        sets = 2 if zf.overlap_step else 1
        dev = local_tensor(named[0][1]).device
        self.slots = [_Slot(n, p, group_of[id(p)], sets, torch.device("cpu") if zf.offload else dev, acc_dtype)
                      for n, p in named]
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.per_piece = plan.shard.stage != 3   # ZeRO 3 partitions each parameter on its own, and picks globally
        for g in optimizer.param_groups:   # ZeRO 1/2 partition each param group on its own
            members = [s for s in self.slots if s.group is g]
            for s, pieces in zip(members, ds_column_pieces([tuple(s.param.shape) for s in members], world)):
                s.pieces = pieces if self.per_piece else ds3_column_pieces(tuple(s.param.shape), world)
        self.sumsq = None              # the accumulated gradient's sum of squares, at an update boundary (clipping)
        self.scale = 1.0 / zf.update_interval   # DeepSpeed's loss / gradient_accumulation_steps, on each read
        self.open = False              # this step's gradients have begun to join the accumulation
        self.queued: set[int] = set()  # the slots whose gradient has joined it this step
        self.buf = 0                   # the accumulation set of the step that is open
        self.roundtrip = _DeviceRoundTrip(dev, max(s.master.numel() for s in self.slots), acc_dtype) \
            if dev.type == "cuda" else None
        self.threads = threads
        self.adam_args: dict[str, Any] = {}   # the CPU Adam kernel's knobs (build: Tuning.cpu_adam_args)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="zenflow-cpu-adam") if zf.overlap_step else None
        model.register_load_state_dict_post_hook(lambda *_: self.refresh_masters())

    @classmethod
    def build(cls, model: nn.Module, plan, make_optimizer: Callable, mesh=None, *, tuning=None) -> "ZenFlowGradPath":
        """Masters taken in fp32 from the FSDP2 shards, then the device shards cast to the param dtype (DeepSpeed
        keeps 16-bit weights on the device); the configured Adam/AdamW only holds the hyper-parameters."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimizer = make_optimizer([p for _, p in named])
        if not isinstance(optimizer, torch.optim.Adam):
            raise ValueError(f"zero_optimization.zenflow with a {type(optimizer).__name__} optimizer: ZenFlow's steps "
                             "are Adam/AdamW; use optimizer.type AdamW")
        bad = [n for n, p in named if p.ndim > 2]
        if bad:
            raise ValueError(f"zero_optimization.zenflow: parameter {bad[0]} has {dict(named)[bad[0]].ndim} dimensions; "
                             "ZenFlow selects columns of matrices and updates vectors whole")
        knobs = or_defaults(tuning)
        placement = place_cpu_step(knobs)   # as the offload path's CPU step; before the masters are first touched
        threads = cpu_step_threads(placement.threads or torch.get_num_threads(), plan.zenflow.pt_reserved_cores_perc,
                                   bool(plan.zenflow.overlap_step), knobs.offload_threads is not None)
        # the CPU Adam op is JIT-built now, as the offload path builds it, not in the first CPU step: that one runs
        # overlapped, and a fresh host's compile would stall the step that waits for it (likely S15's 8 s step 7)
        build_cpu_adam_op(knobs)
        low = DTYPES[plan.precision.param_dtype]
        # the gradients come in the device weights' dtype (16-bit with bf16), and are summed in it, as DeepSpeed's
        # accumulated_grads_in_cpu (grad_accum_dtype unset: the model's dtype): 2 bytes a parameter each way a step
        path = cls(model, named, optimizer, plan, threads, acc_dtype=low)
        path.adam_args = knobs.cpu_adam_args()
        if low != torch.float32:
            model.to(low)   # FSDP2 re-registers the shards: take the parameter objects again
            now = dict(model.named_parameters())
            for s in path.slots:
                s.param = now[s.name]
        for s in path.slots:
            s.allocate(plan.zenflow.topk_ratio, low, path.per_piece)
        for unit in fsdp2_internals.fsdp_units(model):   # each unit's gradients join the accumulation once reduced
            fsdp2_internals.after_reduce(unit, lambda event, u=unit: path._unit_reduced(u, event))
        if not dist.is_initialized() or dist.get_rank() == 0:
            why = "knob offload_threads" if knobs.offload_threads is not None else \
                f"pt_reserved_cores_perc {plan.zenflow.pt_reserved_cores_perc:g}" if plan.zenflow.overlap_step else \
                "sequential: every thread of the slice"
            logging.getLogger("fsdpzero").info("zenflow: CPU step %d threads (%s)", threads, why)
        return path

    def resident_bytes(self) -> dict[str, int]:
        """The bytes of every tensor the path holds, by where it lives ("device" or "host"; PLACEMENT), the model's
        parameters and gradients aside. A tensor attribute PLACEMENT does not name is an error, and so (with an
        accelerator) is one that is not where PLACEMENT says."""
        out = {DEVICE: 0, HOST: 0}
        accelerator = self.roundtrip is not None
        for s in self.slots:
            for name, value in vars(s).items():
                tensors = [t for t in (value if isinstance(value, (list, tuple)) else [value])
                           if isinstance(t, torch.Tensor)]
                if not tensors or name == "param":
                    continue
                if name not in PLACEMENT:
                    raise KeyError(f"ZenFlow slot tensor {name!r} has no PLACEMENT")
                where = PLACEMENT[name]
                if where == SELECTIVE:
                    where = HOST if self.zf.offload else DEVICE
                if accelerator and any((t.device.type == "cpu") != (where == HOST) for t in tensors):
                    raise AssertionError(f"ZenFlow slot tensor {name!r} is not on the {where}")
                out[where] += sum(t.numel() * t.element_size() for t in tensors)
        out[DEVICE] += self.staging_bytes
        return out

    @property
    def staging_bytes(self) -> int:
        return self.roundtrip.nbytes if self.roundtrip is not None else 0

    # -- the schedule ---------------------------------------------------------------------------------------------

    def _select_boundary(self, k: int) -> bool:
        W, S = self.zf.full_warm_up_rounds, self.zf.select_interval
        return k - W >= 0 and (k == W or (S != 0 and k % S == 0))

    def _update_boundary(self, k: int) -> bool:
        W, S, U = self.zf.full_warm_up_rounds, self.zf.select_interval, self.zf.update_interval
        return k + 1 < W or (k + 1 - W) % U == 0 or (S != 0 and (k + 1) % S == 0)

    def _state(self, k: int) -> int:
        """Which gradient buffer and moment set (overlap: DeepSpeed's get_overlap_step_state)."""
        if not self.zf.overlap_step:
            return 0
        W, U = self.zf.full_warm_up_rounds, self.zf.update_interval
        return k & 1 if k < W else (k // U) & 1

    # -- GradPath ------------------------------------------------------------------------------------------------

    def set_sync(self, sync: bool) -> None:
        """Before each backward (the engine's): one whose gradients already joined the accumulation has had no
        step(), so this one's would miss it."""
        if self.open:
            raise RuntimeError("zero_optimization.zenflow: a second backward before step(); ZenFlow takes one "
                               "backward per step (call engine.step() after every engine.backward())")
        self.model.set_requires_gradient_sync(sync)

    @torch.no_grad()
    def _unit_reduced(self, unit: nn.Module, event) -> None:
        """An FSDP unit's post-backward has reduced its gradients (complete at `event`): they join the
        accumulation now, during backward."""
        mine = {id(fp.sharded_param) for fp in fsdp2_internals.fsdp_params(unit)}
        self._accumulate([i for i, s in enumerate(self.slots) if id(s.param) in mine and s.param.grad is not None],
                         event)

    def _accumulate(self, indices: list[int], event=None) -> None:
        """The gradients of these slots, times 1/update_interval, join the accumulation of the step being computed
        (opened by the first of them: its set, a CPU step in flight on that set joined, the clip norm's sum)."""
        if not self.open:
            k = self.k + 1   # finish_gradients counts it
            self.buf = self._state(k)
            if self.pending is not None and self.pending_buf == self.buf:   # the CPU step in flight reads this set
                self._join()                                                 # (DeepSpeed's state order, warm-up)
            norm = self.max_norm > 0 and self._update_boundary(k)
            if self.roundtrip is not None:
                self.roundtrip.begin(norm)
            else:
                self.sumsq = torch.zeros((), dtype=torch.float64) if norm else None
            self.open, self.queued = True, set()
        indices = [i for i in indices if i not in self.queued]   # FSDP2 may run a unit's post-backward again
        self.queued.update(indices)
        pairs = [(self.slots[i].acc[self.buf], local_tensor(self.slots[i].param.grad)) for i in indices]
        if self.roundtrip is not None:
            self.roundtrip.add(pairs, self.fresh, self.scale, event)
            return
        for acc, g in pairs:
            g = g if self.scale == 1.0 else g * self.scale
            if self.fresh:
                acc.copy_(g)
            else:
                acc.add_(g)
            if self.sumsq is not None:
                self.sumsq += acc.double().square().sum()

    @torch.no_grad()
    def finish_gradients(self) -> None:
        for s in self.slots:
            if s.param.grad is None:
                s.param.grad = torch.zeros_like(s.param)
        rest = [i for i in range(len(self.slots)) if not (self.open and i in self.queued)]
        if rest or not self.open:
            self._accumulate(rest)
        if self.roundtrip is not None:
            self.sumsq = self.roundtrip.end()
        self.open, self.fresh = False, False
        self.k += 1
        k, W = self.k, self.zf.full_warm_up_rounds
        grads = [local_tensor(s.param.grad) for s in self.slots]   # unscaled: the ranking does not change
        if self._select_boundary(k):
            self._join()   # the masters are rewritten: a CPU step still running lands first
            if k != 0:
                for s in self.slots:
                    s.master.copy_(local_tensor(s.param).detach())
            self._select(grads)
            for s in self.slots:   # the moments restart (DeepSpeed's clear_selected_mv; the step count goes on)
                s.sel_m.zero_()
                s.sel_v.zero_()
        if k >= W:   # one foreach multiply for all the slices (adamw_many_'s reason)
            picked = torch._foreach_mul([g[:, s.selected] if s.matrix else g for s, g in zip(self.slots, grads)],
                                        self.scale)
            for s, g in zip(self.slots, picked):
                s.sel_grad = g

    def _select(self, grads: list[torch.Tensor]) -> None:
        """The top columns of each matrix, from its whole columns' |grad| sums (FSDP2 shards rows: each rank sums
        its rows, one all-reduce adds them)."""
        matrices = [(s, g) for s, g in zip(self.slots, grads) if s.matrix]
        if not matrices:
            return
        sums = [g.abs().sum(dim=0, dtype=torch.float32) for _, g in matrices]
        flat = torch.cat(sums)
        if dist.is_initialized() and dist.get_world_size() > 1 and hasattr(matrices[0][0].param, "device_mesh"):
            dist.all_reduce(flat)
        offset = 0
        for (s, _), colsum in zip(matrices, sums):
            n = colsum.numel()
            s.selected.copy_(select_columns(flat[offset:offset + n], s.pieces, self.zf.topk_ratio, self.per_piece))
            offset += n

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm([s.param for s in self.slots]) * self.scale   # the scaled step's gradient

    def scale_grads_(self, factor) -> None:
        pass   # see the class docstring: DeepSpeed clips only the accumulated gradient, by its own norm

    def can_skip_on_device(self) -> bool:
        return False

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        k, W = self.k, self.zf.full_warm_up_rounds
        if not self._update_boundary(k):
            if k >= W:
                self._selective_step(restore=False)
            return
        if k >= W:
            for s in self.slots:   # DeepSpeed's temp_copy_param: the device values the CPU result will overwrite
                local = local_tensor(s.param)   # (zenflow.offload: on the CPU, as DeepSpeed's)
                s.temp = local[:, s.selected].to(s.sel_device) if s.matrix else local.to(s.sel_device, copy=True)
        self._cpu_boundary(k)
        if k + 1 >= W:
            self._selective_step(restore=k >= W)
        self.fresh = True

    def _selective_step(self, restore: bool) -> None:
        """AdamW on the selected columns (whole vectors), all slots of one hyper-parameter set and step count at
        once (adamw_many_)."""
        work, sets = [], {}
        for s in self.slots:
            if s.sel_grad is None:
                continue
            local = local_tensor(s.param)
            p = local[:, s.selected] if s.matrix else local
            if restore:
                p.copy_(s.temp)
            m, v = s.sel_m.to(local.device), s.sel_v.to(local.device)
            s.sel_step += 1
            h = s.group
            key = (h["lr"], h["betas"][0], h["betas"][1], h["eps"], h["weight_decay"], s.sel_step.item())
            sets.setdefault(key, []).append((p, s.sel_grad, m, v))
            work.append((s, local, p, m, v))
        for (lr, beta1, beta2, eps, weight_decay, t), tensors in sets.items():
            ps, gs, ms, vs = (list(x) for x in zip(*tensors))
            adamw_many_(ps, gs, ms, vs, t, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        for s, local, p, m, v in work:
            if s.matrix:
                local[:, s.selected] = p
            if s.sel_device != local.device:   # offload: the moments go back to the CPU
                s.sel_m.copy_(m)
                s.sel_v.copy_(v)
            s.sel_grad = s.temp = None

    def _reduce_sumsq(self) -> tuple[torch.Tensor | None, Any]:
        """On the main thread (a collective, in every rank's order): the accumulated gradient's sum of squares summed
        over the ranks; with an accelerator, behind the round trip on its stream, and the event after which the sum
        and the host accumulation are complete (waited for by whoever steps on the CPU)."""
        rt = self.roundtrip
        with torch.cuda.stream(rt.d2h) if rt is not None else contextlib.nullcontext():
            if self.sumsq is not None and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(self.sumsq)
            ready = None
            if rt is not None:
                ready = torch.cuda.Event()
                ready.record(rt.d2h)
        return self.sumsq, ready

    def _clip_scale(self, sq: torch.Tensor | None, ready) -> float:
        """DeepSpeed's unscale_and_clip_grads factor for the accumulated gradient: 1 / max(1, (norm + 1e-6) / clip)."""
        if ready is not None:
            ready.synchronize()
        if sq is None:
            return 1.0
        norm = float(sq.sqrt())
        return 1.0 / max(1.0, (norm + 1e-6) / self.max_norm)

    def _hyper(self) -> list[dict]:
        """Each slot's hyper-parameters now, on the main thread: the engine steps the LR scheduler right after
        step(), while an overlapped CPU step may still be running (as offload/path.py takes them at step())."""
        return [{k: s.group[k] for k in ("lr", "betas", "eps", "weight_decay")} for s in self.slots]

    def _cpu_step(self, k: int, buf: int, norm: tuple, hyper: list[dict]) -> None:
        """The CPU Adam step on the host accumulation `buf`, once the round trip has landed it (norm: _reduce_sumsq's
        pair)."""
        from fsdpzero_ops.cpu_adam import adam_step_
        if self.threads is not None:   # per thread: the overlapped step's worker sets its own
            torch.set_num_threads(self.threads)
        scale = self._clip_scale(*norm)
        for s, h in zip(self.slots, hyper):
            adam_step_(s.master, s.acc[buf], s.m[buf], s.v[buf], s.out, lr=h["lr"], beta1=h["betas"][0],
                       beta2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"], step=k + 1,
                       adamw=self.adamw, grad_scale=scale, **self.adam_args)

    def _land(self) -> None:
        """The CPU step's result (in the device dtype) replaces the device weights."""
        for s in self.slots:
            local_tensor(s.param).copy_(s.out.view(local_tensor(s.param).shape), non_blocking=True)
        if self.slots[0].pin:   # the next CPU step rewrites the buffers these copies read
            torch.cuda.current_stream().synchronize()

    def _cpu_boundary(self, k: int) -> None:
        buf, W = self._state(k), self.zf.full_warm_up_rounds
        norm = self._reduce_sumsq()
        if not self.zf.overlap_step or k < W:   # sequential, or a warm-up round: synchronous
            self._join()
            self._cpu_step(k, buf, norm, self._hyper())
            self._land()
            return
        self.after_warmup += 1
        first_landing = 3 if W == 0 else 2   # DeepSpeed: no process before the first submit, one skipped wait
        self._join()
        if self.after_warmup >= first_landing:
            self._land()
        self.pending = self.executor.submit(self._cpu_step, k, buf, norm, self._hyper())
        self.pending_buf = buf

    def _join(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def _settle(self) -> None:
        """No CPU step running and no round trip in flight: the host accumulation may be read or written."""
        self._join()
        if self.roundtrip is not None:
            self.roundtrip.wait()

    def zero_grad(self) -> None:
        for s in self.slots:
            s.param.grad = None

    def close(self) -> None:
        self._settle()
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def refresh_masters(self) -> None:
        """The model's load_state_dict post-hook: weights loaded without the optimizer become the masters."""
        if self.refresh_on_load:
            self._join()
            for s in self.slots:
                s.master.copy_(local_tensor(s.param).detach())

    @contextlib.contextmanager
    def keep_masters_on_load(self):
        self.refresh_on_load = False
        try:
            yield
        finally:
            self.refresh_on_load = True

    def _shard(self, s: _Slot, local: torch.Tensor, columns: int | None = None):
        """`local` (rows of s.param's shard) as a DTensor placed like the param, so DCP saves each rank's own."""
        p = s.param
        if not hasattr(p, "device_mesh"):
            return local
        from torch.distributed.tensor import DTensor
        if columns is None:
            return DTensor.from_local(local.view(local_tensor(p).shape), p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride(), run_check=False)
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=(p.shape[0], columns),
                                  stride=(columns, 1), run_check=False)

    def state_dict(self, streaming: bool = False) -> dict[str, Any]:
        """Per parameter: the fp32 master, the CPU Adam moments (two sets with overlap_step), the gradient
        accumulated so far (and the result of a CPU step not yet landed), the selected columns and their moments;
        plus the schedule's counters. Live tensors: DCP loads into them in place."""
        self._settle()
        state = {}
        for s in self.slots:
            cols = int(s.selected.numel()) if s.matrix else None
            entry = {MASTER: self._shard(s, s.master), "step": torch.tensor(float(self.k + 1)),
                     "sel_step": s.sel_step,
                     "sel_exp_avg": self._shard(s, s.sel_m, cols), "sel_exp_avg_sq": self._shard(s, s.sel_v, cols)}
            for i in range(len(s.m)):
                tail = "" if i == 0 else f"_{i}"
                entry["exp_avg" + tail] = self._shard(s, s.m[i])
                entry["exp_avg_sq" + tail] = self._shard(s, s.v[i])
                entry["grad_accum" + tail] = self._shard(s, s.acc[i])
            if self.zf.overlap_step:
                entry["stale"] = self._shard(s, s.out)
            if s.matrix:
                entry["selected"] = s.selected
            state[s.name] = entry
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [s.name for s in self.slots if s.group is g]} for g in self.optimizer.param_groups]
        counters = torch.tensor([self.k, int(self.fresh), self.after_warmup], dtype=torch.long)
        return {"state": state, "param_groups": groups, "schedule": counters}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._settle()
        if "schedule" not in sd:
            raise ValueError("this checkpoint was not saved with zero_optimization.zenflow: its optimizer state has "
                             "no ZenFlow entries; load it with load_optimizer_states=False (the weights become the "
                             "masters) or without the zenflow section")
        self.k, fresh, self.after_warmup = (int(x) for x in sd["schedule"])
        self.fresh = bool(fresh)
        for s in self.slots:
            saved = sd["state"][s.name]
            s.master.copy_(local_tensor(saved[MASTER]).view(s.master.shape))
            for i in range(len(s.m)):
                tail = "" if i == 0 else f"_{i}"
                s.m[i].copy_(local_tensor(saved["exp_avg" + tail]).view(s.m[i].shape))
                s.v[i].copy_(local_tensor(saved["exp_avg_sq" + tail]).view(s.v[i].shape))
                s.acc[i].copy_(local_tensor(saved["grad_accum" + tail]).view(s.acc[i].shape))
            if self.zf.overlap_step:
                s.out.copy_(local_tensor(saved["stale"]).view(s.out.shape))
            if s.matrix:
                s.selected.copy_(saved["selected"])
            s.sel_m.copy_(local_tensor(saved["sel_exp_avg"]).view(s.sel_m.shape))
            s.sel_v.copy_(local_tensor(saved["sel_exp_avg_sq"]).view(s.sel_v.shape))
            s.sel_step.copy_(saved["sel_step"])
        for g, saved in zip(self.optimizer.param_groups, sd.get("param_groups", [])):
            g.update({k: v for k, v in saved.items() if k != "params"})
