"""Stage 1's all-gather of the updated parameters: finished inside step(), or left in flight for the next forward.

After the sharded step every rank holds its chunk of each updated parameter in fp32. The chunks are cast to the
parameter dtype and all-gathered, one bucket (a run of parameters, ops/fsdpzero_ops/stage1/layout.py) per collective, then
copied out of the rank-major buffer into the whole parameters.

`gather(defer=False)` does it all before returning, at most two buckets in flight (bounded temporary memory).
`gather(defer=True)` (after `attach(model)`) launches every bucket, in the order the forward first uses their
parameters, and returns. Each bucket is then waited for by its first reader:
  - a forward pre-hook on every module that owns one of the parameters waits for the buckets of its own parameters
    only, so the first layers compute while the later buckets are still on the wire;
  - the root's state_dict / load_state_dict pre-hooks, the end of the root's forward (parameters it never used),
    the next gather, and `wait()` (saving, reading weights by hand) wait for all of them.
On CUDA each bucket is copied out on a side stream as soon as its collective is done, so the copy-outs too run
under the next collectives and the forward, and a reader's stream only waits for an event (no host sync). On gloo
the collectives run on gloo's thread, and a reader blocks on the bucket's Work, then copies it out. The buffers of
all buckets (the parameters' bytes once) live from the step until the forward consumes them.

torch.compile: the owner hooks do nothing inside a compiled graph (no graph break). A compiled root waits for all
buckets at its entry (a call outside the graph). Compiled submodules found in the model at step time turn the
deferral off for that step (their owner hooks would run inside their graphs).
"""
from __future__ import annotations

import collections
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .layout import FlatGroup, Run, unpack


def _all_gather(out, inp, group, async_op):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.13
    return fn(out, inp, group=group, async_op=async_op)


@torch.compiler.disable
def _wait_outside_graph(gather: "ParamAllGather") -> None:
    gather.wait()


def _has_compiled_submodule(model: nn.Module) -> bool:
    """torch.compile(module) wrappers or module.compile() anywhere in the tree (checked every step: a plain walk,
    about half the cost of model.modules())."""
    stack = [model]
    while stack:
        m = stack.pop()
        if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None:
            return True
        stack.extend(c for c in m._modules.values() if c is not None)
    return False


class ParamAllGather:
    """The all-gather of a Stage1Optimizer's updated shards into its whole parameters (see the module docstring)."""

    def __init__(self, flat_groups: list[FlatGroup], group, rank: int, world: int, device: torch.device):
        self.flat_groups, self.group, self.rank, self.world, self.device = flat_groups, group, rank, world, device
        self.model: nn.Module | None = None      # set by attach(): deferral is possible
        # launched, not waited for: run -> (buffer, its Work (copy-out still to do) or, on CUDA, the copy stream's
        # event after the copy-out)
        self.in_flight: dict[Run, tuple[torch.Tensor, object]] = {}
        self._copy_stream = None
        self._first_use: dict[Run, int] = {}   # run -> order of its first use in the forwards before the first step
        self._forward_order: list[tuple[FlatGroup, Run]] | None = None
        self._hooks: list = []

    # ------------------------------------------------------------ gathering

    @torch.no_grad()
    def gather(self, update: Callable[[torch.Tensor, int, int], None] | None = None, *, defer: bool = False) -> None:
        """Cast each bucket's shard to the parameter dtype and all-gather it. `update(master, lo, hi)`, if given,
        first steps the bucket's slice of the shard (ops/fsdpzero_ops/stage1/step.py). `defer`: leave the copy-outs to the
        next reader (only after attach(), on more than one rank, and without compiled submodules)."""
        self.wait()
        defer = defer and self.deferrable()
        window: collections.deque = collections.deque()
        for fg, run in self._ordered() if defer else [(fg, run) for fg in self.flat_groups for run in fg.gather_runs]:
            if update is not None:
                update(fg.master, run.lo, run.hi)
            if self.world == 1:
                for s in run.slots:
                    s.param.view(-1).copy_(fg.master[s.offset: s.offset + s.numel])
                continue
            buf = torch.empty(self.world, run.hi - run.lo, dtype=fg.dtype, device=self.device)
            buf[self.rank].copy_(fg.master[run.lo: run.hi])
            work = _all_gather(buf.view(-1), buf[self.rank], self.group, async_op=True)
            if defer:
                self.in_flight[run] = (buf, self._copy_out_aside(run, buf, work))
                continue
            window.append((run, buf, work))
            if len(window) > 1:
                self._copy_out(*window.popleft())
        while window:
            self._copy_out(*window.popleft())

    def deferrable(self) -> bool:
        return self.model is not None and self.world > 1 and not _has_compiled_submodule(self.model)

    @staticmethod
    def _copy_out(run: Run, buf: torch.Tensor, work) -> None:
        work.wait()   # NCCL: the current stream waits for the collective, the host does not
        for s in run.slots:
            unpack(s.param.view(-1), buf[:, s.offset - run.lo: s.offset - run.lo + s.chunk])

    def _copy_out_aside(self, run: Run, buf: torch.Tensor, work):
        """CUDA: copy out on a side stream as soon as the collective is done (under the next bucket's collective
        and the forward), and return the event a reader's stream waits for. The side stream comes after the
        collective, which came after everything queued before its launch (the backward's reads of the parameters).
        Elsewhere: the Work, for the reader to wait on and copy out."""
        if self.device.type != "cuda":
            return work
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            self._copy_out(run, buf, work)
            buf.record_stream(self._copy_stream)   # freed by a reader on any stream: not reused before this copy
            return self._copy_stream.record_event()

    @torch.no_grad()
    def wait(self, runs: list[Run] | None = None) -> None:
        """Copy out the given in-flight buckets (all by default): the parameters then hold the last step's values."""
        if not self.in_flight:
            return
        for run in list(self.in_flight) if runs is None else runs:
            buf, pending = self.in_flight.pop(run, (None, None))
            if isinstance(pending, torch.cuda.Event):
                torch.cuda.current_stream(self.device).wait_event(pending)   # then buf may be freed on this stream
            elif pending is not None:
                self._copy_out(run, buf, pending)

    def _ordered(self) -> list[tuple[FlatGroup, Run]]:
        """Buckets by the first use of their parameters in the eager forwards before the first deferred step; the
        rest (a compiled model records nothing) in the model's registration order, which is forward order for
        HF models, across param groups and dtypes."""
        if self._forward_order is None:
            registered = {id(p): i for i, p in enumerate(self.model.parameters())}
            self._forward_order = sorted(
                [(fg, run) for fg in self.flat_groups for run in fg.gather_runs],
                key=lambda fr: (self._first_use.get(fr[1], math.inf),
                                min(registered.get(id(s.param), math.inf) for s in fr[1].slots)))
            self._first_use.clear()
        return self._forward_order

    # ------------------------------------------------------------ hooks

    def attach(self, model: nn.Module) -> None:
        """Allow deferral: forward pre-hooks on the modules that own the parameters, waits on the root's
        state_dict / load_state_dict and at the end of its forward."""
        if self.model is not None:
            raise RuntimeError("the stage-1 all-gather is already attached to a model")
        self.model = model
        run_of = {id(s.param): run for fg in self.flat_groups for run in fg.gather_runs for s in run.slots}
        for module in model.modules():
            runs = list(dict.fromkeys(run_of[id(p)] for p in module._parameters.values()
                                      if p is not None and id(p) in run_of))
            if runs:
                self._hooks.append(module.register_forward_pre_hook(self._before_owner_forward(runs)))
        self._hooks += [model.register_forward_pre_hook(self._before_root_forward),
                        model.register_forward_hook(self._after_root_forward),
                        model.register_state_dict_pre_hook(lambda *_: self.wait()),
                        model.register_load_state_dict_pre_hook(lambda *_: self.wait())]

    def _before_owner_forward(self, runs: list[Run]):
        def hook(_module, _args):
            if torch.compiler.is_compiling():   # traced: a no-op in the graph (the compiled root waited already)
                return
            if self._forward_order is None:
                for run in runs:
                    self._first_use.setdefault(run, len(self._first_use))
            if self.in_flight:
                self.wait(runs)
        return hook

    def _before_root_forward(self, _module, _args):
        if torch.compiler.is_compiling():
            _wait_outside_graph(self)   # runs eagerly at the graph's entry, every call

    def _after_root_forward(self, _module, _args, _output):
        if not torch.compiler.is_compiling():
            self.wait()   # parameters this forward did not use
