"""Activation checkpointing (the `activation_checkpointing` section, or HF gradient checkpointing) on blocks.

Applied *before* `fully_shard`, with FSDP2's hooks outside the checkpointed region, as torchtitan does, so the
recomputation in backward finds the block's parameters already all-gathered and does not all-gather twice:
- Hugging Face models: their own `activation_checkpointing_enable` (non-reentrant). Transformers checkpoints each
  layer's `forward`, not `__call__`, and turns off the KV cache the recompute would otherwise write twice.
- Other models: each block's class gets `CheckpointedBlock` in front (as fully_shard puts `FSDPModule` in front of
  it), whose `forward` is a non-reentrant `torch.utils.checkpoint` of the class's own. Parameter names and the module
  tree stay as they are, unlike torch's `checkpoint_wrapper` (a `_checkpoint_wrapped_module.` in every name), and
  the recompute calls the block's own forward, not its hooks (the composable `torch.distributed._composable.
  checkpoint` re-runs `__call__`, with FSDP2's and the NVMe swapper's hooks).

`cpu_checkpointing` (DeepSpeed: checkpoints in host memory) runs each checkpointed block under `save_on_cpu`: the
non-reentrant checkpoint saves the block's inputs through autograd's saved-tensor hooks, so those inputs (what the
recompute needs) wait for backward in host memory (pinned on GPU hosts); transformers' `offload=True` is the same.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_checkpointing(model: nn.Module, blocks: Iterable[nn.Module], *, cpu_offload: bool = False) -> str:
    """Checkpoint every block; returns which mechanism was used ("hf" or "torch")."""
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "activation_checkpointing_enable"):
        # on a CPU-only host activations already live in host memory (and pinning would fail)
        model.activation_checkpointing_enable({"use_reentrant": False},
                                              offload=cpu_offload and torch.cuda.is_available())
        return "hf"
    if getattr(model, "supports_gradient_checkpointing", False) and not cpu_offload:   # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "hf"
    mixin = CheckpointedToCPUBlock if cpu_offload else CheckpointedBlock
    for block in blocks:
        if not isinstance(block, CheckpointedBlock):
            block.__class__ = checkpointed_class(type(block), mixin)
    return "torch"


class CheckpointedBlock:
    """In front of a block's class (apply_checkpointing): forward is a non-reentrant torch.utils.checkpoint of the
    class's own forward; the backward recomputes it."""

    checkpoint_to_cpu = False      # activation_checkpointing.cpu_checkpointing: CheckpointedToCPUBlock

    def forward(self, *args, **kwargs):
        ctx = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if self.checkpoint_to_cpu
               else contextlib.nullcontext())
        with ctx:
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


class CheckpointedToCPUBlock(CheckpointedBlock):
    """CheckpointedBlock whose saved inputs wait for backward in host memory (save_on_cpu)."""

    checkpoint_to_cpu = True


@functools.cache
def checkpointed_class(cls: type, mixin: type) -> type:
    """`cls` with `mixin` in front, one class per pair (blocks of one class share it), named as `cls` (code that
    finds blocks by class name, _no_split_modules, still finds them); its forward keeps `cls.forward`'s signature."""
    @functools.wraps(cls.forward)
    def forward(self, *args, **kwargs):
        return mixin.forward(self, *args, **kwargs)
    return type(cls.__name__, (mixin, cls), {"forward": forward, "__module__": cls.__module__,
                                             "__qualname__": cls.__qualname__})
