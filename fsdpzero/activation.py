"""Activation checkpointing (the `activation_checkpointing` section, or HF gradient checkpointing) on blocks.

Applied *before* `fully_shard`, with FSDP2's hooks outside the checkpointed region, as torchtitan does, so the
recomputation in backward finds the block's parameters already all-gathered and does not all-gather twice:
- Hugging Face models: their own `activation_checkpointing_enable` (non-reentrant). Transformers checkpoints each
  layer's `forward`, not `__call__`, and turns off the KV cache the recompute would otherwise write twice.
- Other models: each block's `forward` is replaced by a non-reentrant `torch.utils.checkpoint` of itself.

`cpu_checkpointing` (DeepSpeed: checkpoints in host memory) runs each checkpointed block under `save_on_cpu`: the
non-reentrant checkpoint saves the block's inputs through autograd's saved-tensor hooks, so those inputs (what the
recompute needs) wait for backward in host memory (pinned on GPU hosts); transformers' `offload=True` is the same.
"""
from __future__ import annotations

import contextlib
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
    for block in blocks:
        if not getattr(block, "_fsdpzero_checkpointed", False):
            block.forward = _checkpointed(block.forward, cpu_offload)
            block._fsdpzero_checkpointed = True
    return "torch"


def _checkpointed(forward, cpu_offload: bool):
    def run(*args, **kwargs):
        ctx = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if cpu_offload
               else contextlib.nullcontext())
        with ctx:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run
