"""torch.compile per transformer block: the `compile` section (`enabled` / `backend` / `kwargs`, older DeepSpeed's
keys; `deepcompile` read as a request for the fastest compiled path), `engine.compile()` (DeepSpeed's method) and the
`compile` tuning knob (FSDPZERO_COMPILE=1) for configs without the section.

What is compiled is what torchtitan compiles when it wraps each block in `torch.compile` before `fully_shard`: the
block's own computation, with FSDP2's all-gather / reduce-scatter hooks outside the graph (eager) and activation
checkpointing inside it (the partitioner then plans the recompute). fsdpzero gets the same region by compiling the
block's `forward` after `fully_shard` (FSDP2 runs its hooks around `forward`; `CompiledForward` in front of the
unit's class, as fully_shard puts `FSDPModule` there, runs the compiled forward): parameter names keep no `_orig_mod.`,
and `engine.compile()` works after `initialize`, as DeepSpeed's does. Blocks of one class share one graph.
An HF model's loss function (`model.loss_function`: the fp32 upcast of the logits and the cross-entropy) is
compiled too, as torchtitan compiles its loss. An HF model's `config.use_cache` is turned off (the KV cache, which
training never reads, is indexed by layer and made every block its own graph). A model without transformer blocks is compiled whole (its only FSDP unit is the
root). Stage 1 leaves the model unwrapped: there each block is compiled in place with `module.compile()`, which the
stage-1 all-gather recognises (ops/fsdpzero_ops/stage1/gather.py: its per-module waits would otherwise sit inside the
graphs).

Graph breaks and compile time are counted from dynamo's counters around the first optimizer step (compilation is
lazy: it happens in the first forward and backward) and logged once on rank 0 (`engine.compile_report`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import time
from typing import Any, Callable

import torch
from torch import nn

from fsdpzero.plan import CompilePlan, Plan

log = logging.getLogger("fsdpzero")

# torch.compile's keyword arguments besides `backend` (DeepSpeed passes compile.kwargs through to it)
COMPILE_KWARGS = tuple(k for k in inspect.signature(torch.compile).parameters if k not in ("model", "backend"))
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# dynamo's timers that hold compile work: per captured frame (forward graphs), and AOT's lazily compiled backward
_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def with_knob(plan: Plan, knob: bool | None) -> Plan:
    """The plan with the `compile` tuning knob applied: None follows the config, True turns per-block compile on
    (the section's backend and kwargs, else inductor), False turns it off."""
    if knob is None or knob == plan.compile.enabled:
        return plan
    c = plan.compile
    new = dataclasses.replace(c, enabled=knob, source="tuning compile" if knob else "")
    return dataclasses.replace(plan, compile=new)


def resolve_backend(backend: Any, *, key: str = "compile.backend") -> str | Callable:
    """A torch.compile backend: a registered name (torch._dynamo.list_backends()), a callable, or, as DeepSpeed
    accepts, an importable "module.function". ValueError naming the key otherwise."""
    if callable(backend):
        return backend
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"{key} = {backend!r}: expected a torch.compile backend name such as \"inductor\"")
    import torch._dynamo
    names = torch._dynamo.list_backends(exclude_tags=())
    if backend in names:
        return backend
    module, _, fn = backend.rpartition(".")
    if module:
        try:
            return getattr(importlib.import_module(module), fn)
        except (ImportError, AttributeError):
            pass
    raise ValueError(f"{key} = {backend!r}: not a torch.compile backend ({', '.join(sorted(names))}) nor an "
                     "importable \"module.function\"; use \"inductor\" (the default)")


def check_kwargs(kwargs: Any, *, key: str = "compile.kwargs") -> dict[str, Any]:
    if not isinstance(kwargs, dict):
        raise ValueError(f"{key} = {kwargs!r}: expected a mapping of torch.compile keyword arguments")
    bad = sorted(set(kwargs) - set(COMPILE_KWARGS))
    if bad:
        raise ValueError(f"{key} has {', '.join(repr(b) for b in bad)}: torch.compile takes "
                         f"{', '.join(COMPILE_KWARGS)} (the backend is compile.backend)")
    if kwargs.get("mode") not in MODES:
        raise ValueError(f"{key}.mode = {kwargs['mode']!r}: torch.compile's modes are "
                         f"{', '.join(m for m in MODES if m)}")
    return dict(kwargs)


def check_compile(plan: Plan) -> None:
    """Refuse a bad backend or kwargs before any process group exists (one line naming the key)."""
    if plan.compile.enabled:
        resolve_backend(plan.compile.backend)
        check_kwargs(plan.compile.kwargs)


def compile_targets(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """What is compiled one by one: the transformer blocks, or the whole model when it declares none."""
    return list(blocks) if blocks else [model]


def compile_blocks(model: nn.Module, blocks: list[nn.Module], backend: Any = "inductor",
                   kwargs: dict[str, Any] | None = None) -> "CompileWatch":
    """torch.compile each target's forward (see the module docstring); returns the watch that reports graph breaks
    and compile time after the first step. Idempotent: a target compiled already is left as it is."""
    fn = resolve_backend(backend)
    kw = check_kwargs(dict(kwargs or {}))
    from torch.distributed.fsdp import FSDPModule
    targets = compile_targets(model, blocks)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # an HF KV cache in a training forward indexes it by layer: each block became its own graph, and past
        # torch's recompile limit (8) the remaining blocks ran eager. Training never reads the cache.
        config.use_cache = False
        log.info("torch.compile: %s.config.use_cache set to False for training (a per-layer KV cache makes every "
                 "block its own graph)", type(model).__name__)
    watch = CompileWatch(len(targets), backend if isinstance(backend, str) else getattr(backend, "__name__", "fn"),
                         kw)
    owner = loss_owner(model) if blocks else None   # a model compiled whole has its loss inside the graph
    if owner is not None and not isinstance(owner.loss_function, CompiledLoss):
        # the loss, as torchtitan compiles it next to the blocks (and as DeepSpeed's whole-model compile covers it):
        # HF's loss upcasts the [batch, seq, vocab] logits to fp32 before the cross-entropy, an eager pass that
        # writes and reads the largest activation of the step twice more; compiled, the cast is fused into it
        owner.loss_function = CompiledLoss(owner.loss_function, backend, kw)
    watch.loss = owner is not None
    for t in targets:
        if isinstance(t, CompiledForward) or getattr(t, "_compiled_call_impl", None) is not None:
            continue
        if isinstance(t, FSDPModule):
            # FSDP2 all-gathers in a forward pre-hook and frees in a post-hook, around `forward`: compiling the
            # (possibly checkpointed) forward keeps them eager, outside the graph. nn.Module.compile() would compile
            # __call__, hooks included
            t.compiled_forward = torch.compile(t.forward, backend=fn, **kw)
            t.__class__ = compiled_class(type(t))
        else:
            t.compile(backend=fn, **kw)
    return watch


class CompiledForward:
    """In front of an FSDP2 unit's class (compile_blocks): forward runs `compiled_forward`, torch.compile of the
    forward the unit had (its class's own, or activation checkpointing's); FSDP2's hooks around it stay eager."""

    compiled_forward: Callable

    def forward(self, *args, **kwargs):
        return self.compiled_forward(*args, **kwargs)


@functools.cache
def compiled_class(cls: type) -> type:
    """`cls` with CompiledForward in front, one class per class, named as `cls`; its forward keeps the signature of
    `cls.forward` (what transformers' Trainer inspects to keep the batch's columns)."""
    @functools.wraps(cls.forward)
    def forward(self, *args, **kwargs):
        return CompiledForward.forward(self, *args, **kwargs)
    return type(cls.__name__, (CompiledForward, cls), {"forward": forward, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})


def loss_owner(model: nn.Module) -> nn.Module | None:
    """The outermost module that computes an HF loss: transformers' PreTrainedModel.loss_function (a settable
    property) on a model whose forward takes `labels` (a backbone such as LlamaModel has the property but no loss;
    under PEFT, the wrapped model). None when there is none, or when the user set their own loss function there
    (theirs may not trace; they compile it themselves)."""
    for m in model.modules():
        prop = getattr(type(m), "loss_function", None)
        if isinstance(prop, property) and prop.fset is not None and _takes_labels(m):
            own = m.__dict__.get("_loss_function")
            return m if own is None or isinstance(own, CompiledLoss) else None
    return None


def _takes_labels(module: nn.Module) -> bool:
    try:
        return "labels" in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


class CompiledLoss:
    """torch.compile of an HF loss function that pickles as the function it compiles and compiles again when
    unpickled: the compiled function itself does not pickle (it is found by the original's name, which is another
    object), and a model holding it could not be pickled or sent to another process."""

    def __init__(self, fn: Callable, backend: Any, kwargs: dict[str, Any]):
        self.fn, self.backend, self.kwargs = fn, backend, dict(kwargs)
        self._compiled = torch.compile(fn, backend=resolve_backend(backend), **self.kwargs)

    def __call__(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)

    def __reduce__(self):
        return CompiledLoss, (self.fn, self.backend, self.kwargs)


class CompileWatch:
    """Dynamo's graph-break counter and compile timers, from when the blocks were compiled to the first step."""

    def __init__(self, targets: int, backend: str, kwargs: dict[str, Any]):
        from torch._dynamo.utils import counters
        self.targets, self.backend, self.kwargs = targets, backend, kwargs
        self.loss = False   # the HF loss function compiled too (compile_blocks)
        self._breaks0 = dict(counters["graph_break"])
        self._stats0 = dict(counters["stats"])
        self._timers0 = _timer_sums()
        self._t0 = time.perf_counter()

    def report(self) -> dict[str, Any]:
        """graph_breaks (count, with the most frequent reasons), graphs (unique graphs compiled), compile_s (dynamo +
        backend time, forward and lazily compiled backward), first_step_s (wall time from compile to the report)."""
        from torch._dynamo.utils import counters
        breaks = {k: v - self._breaks0.get(k, 0) for k, v in counters["graph_break"].items()
                  if v - self._breaks0.get(k, 0) > 0}
        stats = counters["stats"]
        timers = _timer_sums()
        return {"backend": self.backend, "kwargs": self.kwargs, "compiled_units": self.targets,
                "compiled_loss": self.loss,
                "graph_breaks": sum(breaks.values()),
                "graph_break_reasons": dict(sorted(breaks.items(), key=lambda kv: -kv[1])[:5]),
                "graphs": stats.get("unique_graphs", 0) - self._stats0.get("unique_graphs", 0),
                "compile_s": round(sum(timers.get(k, 0.0) - self._timers0.get(k, 0.0) for k in _TIMERS), 3),
                "first_step_s": round(time.perf_counter() - self._t0, 3)}


def _timer_sums() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics
    return {k: sum(compilation_time_metrics.get(k, ())) for k in _TIMERS}


def describe(report: dict[str, Any]) -> str:
    """The startup line (rank 0), after the first step."""
    line = (f"torch.compile ({report['backend']}{', ' + str(report['kwargs']) if report['kwargs'] else ''}) of "
            f"{report['compiled_units']} unit(s){' and the loss' if report.get('compiled_loss') else ''}: "
            f"{report['graphs']} graph(s), {report['graph_breaks']} graph break(s), {report['compile_s']:.1f} s compiling (first step {report['first_step_s']:.1f} s)")
    if report["graph_breaks"]:
        line += "; breaks: " + "; ".join(f"{n}x {r[:120]}" for r, n in report["graph_break_reasons"].items())
    return line


__all__ = ["COMPILE_KWARGS", "CompilePlan", "CompileWatch", "CompiledForward", "check_compile", "check_kwargs",
           "compile_blocks", "compile_targets", "compiled_class", "CompiledLoss", "describe", "loss_owner",
           "resolve_backend", "with_knob"]
