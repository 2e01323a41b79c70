"""Reads of the weights wait for a pending update, by construction.

With the overlapped CPU step, `step()` returns while a worker thread is still writing the parameters; each FSDP
unit's next forward waits for its own chunks (the path's forward pre-hooks). Everything else that reads the weights
must wait for the whole step first. `guard_reads(model, pending, wait)` makes that so for:

- `parameters()` / `named_parameters()` of the model and of every submodule (an instance attribute shadowing the
  class method, so no class is swapped and nothing changes for FSDP2 or torch.compile);
- `state_dict()` of the model or any submodule, hence `get_model_state_dict`, DCP saves and exports
  (a state_dict pre-hook on every module);
- `load_state_dict()` of the model or any submodule (new weights must not race the worker's writes);
- `state_dict()` / `load_state_dict()` of the CPU optimizer (`engine.optimizer`): its moments are being written too;
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

import types
from typing import Callable

from torch import nn


class ReadGuard:
    def __init__(self, model: nn.Module, pending: Callable[[], bool], wait: Callable[[], None]):
        self.pending, self._wait = pending, wait
        self.in_forward = 0      # nesting depth of the root's forward
        self._quiet = 0          # inside zero_grad: only grads are touched
        self.waits = 0           # how many reads had to wait (tests)
        model.register_forward_pre_hook(self._enter, prepend=True)
        model.register_forward_hook(self._leave, always_call=True)
        for module in model.modules():
            module.register_state_dict_pre_hook(lambda *_: self.wait())
            module.register_load_state_dict_pre_hook(lambda *_: self.wait())
            self._shadow(module)

    def _enter(self, *_):
        self.in_forward += 1

    def _leave(self, *_):
        self.in_forward = max(0, self.in_forward - 1)

    def wait(self) -> None:
        if self.pending():
            self.waits += 1
            self._wait()

    def _read(self) -> None:
        if not self.in_forward and not self._quiet:
            self.wait()

    def _shadow(self, module: nn.Module) -> None:
        cls, guard = type(module), self

        def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
            guard._read()
            return cls.named_parameters(self, prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

        def parameters(self, recurse: bool = True):
            guard._read()
            return cls.parameters(self, recurse=recurse)

        def zero_grad(self, set_to_none: bool = True):
            guard._quiet += 1
            try:
                return cls.zero_grad(self, set_to_none=set_to_none)
            finally:
                guard._quiet -= 1

        # bound methods as plain attributes (nn.Module.__setattr__ keeps them in the instance dict, ahead of the
        # class's methods); bound, so that copy.deepcopy rebinds them to the copy
        for fn in (named_parameters, parameters, zero_grad):
            setattr(module, fn.__name__, types.MethodType(fn, module))


def guard_reads(model: nn.Module, pending: Callable[[], bool], wait: Callable[[], None],
                optimizer=None) -> ReadGuard:
    """The model's reads (above) and, when given, the optimizer's state_dict()/load_state_dict(): the worker is
    still writing its moments and step counts (instance attributes ahead of the class's methods, as for modules)."""
    guard = ReadGuard(model, pending, wait)
    if optimizer is not None:
        cls = type(optimizer)

        def state_dict(self, *args, **kwargs):
            guard.wait()
            return cls.state_dict(self, *args, **kwargs)

        def load_state_dict(self, *args, **kwargs):
            guard.wait()
            return cls.load_state_dict(self, *args, **kwargs)
        for fn in (state_dict, load_state_dict):
            setattr(optimizer, fn.__name__, types.MethodType(fn, optimizer))
    return guard
