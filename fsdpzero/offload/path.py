"""ZeRO-Offload on FSDP2: `offload_optimizer.device: cpu` (stages 1-3) and, with it, `offload_param.device: cpu`.

The gradient path for the engine (contract: fsdpzero.optim.GradPath). The model arrives fully_shard-ed (lay_out is
GradPath's); OffloadGradPath.build (below; its steps in fsdpzero/offload/prepare.py) keeps, for every local shard,
an fp32 master and the Adam states in CPU memory, and the path steps them with the fused CPU Adam of
ops/csrc/cpu_adam.cpp, which reads the low-precision gradient and writes the low-precision param in the same pass.
The device keeps only low-precision shards (`model.to(param_dtype)` after the masters are taken).

One optimizer step, with params on an accelerator:
    backward          as each FSDP unit's reduce-scatter is issued (its post-backward), D2H of its sharded grads on
                      a side stream behind it, one event per chunk (a chunk: one FSDP unit's params,
                      <= sub_group_size and <= CHUNK elements; units in forward order, root first). Stage-2 units
                      have already freed their device shards after forward (the pinned out buffers hold them).
    finish_gradients  D2H of whatever was not hooked
    grad_norm         from the device grads (global, collective) while the copies run
    scale_grads_      nothing is touched: 1/loss_scale and the clip coefficient are folded into the kernel's read
    step              device-stepped chunks (offload_optimizer.ratio < 1) first, with torch's fused Adam; then for
                      each CPU chunk: wait its D2H, CPU step into pinned low-precision buffers, queue the H2D on a
                      second side stream, so the copy of chunk k overlaps the step of chunk k+1
Clipping and fp16 overflow: the norm is taken on the device from the reduced shards *before* any CPU step, so a
skipped step (inf/nan) never touches the masters and clipping is exact; the cost is that the CPU step cannot start
until backward has finished (no speculative stepping).

With `offload_param: cpu` (stage 3, FSDP2 CPUOffloadPolicy, set by sharding.shard_model) the shards and their grads
already live on the CPU: nothing is copied, the kernel reads the CPU grad and writes the param shard in place. The
shards are cast to the low-precision dtype, so FSDP2's per-all-gather H2D carries 2 bytes/param instead of 4.

Overlap (the default, knob offload_overlap): step() returns at once and a worker thread steps the chunks while the
next forward runs; a pre-forward hook on each FSDP unit waits for that unit's chunks, and every read of the weights
outside a forward waits for the whole step (fsdpzero/offload/access.py). Exact: the clip factor and the skip
decision are known before step() starts it.

Threads: torchrun sets OMP_NUM_THREADS=1, which makes the CPU step ~6x slower. With an accelerator each local rank
gets its own slice of whole cores and one CPU step thread per CPU of it (fsdpzero/host.py; knobs offload_threads and
offload_bind override). Knobs: fsdpzero/tuning.py (FSDPZERO_OFFLOAD_*).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
from torch import nn

from fsdpzero import fsdp2_internals
from fsdpzero.offload import device_step
from fsdpzero.offload import prepare
from fsdpzero.offload.access import guard_reads
from fsdpzero.offload.chunks import (Chunk, Entry, on_stream, chunk_layout, load_offload_state_dict,
                                     offload_state_dict)
from fsdpzero.offload.prepare import Masters, Pipeline, Speculation
from fsdpzero.offload.timeline import Timeline
from fsdpzero.dist import local_tensor
from fsdpzero.host import build_cpu_adam_op
from fsdpzero.optim.factory import OptimizerFactory
from fsdpzero.optim.grad_path import GradPath
from fsdpzero.plan import Plan
from fsdpzero.precision import DTYPES
from fsdpzero.tuning import Tuning, or_defaults

log = logging.getLogger("fsdpzero")

class OffloadGradPath(GradPath):
    """fsdpzero.optim.GradPath with fp32 masters and Adam states on the CPU (see the module docstring).

    `units` are the FSDP modules in forward order (root first), each with its entries; chunks never span two units.
    With `overlap`, step() hands the chunk loop to a worker thread and returns: a forward pre-hook on each unit
    waits for that unit's chunks (and those of the units it prefetches), so the next forward starts as soon as
    its first parameters are updated while the CPU steps the rest."""

    name = "offload"
    on_disk = False   # masters and moments in memory (NVMeGradPath: on disk)

    @classmethod
    def build(cls, model: nn.Module, plan: Plan, make_optimizer: OptimizerFactory, mesh=None, *,
              tuning: Tuning | None = None, stage: bool | None = None,
              overlap: bool | None = None) -> "OffloadGradPath":
        """The path over the fully_shard-ed model, in named steps (fsdpzero/offload/prepare.py). `stage` forces
        (True) or forbids (False) staging through pinned CPU buffers; default: stage exactly when the shards live on
        an accelerator. `overlap`: step the CPU side in a worker thread while the next forward runs (default: the
        offload_overlap knob, on). `tuning`: the engine's knobs (called without them: the process defaults)."""
        knobs = or_defaults(tuning)
        if prepare.check_plan(plan) != cls.on_disk:
            raise ValueError(f"{cls.__name__} cannot run offload_optimizer.device = "
                             f"{plan.offload.optimizer_device!r}: build the path fsdpzero.api.grad_path_type names")
        named = prepare.trainable(model)
        build_cpu_adam_op(knobs)
        on_accel = local_tensor(named[0][1]).device.type != "cpu"   # else CPU-only, or offload_param's CPU shards
        stage = on_accel if stage is None else stage
        threads = prepare.cpu_step_threads(knobs)
        if plan.offload.cpuadam_cores_perc is not None and knobs.offload_threads is None:
            # super_offload: DeepSpeed gives PyTorch int((1 - cpuadam_cores_perc) * n) of the n cores, CPU Adam the rest
            threads = max(1, threads - int((1 - plan.offload.cpuadam_cores_perc) * threads))
        pin, low = prepare.copy_buffers_pinned(), DTYPES[plan.precision.param_dtype]
        muon = plan.optimizer.type == "muon"   # Muon's CPU step (fsdpzero/offload/muon.py); never speculative
        if muon:
            from fsdpzero.offload.muon import muon_groups
        hyper = (muon_groups if muon else prepare.adam_groups)(make_optimizer, [p for _, p in named])   # model order
        units = prepare.forward_order(model, named)                           # then stepped in forward order
        chunk = prepare.chunk_size(plan)
        on_device = prepare.device_stepped_names(named, units, chunk, float(plan.offload.ratio), hyper)
        masters = prepare.take_masters(named, on_device, cls.on_disk, stage, on_accel, low, pin)
        master_of = {id(e.param): e.master for e in masters.entries}
        for g in hyper:
            g["params"] = [master_of[id(p)] for p in g["params"]]
        optimizer = cls.step_optimizer(hyper, masters, plan, knobs)
        if low != torch.float32 and (on_accel or not stage):
            prepare.cast_shards(model, masters.entries, low)
        cls.fill_out_buffers(masters.entries)
        by_name = {e.name: e for e in masters.entries}
        swap_params = prepare.swaps_params(plan, units)
        path = cls(model, optimizer, [(m, [by_name[n] for n in ns]) for m, ns in units], chunk,
                   prepare.pipeline(plan, knobs, threads=threads, staged=stage, on_disk=cls.on_disk,
                                    swap_params=swap_params, overlap=overlap),
                   prepare.speculation(plan, knobs, masters.entries, optimizer,
                                       no_speculation=cls.on_disk or swap_params or muon))
        if swap_params:
            path.param_swapper = prepare.swap_params_to_disk(model, plan, masters.entries, knobs)
        prepare.log_built(path, plan, pin)
        return path

    @classmethod
    def step_optimizer(cls, hyper: list[dict], masters: Masters, plan: Plan, knobs: Tuning):
        """The optimizer the path steps, over the masters: the fused CPU Adam (fsdpzero_ops.CPUAdam). It only holds
        the device-stepped masters' states (ratio < 1: state_dict, schedulers' groups); torch's Adam steps them."""
        from fsdpzero_ops import cpu_adam
        if any(g.get("use_muon") is not None for g in hyper):   # optimizer.type Muon
            from fsdpzero.offload.muon import CPUMuonWithAuxAdam
            optimizer = CPUMuonWithAuxAdam(hyper, **knobs.cpu_adam_args())
            optimizer.bind_params(masters.entries)
        else:
            optimizer = cpu_adam.CPUAdam(hyper, **knobs.cpu_adam_args())   # this engine's kernel choice
        for master, st in masters.device_states.items():
            optimizer.state[master] = st
        return optimizer

    @staticmethod
    @torch.no_grad()
    def fill_out_buffers(entries: list[Entry]) -> None:
        """The out buffer always holds the exact current (cast) shard: DroppableShards restores from it."""
        for e in entries:
            if e.out_buf is not None:
                e.out_buf.copy_(local_tensor(e.param))

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, units: list[tuple[nn.Module | None,
                 list[Entry]]], chunk_size: int, pipeline: Pipeline, speculation: Speculation | None = None):
        """The path's state over `units` (FSDP modules in forward order, root first, each with its entries), cut
        into chunks of at most `chunk_size` elements; then hook_units attaches it to the model."""
        self.model = model
        self.optimizer = optimizer          # a CPUAdam over the masters: schedulers drive its param_groups
        self.entries = [e for _, es in units for e in es]
        self._by_master = {id(e.master): e for e in self.entries}
        self._model_order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        self._unit_of = {id(e.master): m for m, es in units for e in es}
        self._unit_entries = [entries for _, entries in units]
        self._factor = 1.0
        self._hyper: dict[int, dict] = {}   # per master: the group's hyperparameters when step() was called
        self.threads = pipeline.threads
        self.staged = any(e.grad_buf is not None for e in self.entries)
        cuda = self.staged and self.entries[0].param.device.type == "cuda"
        self.d2h = torch.cuda.Stream() if cuda else None
        self.h2d = torch.cuda.Stream() if cuda else None
        self.param_swapper = None  # offload_param nvme: fsdpzero.offload.param_swapper.ParamSwapper (set by build)
        self.chunks: list[Chunk] = []
        self.unit_chunks: list[list[Chunk]] = []   # per unit, its chunks
        by_name = {e.name: e for e in self.entries}
        for unit, entries in units:
            first = len(self.chunks)
            for names in chunk_layout([[(e.name, e.master.numel()) for e in entries]], chunk_size):
                es = [by_name[n] for n in names]
                if len({e.on_device for e in es}) > 1:
                    raise ValueError("offload: a pipeline chunk mixes device- and CPU-stepped params")
                self.chunks.append(Chunk(unit=unit, entries=es, numel=sum(e.master.numel() for e in es)))
            self.unit_chunks.append(self.chunks[first:])
        self.cpu_chunks = [c for c in self.chunks if not c.entries[0].on_device]
        self.device_chunks = [c for c in self.chunks if c.entries[0].on_device]
        self._index = {id(c): k for k, c in enumerate(self.cpu_chunks)}
        self.overlap = pipeline.overlap and all(m is not None for m, _ in units)
        # speculation (None: none): step chunks during backward (fsdpzero.offload.speculate)
        self.spec = None
        if speculation is not None and self.staged and self.cpu_chunks:
            from fsdpzero.offload.speculate import Speculator
            self.spec = Speculator(self.cpu_chunks, optimizer, max_norm=speculation.max_norm, threads=self.threads,
                                   device=self.h2d.device if self.h2d is not None else None,
                                   budget_bytes=speculation.budget_bytes, spec_threads=speculation.threads,
                                   after_clip=speculation.after_clip)
            if not self.spec.covered:
                self.spec = None
        # norm_threads (offload_param: grads land on the host during backward): their sums of squares are taken
        # there, by a worker with that many threads (device_step.CpuNormPrefetch)
        self.norm_cache = (device_step.CpuNormPrefetch(pipeline.norm_threads, optimizer.build)
                           if pipeline.norm_threads and not self.staged else None)
        self.tl = (Timeline(self.threads, len(units), pipeline.profile_file)   # knob offload_profile
                   if pipeline.profile else None)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._sync = True
        self._rec = None                    # the timeline record of the step being stepped (profiling only)
        self._early: set[int] = set()       # chunks whose D2H was issued during this backward
        self._dropped: dict[int, fsdp2_internals.DroppableShards] = {}   # stage-2 units whose shards drop
        self._refresh_on_load = True        # off while a checkpoint with masters loads (keep_masters_on_load)
        self.reads = None                   # overlap: the ReadGuard of fsdpzero/offload/access.py
        self.hook_units([m for m, _ in units], pipeline)

    def hook_units(self, modules: list[nn.Module | None], pipeline: Pipeline) -> None:
        """Attach the path to the model, through torch's module hooks and FSDP2's post-reduce point
        (fsdp2_internals.after_reduce): per FSDP unit, the grads' D2H (and, offload_param, their sums of squares)
        right after its reduce-scatter, dropping and restoring stage-2 device shards around forward, and with the
        overlapped step a forward pre-hook waiting for the unit's chunks; on the model, masters refreshed from
        loaded weights, saves waiting for the step, and every other read of the weights waiting too
        (fsdpzero/offload/access.py)."""
        model = self.model
        # loading model weights (e.g. a module-only checkpoint) must reach the masters, or the next step would
        # write the old weights back; a following load_state_dict of the optimizer then restores exact fp32 masters
        model.register_load_state_dict_post_hook(lambda *_: self.refresh_masters() if self._refresh_on_load else None)
        model.register_state_dict_pre_hook(lambda *_: self.wait())   # saving reads the updated weights
        index = {id(m): i for i, m in enumerate(modules)}
        aheads: dict[int, list[int]] = {}
        for i, module in enumerate(modules):
            if module is None:
                continue
            # explicit forward prefetch (set_modules_to_forward_prefetch) unshards later units from this
            # unit's pre-forward: their chunks must be ready (and their shards present) too
            ahead = [index[id(m)] for m in fsdp2_internals.forward_prefetch_modules(module) if id(m) in index]
            aheads[i] = ahead
            mine = [c for c in self.unit_chunks[i] if not c.entries[0].on_device]
            if self.staged and mine and pipeline.early_d2h:   # D2H as soon as the unit's reduce-scatter is done
                fsdp2_internals.after_reduce(module, lambda event, cs=mine: self._d2h_unit(cs, event))
            if self.norm_cache is not None:
                fsdp2_internals.after_reduce(module, lambda event, m=module: self._sum_unit(m))
            if pipeline.drop_shards and self.staged and fsdp2_internals.keeps_unsharded(module) and \
                    all(e.out_buf is not None for e in self._unit_entries[i]):
                self._dropped[i] = fsdp2_internals.DroppableShards(module)
                module.register_forward_hook(lambda mod, *_, i=i: self._drop(i, mod))
            if self.overlap:
                waits = [c for j in [i, *ahead] for c in self.unit_chunks[j]]
                module.register_forward_pre_hook(self._make_wait_hook(module, waits, i), prepend=True)
        for i, module in enumerate(modules):   # prepended after the wait hooks: they run before them
            restore = [u for u in [i, *aheads.get(i, [])] if u in self._dropped]
            if restore:
                module.register_forward_pre_hook(lambda mod, *_, us=restore: self._restore(us, mod), prepend=True)
        if self.tl is not None:   # prepended last: runs before any wait hook, so the waits count in the step
            model.register_forward_pre_hook(lambda *_: self.tl.forward_start(), prepend=True)
        # overlap: between step() and the next forward the worker writes the weights; every other read waits
        if self.overlap:
            self.reads = guard_reads(model, self.pending, self.wait, self.optimizer)

    # -- device shards of stage-2 units: dropped after forward, back for the step (fsdp2_internals.DroppableShards) --
    def _drop(self, unit: int, module: nn.Module) -> None:
        if torch.is_grad_enabled() and module.training:   # a training forward: backward and a step follow
            self._dropped[unit].drop()

    def _restore(self, units: list[int], module: nn.Module | None) -> None:
        """Shards that are still dropped (no step since, e.g. a skipped step or an eval forward) come back from
        the out buffers, which hold exactly the current low-precision params."""
        todo = [u for u in units if self._dropped[u].dropped and
                (module is None or self._dropped[u].needs_all_gather())]
        if not todo:
            return
        for u in todo:
            self._dropped[u].allocate()
        done = fsdp2_internals.restore_from([e for u in todo for e in self._unit_entries[u]], self.h2d)
        if done is not None:
            for s in fsdp2_internals.consumer_streams(module):
                s.wait_event(done)

    def _restore_all(self) -> None:
        if self._dropped:
            self._restore(list(self._dropped), None)

    def _d2h_unit(self, chunks: list[Chunk], event) -> None:
        """A unit's grads are reduced (post-backward): queue their D2H now, behind the reduce-scatter."""
        if not self._sync:
            return
        for c in chunks:                    # an overlapped step of the last iteration reads these grad buffers
            c.ready.wait()
        rec = self.tl.cur if self.tl is not None else None
        with on_stream(self.d2h):
            if event is not None and self.d2h is not None:
                self.d2h.wait_event(event)
            for chunk in chunks:
                self._d2h_chunk(chunk, rec)
                self._early.add(id(chunk))
        if self.spec is not None:
            self.spec.submit(chunks)

    def _sums(self) -> dict | None:
        return self.norm_cache.take() if self.norm_cache is not None else None

    def _sum_unit(self, module: nn.Module) -> None:
        if self.norm_cache is not None:   # tests turn it off on a built path
            self.norm_cache.submit(fsdp2_internals.offloaded_grads(module))

    def _d2h_chunk(self, chunk: Chunk, rec) -> None:
        """(On the D2H stream) copy the chunk's sharded grads into their pinned buffers; record d2h_done."""
        tl, k = self.tl, self._index[id(chunk)]
        if rec is not None and self.d2h is not None:
            tl.chunk(rec, k)["ev"]["d2h_start"] = torch.cuda.Event(enable_timing=True)
            tl.chunk(rec, k)["ev"]["d2h_start"].record(self.d2h)
        for e in chunk.entries:
            if e.param.grad is not None:
                e.grad_buf.copy_(local_tensor(e.param.grad), non_blocking=True)
        if self.d2h is not None:
            chunk.d2h_done = torch.cuda.Event(enable_timing=rec is not None)
            chunk.d2h_done.record(self.d2h)
            if rec is not None:
                tl.chunk(rec, k)["ev"]["d2h_end"] = chunk.d2h_done

    def _make_wait_hook(self, module, chunks, unit):
        def wait_for_update(*_):
            t0 = time.perf_counter()
            for c in chunks:
                c.ready.wait()
            host_wait = time.perf_counter() - t0
            if self._error is not None:
                raise RuntimeError("fsdpzero offload: the CPU optimizer step failed") from self._error
            if self.h2d is not None:   # FSDP2's all-gather copy-in reads the shards on its own streams
                streams = fsdp2_internals.consumer_streams(module)
                before = torch.cuda.Event(enable_timing=True) if self.tl is not None else None
                if before is not None:
                    before.record()
                for c in chunks:
                    if c.h2d_done is not None:
                        for s in streams:
                            s.wait_event(c.h2d_done)
                if before is not None:   # after - before: how long the compute stream stalls on the H2D
                    after = torch.cuda.Event(enable_timing=True)
                    after.record()
                    self.tl.unit_wait(unit, host_wait, before, after)
            elif self.tl is not None:
                self.tl.unit_wait(unit, host_wait, None, None)
        return wait_for_update

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """masters <- the model's (possibly low-precision) shards, e.g. after new weights were loaded."""
        self._join()
        self._discard_speculation()
        self._restore_all()
        for e in self.entries:
            local = local_tensor(e.param)
            if e.master is not local:
                e.master.copy_(local)
            if e.out_buf is not None:   # the out buffer is the exact copy of the shard (DroppableShards)
                e.out_buf.copy_(local)

    @contextlib.contextmanager
    def keep_masters_on_load(self):
        """Loading an engine checkpoint that has the fp32 masters: DCP reads them in place, into the very tensors
        state_dict() handed out (the live masters, wherever the mesh's device is theirs), and the model's weights
        load next. Refreshing the masters from those (low-precision) weights would overwrite what DCP just read."""
        self._refresh_on_load = False
        try:
            yield
        finally:
            self._refresh_on_load = True

    def pending(self) -> bool:
        """An overlapped CPU step has not been joined yet: the weights may still change."""
        return self._worker is not None

    def wait(self) -> None:
        """Block until an overlapped CPU step has finished (before reading the weights outside a forward)."""
        self._join()
        if self.h2d is not None and self.overlap:   # and the current stream sees its last H2D copies
            torch.cuda.current_stream().wait_stream(self.h2d)
        self._restore_all()
        if self.tl is not None:
            self.tl.flush()

    def _join(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("fsdpzero offload: the CPU optimizer step failed") from err

    # -- GradPath -------------------------------------------------------------------------------------------------
    def set_sync(self, sync: bool) -> None:
        self._sync = sync
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(sync)

    def finish_gradients(self) -> None:
        self._join()                      # the previous step must be done with the grad buffers
        tl = self.tl
        rec = tl.cur if tl is not None else None
        if tl is not None:
            tl.flush()
            tl.host(rec, "backward_end_host")
            tl.gpu(rec, "backward_end")
        if not self.staged:
            return
        late = [c for c in self.cpu_chunks if id(c) not in self._early]   # not hooked (e.g. no FSDP unit)
        self._early.clear()
        if late:
            if self.d2h is not None:
                self.d2h.wait_stream(torch.cuda.current_stream())
            with on_stream(self.d2h):
                for chunk in late:
                    self._d2h_chunk(chunk, rec)
        if self.spec is not None:
            self.spec.submit(late)
            self.spec.end_of_backward()

    def grad_norm(self) -> torch.Tensor:
        # in the model's parameter order, as FSDPGradPath: the same norm bits, so the same clip coefficient
        params = [e.param for e in sorted(self.entries, key=lambda e: self._model_order[e.name])]
        if self.tl is None:
            return device_step.grad_norm(params, self._sums(), self.optimizer.build)
        rec, t0 = self.tl.cur, time.perf_counter()
        self.tl.gpu(rec, "norm_start")
        norm = device_step.grad_norm(params, self._sums(), self.optimizer.build)
        self.tl.gpu(rec, "norm_end")
        self.tl.host(rec, "grad_norm_host", t0)
        return norm

    def scale_grads_(self, factor) -> None:
        self._factor = self._factor * factor   # a float or 0-dim tensor; the kernel applies it as it reads grads

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        # can_skip_on_device() is False: the engine decides a skip on the host and never passes found_inf
        if found_inf is not None:
            raise ValueError("the offload path skips overflowed steps on the host: step(found_inf) is not supported")
        self._join()
        rec = self.tl.stepped(max(1, self.threads - 1) if self.overlap else self.threads) if self.tl else None
        t0 = time.perf_counter()
        factor, self._factor = float(self._factor), 1.0   # the CPU needs the value: one sync, after the norm
        if self.spec is not None and self.spec.active:
            self.spec.claim(commit=factor == 1.0)           # factor 1.0: the speculative steps are this step
        if self.spec is not None:
            self.spec.note_factor(factor)
        if rec is not None:
            self.tl.host(rec, "factor_sync_host", t0)
        # what to step, read now: zero_grad() may drop the grads before an overlapped worker reaches them
        work = [(chunk, [(e, e.grad_buf if e.grad_buf is not None else local_tensor(e.param.grad))
                         for e in chunk.entries if e.param.grad is not None]) for chunk in self.cpu_chunks]
        if self._dropped:   # the dropped shards get their storage back; the H2D below fills it
            back = [u for u, d in self._dropped.items() if d.dropped]
            for u in back:
                self._dropped[u].allocate()
            stale = [e for u in back for e in self._unit_entries[u] if e.param.grad is None]
            if stale:       # no grad, no step: the current value comes back from the out buffer
                fsdp2_internals.restore_from(stale, self.h2d)
            elif back and self.h2d is not None:
                self.h2d.wait_stream(torch.cuda.current_stream())   # allocated on the compute stream
        # and the hyperparameters: the engine steps the LR scheduler right after step() returns
        self._hyper = {id(m): {k: v for k, v in g.items() if k != "params"}
                       for g in self.optimizer.param_groups for m in g["params"]}
        if self.device_chunks:          # queued on the device first: it runs while the CPU steps its chunks
            t0 = time.perf_counter()
            device_step.adam_step([e for c in self.device_chunks for e in c.entries], self._hyper,
                                     self.optimizer.state, factor)
            if rec is not None:
                self.tl.host(rec, "device_step_host", t0)
        if not self.overlap:
            self._rec = rec
            self._step_chunks(work, factor)
            if self.h2d is not None:         # the next forward's all-gathers read the updated shards
                torch.cuda.current_stream().wait_stream(self.h2d)
            if rec is not None:
                self.tl.host(rec, "step_return_host")
            return
        for chunk in self.cpu_chunks:
            chunk.ready.clear()
        self._worker = threading.Thread(target=self._worker_main, args=(work, factor, rec), daemon=True,
                                        name="fsdpzero-offload-step")
        self._worker.start()
        if rec is not None:
            self.tl.host(rec, "step_return_host")

    @torch.no_grad()   # grad mode is per thread
    def _worker_main(self, work, factor, rec) -> None:
        try:
            if self.h2d is not None:   # a new thread starts on GPU 0, whatever this rank's device is
                torch.cuda.set_device(self.h2d.device)
            torch.set_num_threads(max(1, self.threads - 1))   # OpenMP settings are per thread; leave one core
            self._rec = rec
            self._step_chunks(work, factor)                     # to the thread that launches the forward
        except BaseException as e:
            self._error = e
        finally:
            for chunk in self.chunks:
                chunk.ready.set()

    def _swap_in(self, unit) -> None:
        """offload_param nvme: the unit's shards must be in memory while the optimizer updates them."""
        if self.param_swapper is not None and unit is not None:
            self.param_swapper.step_touch(self.param_swapper.index[id(unit)])

    def _params_resident(self, dirty: bool = False) -> None:
        if self.param_swapper is not None:
            self.param_swapper.restore_all(dirty=dirty)

    def close(self) -> None:
        """Join an overlapped step; with offload_param nvme, bring every shard back and remove the swap files."""
        self._join()
        self._discard_speculation()
        if self.norm_cache is not None:
            self.norm_cache.close()
            self.norm_cache = None
        if self.param_swapper is not None:
            self.param_swapper.close()
            self.param_swapper = None

    def _step_chunks(self, work, factor) -> None:
        rec = self._rec
        tl = self.tl if rec is not None else None
        committed = self.spec.collect(self._hyper) if self.spec is not None else {}
        if tl is not None and self.spec is not None and self.spec.last_trace:
            trace = self.spec.last_trace   # the speculative chunks of this step's backward
            h = rec["host"]
            h["spec_first_start_host"] = trace[0][0] - rec["t0"]
            h["spec_last_end_host"] = trace[-1][2] - rec["t0"]
            h["spec_d2h_wait_host"] = sum(t1 - t0 for t0, t1, _, _ in trace)
            h["spec_adam_host"] = sum(t2 - t1 for _, t1, t2, _ in trace)
            h["spec_numel"] = sum(n for *_, n in trace)
            h["spec_committed"] = float(self.spec.last == "committed")
        for k, (chunk, items) in enumerate(work):
            if items:
                self._swap_in(chunk.unit)
            t0 = time.perf_counter()
            if chunk.d2h_done is not None:
                chunk.d2h_done.synchronize()
            if chunk.h2d_done is not None:       # last step's H2D must have read the out buffers we overwrite
                chunk.h2d_done.synchronize()
            if tl is not None:
                t1 = time.perf_counter()
                c = tl.chunk(rec, k)
                c.update(numel=sum(e.master.numel() for e, _ in items), d2h_wait_host=t1 - t0,
                         adam_start_host=t1 - rec["t0"])
            speculated = bool(items) and committed.get(id(chunk)) == frozenset(e.name for e, _ in items)
            for e, _ in items if speculated else ():
                self.spec.commit(e)            # stepped during backward with this very factor (1.0)
            for e, grad in () if speculated else items:
                out = e.out_buf
                if out is None and e.master is not local_tensor(e.param):
                    out = local_tensor(e.param)      # CPU-resident low-precision shard: written in place
                self.optimizer.step_param(e.master, grad, out=out, grad_scale=factor, hyper=self._hyper[id(e.master)])
            if tl is not None:
                c["adam_host"] = time.perf_counter() - t1
            if self.staged and items:
                with on_stream(self.h2d):
                    if tl is not None and self.h2d is not None:
                        c["ev"]["h2d_start"] = torch.cuda.Event(enable_timing=True)
                        c["ev"]["h2d_start"].record(self.h2d)
                    for e, _ in items:
                        local_tensor(e.param).copy_(e.out_buf, non_blocking=True)
                    if self.h2d is not None:
                        chunk.h2d_done = torch.cuda.Event(enable_timing=tl is not None)
                        chunk.h2d_done.record(self.h2d)
                        if tl is not None:
                            c["ev"]["h2d_end"] = chunk.h2d_done
            chunk.ready.set()
        if tl is not None:
            tl.host(rec, "cpu_done_host")
        if self.param_swapper is not None:
            self.param_swapper.step_end()

    def _discard_speculation(self) -> None:
        if self.spec is not None:
            self.spec.discard()

    def zero_grad(self) -> None:
        self._discard_speculation()           # a skipped step: nothing claimed this backward's speculation
        if self.norm_cache is not None:       # sums of grads that are about to go
            self.norm_cache.clear()
        if self.d2h is not None:              # grads may be freed only after their D2H has read them
            self.d2h.synchronize()
        for e in self.entries:
            e.param.grad = None

    def state_dict(self, streaming: bool = False) -> dict:
        """Per parameter name: step, exp_avg, exp_avg_sq and the fp32 master, as DTensors placed like the param
        (CPU local shards) so DCP saves each rank's own shard; plus the param groups' hyperparameters."""
        self._join()
        self._discard_speculation()
        self._params_resident()
        return offload_state_dict(self.entries, self.optimizer, self._by_master)

    def load_state_dict(self, sd: dict) -> None:
        self._join()
        self._discard_speculation()
        self._params_resident(dirty=True)
        load_offload_state_dict(self.entries, self.optimizer, sd)
