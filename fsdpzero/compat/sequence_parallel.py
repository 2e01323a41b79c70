"""DeepSpeed's ALST / Ulysses names that accelerate's DeepSpeed door reaches for, under `fsdpzero launch` (see
fsdpzero/compat/shim.py), run by fsdpzero.parallel.ulysses:

- `deepspeed.runtime.sequence_parallel.ulysses_sp`: `UlyssesSPAttentionHF.register_with_transformers` (accelerate's
  `_prepare_deepspeed` calls it when `ParallelismConfig(sp_backend="deepspeed", sp_size=N)`) builds the sp groups
  (N consecutive ranks, as DeepSpeed's parallel_state_sp), registers the model's Ulysses attention and returns the
  mpu that accelerate hands to `deepspeed.initialize(mpu=...)` and reads the group from for
  `UlyssesSPDataLoaderAdapter` (fsdpzero's, same signature).
- `deepspeed.utils.groups`: `_get_sequence_parallel_group` / `_world_size` / `_rank`, what accelerate's ALST test
  script and `Accelerator.deepspeed_ulysses_dl_adapter` read after `prepare`: the mpu of the last engine built.

As with DeepSpeed, the loop aggregates the loss: the adapter's batches carry `shift_labels` and no `labels`, so the
model computes no loss, and the loop weighs each rank's mean over its real tokens across the group (accelerate's
docs). The engine built with this mpu therefore passes batches through as DeepSpeed's does (`loss_in_loop`).
"""
from __future__ import annotations

import logging

import torch.distributed as dist

from fsdpzero.parallel.ulysses import KEY, PREFIX, SequenceParallel, UlyssesSPDataLoaderAdapter  # noqa: F401
from fsdpzero.parallel.ulysses import check_model
from fsdpzero.parallel.ulysses import register_with_transformers as register_attention
from fsdpzero.parallel.ulysses import sequence_parallel_ranks

log = logging.getLogger("fsdpzero")

# deepspeed.utils.groups.mpu: set by initialize(mpu=...) (DeepSpeed's engine sets it in _configure_distributed_model)
mpu: SequenceParallel | None = None


def check_attention(model, core: str | None) -> None:
    """DeepSpeed 0.19.8's check: the core attention named for the wrapper is the one the model was loaded with (the
    wrapper takes over the model's active attention path). Pure."""
    have = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if have and have.startswith(PREFIX + "-"):
        have = have.split("-", 2)[2]
    if core is not None and have is not None and have != core:
        raise ValueError(f"ParallelismConfig sp_handler sp_attn_implementation={core!r} but the model was loaded with "
                         f"attn_implementation={have!r}: set both the same (from_pretrained(..., "
                         f"attn_implementation={core!r}) or sp_attn_implementation={have!r})")


class UlyssesSPAttentionHF:
    """deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF: only its registration entry point."""

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, max_length=None):
        """Build the sp groups, register `model_name_or_path`'s Ulysses attention over this rank's group, return the
        mpu (fsdpzero.parallel.ulysses.SequenceParallel: DeepSpeed's parallel_state_sp accessors). A loaded model is
        required (fsdpzero registers the attention per model, not process-wide). micro_batch_size and seq_length
        only size DeepSpeed's buffers: fsdpzero takes the shapes from each batch."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("sp_seq_length_is_variable=False needs sp_seq_length (the fixed sequence length of every "
                             "batch): set it, or leave sp_seq_length_is_variable True")
        model = model_name_or_path
        if isinstance(model, str) or not hasattr(model, "config"):
            raise ValueError(f"UlyssesSPAttentionHF.register_with_transformers({model!r}): under fsdpzero the loaded "
                             "model is required (its attention is registered per model): pass the model object")
        check_attention(model, core_attn_implementation)
        try:   # heads and attention before any sp group, naming what accelerate's users set
            check_model(model, sequence_parallel_size)
        except ValueError as e:
            raise ValueError(str(e).replace(KEY, "ParallelismConfig sp_size")) from None
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % sequence_parallel_size:
            raise ValueError(f"ParallelismConfig sp_size = {sequence_parallel_size} does not divide the {world} "
                             f"ranks: use a divisor of {world}")
        mine = None
        for ranks in sequence_parallel_ranks(world, sequence_parallel_size):
            group = dist.new_group(ranks)   # every rank creates every group, in the same order
            if rank in ranks:
                mine = group
        attention = register_attention(model, mine, sequence_parallel_size)
        attention.disable_in_eval = bool(disable_in_eval)
        log.info("sequence parallelism (accelerate's ALST): %d groups of %d consecutive ranks, %s attention behind "
                 "head/sequence all-to-alls", world // sequence_parallel_size, sequence_parallel_size, attention.core)
        return SequenceParallel(size=sequence_parallel_size, rank=dist.get_rank(mine), group=mine, key=attention.key,
                                attention=attention, loss_in_loop=True)


def engine_config(config: dict, sp: SequenceParallel) -> dict:
    """The DeepSpeed config `deepspeed.initialize(mpu=sp)` runs: `sequence_parallel_size` from the mpu (so the batch
    triad counts world / sp), after the checks that would otherwise fail later with less to go on. Pure."""
    tp = (config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1
    if isinstance(tp, int) and tp > 1:
        raise ValueError(f"tensor_parallel.autotp_size = {tp} with accelerate's ParallelismConfig sp_size = {sp.size}: "
                         "AutoTP x Ulysses is not provided in accelerate's door (DeepSpeed's ALST groups ignore tp); "
                         "run both through fsdpzero.hf.Trainer (sequence_parallel_size and tensor_parallel.autotp_size "
                         "in the DeepSpeed config) or set one of them to 1")
    key = config.get(KEY)
    if isinstance(key, int) and key > 1 and key != sp.size:
        raise ValueError(f"{KEY} = {key} in the DeepSpeed config but ParallelismConfig sp_size = {sp.size}: make them "
                         "equal, or set only one")
    return {**config, KEY: sp.size}


def check_batch_triad(config: dict, world: int, sp: int) -> None:
    """accelerate sets train_batch_size = micro x GA x ParallelismConfig.data_parallel_size (dp_replicate x dp_shard,
    1 unless set) under DeepSpeed SP, while the ranks hold world / sp data replicas: name the setting. Pure."""
    tbs, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps", 1)
    if not all(isinstance(v, int) for v in (tbs, micro, gas)) or tbs == micro * gas * (world // sp):
        return
    raise ValueError(f"train_batch_size = {tbs} but {world} ranks with sp_size {sp} hold {world // sp} data "
                     f"replica(s) (micro {micro} x GA {gas} x {world // sp} = {micro * gas * (world // sp)}): accelerate "
                     f"sets it from ParallelismConfig dp_replicate_size x dp_shard_size -> set "
                     f"ParallelismConfig(dp_shard_size={world // sp}, sp_size={sp}) (dp x sp = the number of ranks)")


# -- deepspeed.utils.groups ----------------------------------------------------------------------------------------
def _get_sequence_parallel_group():
    if mpu is None:
        raise KeyError("No sequence parallel group found")   # DeepSpeed's, before an engine with an mpu exists
    return mpu.get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    return mpu.get_sequence_parallel_world_size() if mpu is not None else 1


def _get_sequence_parallel_rank() -> int:
    return mpu.get_sequence_parallel_rank() if mpu is not None else 0


__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "_get_sequence_parallel_group",
           "_get_sequence_parallel_rank", "_get_sequence_parallel_world_size", "check_attention",
           "check_batch_triad", "engine_config", "mpu"]
