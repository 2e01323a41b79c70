"""Activation checkpointing (the `activation_checkpointing` section, or HF gradient checkpointing) on blocks.

Applied to each transformer block *before* `fully_shard`, as torchtitan does: FSDP2's hooks stay outside the
checkpointed region, so the recomputation in backward sees the block's parameters already all-gathered.
`cpu_checkpointing` additionally keeps the checkpointed block inputs in host memory until backward
(`torch.autograd.graph.save_on_cpu`), which is what DeepSpeed's CPU checkpointing buys.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(blocks: Iterable[nn.Module], *, cpu_offload: bool = False) -> int:
    """Make each block's forward recompute in backward (non-reentrant). Returns the number wrapped."""
    n = 0
    for block in blocks:
        if getattr(block, "_fsdpzero_checkpointed", False):
            continue
        block.forward = _checkpointed(block.forward, cpu_offload)
        block._fsdpzero_checkpointed = True
        n += 1
    return n


def _checkpointed(forward, cpu_offload: bool):
    def run(*args, **kwargs):
        ctx = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if cpu_offload
               else contextlib.nullcontext())
        with ctx:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run
