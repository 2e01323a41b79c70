"""Reads of the weights wait for a pending update, by construction.

With the overlapped CPU step, `step()` returns while a worker thread is still writing the parameters; each FSDP
unit's next forward waits for its own chunks (the path's forward pre-hooks). Everything else that reads the weights
must wait for the whole step first. `guard_reads(model, pending, wait, optimizer)` makes that so for:

- `parameters()` / `named_parameters()` of the model and of every submodule: each module's class becomes a subclass
  of its class and `WaitsForStep` below, as fully_shard makes it a subclass of FSDPModule (`type(m).__mro__` shows
  both; the name stays the class's own), so nothing changes for FSDP2 or torch.compile;
- `state_dict()` of the model or any submodule, hence `get_model_state_dict`, DCP saves and exports
  (a state_dict pre-hook on every module);
- `load_state_dict()` of the model or any submodule (new weights must not race the worker's writes; a
  load_state_dict pre-hook);
- `state_dict()` / `load_state_dict()` of the CPU optimizer (`engine.optimizer`): its moments are being written too
  (its class becomes a subclass of its class and `StateWaitsForStep`);
- `fsdpzero.zero.GatheredParameters` (it reads each parameter's holder module through `parameters()`);
- the Engine's own accessors, `save_checkpoint`, `save_16bit_model` and `wait_for_params()` (fsdpzero/engine.py).

Inside a forward of the model (a root pre-hook / post-hook pair) `parameters()` does not wait: the unit hooks do,
unit by unit, and Hugging Face models read `self.dtype` (which iterates parameters) in their forward.
`zero_grad()` reads only the gradients and does not wait either.

Not covered: a parameter read as an attribute (`model.lm_head.weight`) right after `step()` and before the next
forward, and a reference kept from before `step()` (a list of parameters an EMA helper took once): call
`engine.wait_for_params()` first, or set the `offload_overlap` knob to False for such code (docs/offload.md).
"""
from __future__ import annotations

from typing import Callable

from torch import nn


class ReadGuard:
    """Whether a step is pending and how to wait for it, for the classes below; counts the reads that waited."""

    def __init__(self, pending: Callable[[], bool], wait: Callable[[], None]):
        self.pending, self._wait = pending, wait
        self.in_forward = 0      # nesting depth of the root's forward
        self.quiet = 0           # inside zero_grad: only grads are touched
        self.waits = 0           # how many reads had to wait (tests)
        self._classes: dict[type, type] = {}

    def enter_forward(self, *_):
        self.in_forward += 1

    def leave_forward(self, *_):
        self.in_forward = max(0, self.in_forward - 1)

    def wait(self) -> None:
        if self.pending():
            self.waits += 1
            self._wait()

    def read(self) -> None:
        """A read of the weights: waits, except inside a forward or zero_grad."""
        if not self.in_forward and not self.quiet:
            self.wait()

    def guarded(self, cls: type, mixin: type) -> type:
        """`cls` with `mixin` in front, reading this guard (one class per guard and class, named as `cls`)."""
        if cls not in self._classes:
            self._classes[cls] = type(cls.__name__, (mixin, cls), {"read_guard": self, "__module__": cls.__module__,
                                                                   "__qualname__": cls.__qualname__})
        return self._classes[cls]


class WaitsForStep:
    """In front of a module's class (guard_reads): parameters() and named_parameters() wait for a pending
    overlapped step outside a forward; zero_grad() (gradients only) never waits."""

    read_guard: ReadGuard

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        self.read_guard.read()
        return super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def parameters(self, recurse: bool = True):
        self.read_guard.read()
        return super().parameters(recurse=recurse)

    def zero_grad(self, set_to_none: bool = True):
        self.read_guard.quiet += 1
        try:
            return super().zero_grad(set_to_none=set_to_none)
        finally:
            self.read_guard.quiet -= 1


class StateWaitsForStep:
    """In front of the path optimizer's class (guard_reads): state_dict() and load_state_dict() wait for a pending
    step, whose worker is still writing the moments and step counts."""

    read_guard: ReadGuard

    def state_dict(self, *args, **kwargs):
        self.read_guard.wait()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.read_guard.wait()
        return super().load_state_dict(*args, **kwargs)


def guard_reads(model: nn.Module, pending: Callable[[], bool], wait: Callable[[], None],
                optimizer=None) -> ReadGuard:
    """The model's reads (above) and, when given, the optimizer's state_dict()/load_state_dict() wait while
    `pending()`, by calling `wait()`."""
    guard = ReadGuard(pending, wait)
    model.register_forward_pre_hook(guard.enter_forward, prepend=True)
    model.register_forward_hook(guard.leave_forward, always_call=True)
    for module in model.modules():
        module.register_state_dict_pre_hook(lambda *_: guard.wait())
        module.register_load_state_dict_pre_hook(lambda *_: guard.wait())
        module.__class__ = guard.guarded(type(module), WaitsForStep)
    if optimizer is not None:
        optimizer.__class__ = guard.guarded(type(optimizer), StateWaitsForStep)
    return guard
