"""ZeRO stage 1, which FSDP2 lacks: replicated parameters, fp32 masters and optimizer state sharded in flat buckets.

`Stage1Optimizer` (optimizer.py) drives one step: reduce-scatter of the gradients into fp32 shards at the
accumulation boundary, the inner optimizer's step over this rank's shard, all-gather of the parameters.
layout.py packs parameters into buckets, gather.py all-gathers them, step.py fuses the update, state.py gives the
logical (per-parameter) optimizer state for checkpoints.
"""
from .optimizer import Stage1Optimizer  # noqa: F401
