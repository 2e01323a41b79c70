"""Ulysses sequence parallelism for transformers models: DeepSpeed's ALST (`sequence_parallel_size: N`).

What DeepSpeed 0.19.8's runtime/sequence_parallel/ulysses_sp.py does, on torch.distributed alone:

- attention: each rank holds 1/N of the sequence. An all-to-all trades it for 1/N of the heads over the whole
  sequence, the model's own attention (sdpa, eager, flash) runs on that, and a second all-to-all trades back. KV
  heads fewer than N are replicated first, as DeepSpeed does. The wrapper is registered in transformers'
  AttentionInterface (UlyssesSPAttentionHF.register_with_transformers overrides the core key process-wide; here the
  model gets its own key, so other models in the process keep plain attention, and eager works: transformers calls
  eager directly, never through the registry). Masks are dropped, as DeepSpeed drops them: attention is causal over
  the global sequence (eager gets that causal mask built here), and positions come from `position_ids`.
- data: `shard_batch` / `UlyssesSPDataLoaderAdapter` shift the labels over the whole sequence (pad one -100, drop the
  first) into `shift_labels`, then keep this rank's slice of every tensor; `position_ids` stay global. The adapter
  gathers one batch from each rank of the group and hands them out one after another, as DeepSpeed's.
- loss: each rank's mean over its real tokens, weighted by their count and averaged over the group
  (`sequence_parallel_loss`, the HF Trainer's deepspeed_sp_compute_loss). Every rank of a group holds that loss;
  its gradient summed over the group is N x the sequence's, and ZeRO (FSDP2 over all ranks, dp x sp flattened as
  DeepSpeed partitions over its sequence-data-parallel group) averages over dp x sp: the unsharded gradient.
- with AutoTP: a data replica is tp ranks; an sp group joins sp consecutive replicas, one group per tp rank, and
  splits the heads that tp rank holds. The sp groups are process groups inside the data dimension, not a mesh
  dimension: ZeRO's mesh stays the data mesh (dp x sp).
"""
from __future__ import annotations

import inspect
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

log = logging.getLogger("fsdpzero")

KEY = "sequence_parallel_size"
# the cores whose calling convention the wrapper knows (q/k/v as [batch, heads, seq, head_dim], output as
# [batch, seq, heads, head_dim]); flex_attention's BlockMask would need rebuilding for the global sequence
CORES = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


# -- checks: pure, before any process group ----------------------------------------------------------------------
def check_model(model: Any, size: int, tp: int = 1) -> str:
    """The model's attention can be split over `size` ranks: a transformers model, heads and KV heads dividing (KV
    heads may also be a divisor of `size`: replicated, as DeepSpeed), a core attention the wrapper knows. With
    tensor parallelism `tp`, the heads each tp rank holds are what sp splits. Returns the core attention
    implementation."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ValueError(f"{KEY} = {size} needs a transformers model (one with a `config`); "
                         f"{type(model).__name__} has none: set {KEY} to 1")
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        raise ValueError(f"{KEY} = {size}: {type(model).__name__}'s config has no num_attention_heads; "
                         f"set {KEY} to 1")
    with_tp = f" x tensor_parallel.autotp_size {tp}" if tp > 1 else ""
    if heads % (size * tp):
        raise ValueError(f"{KEY} = {size}{with_tp} does not divide the model's {heads} attention heads "
                         f"(num_attention_heads): use a divisor of {heads // tp if heads % tp == 0 else heads}")
    if kv % tp == 0:   # tp's own kv-head check (fsdpzero/parallel/tp_plan.py) comes first
        kv //= tp
    if kv % size and size % kv:
        raise ValueError(f"{KEY} = {size} and the model's {kv} KV heads (num_key_value_heads"
                         f"{', per tensor-parallel rank' if tp > 1 else ''}): neither divides the other; use a "
                         f"divisor of {kv} or a multiple of it that divides {heads // tp}")
    can_switch = getattr(model, "_can_set_attn_implementation", None)
    if can_switch is not None and not can_switch():
        raise ValueError(f"{KEY} = {size}: {type(model).__name__} does not route its attention through transformers' "
                         f"AttentionInterface, so Ulysses cannot wrap it; set {KEY} to 1")
    core = getattr(config, "_attn_implementation", None) or "eager"
    core = core.split("-", 2)[2] if core.startswith(PREFIX + "-") else core   # registered already: its core
    if core not in CORES:
        raise ValueError(f"{KEY} = {size} with attn_implementation {core!r}: Ulysses wraps {list(CORES)}; load the "
                         f"model with attn_implementation=\"sdpa\"")
    return core


def check_seq_len(seq_len: int, size: int) -> None:
    if seq_len % size:
        raise ValueError(f"{KEY} = {size} does not divide the batch's sequence length {seq_len}: pad the batch to "
                         f"a multiple of {size} (labels -100 on the padding), e.g. {-(-seq_len // size) * size}")


# -- the all-to-alls -----------------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0; its gradient is the same exchange back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


class _AllReduceSum(torch.autograd.Function):
    """A sum over the group whose gradient is the sum of the ranks' gradients: every rank holds the loss and seeds
    its backward, so each rank's share gets N x its weight (DeepSpeed's differentiable all_gather gives the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    # contiguous in and out: all_to_all_single reads and writes flat memory, and a gradient arrives permuted
    # (empty_like would copy its strides)
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def heads_to_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[batch, heads, seq/N, d] (this rank's slice of the sequence) -> [batch, heads/N, seq, d]."""
    b, h, s, d = x.shape
    x = x.reshape(b, size, h // size, s, d).transpose(0, 1)            # [N(dest), b, h/N, s/N, d]
    x = _AllToAll.apply(x.contiguous(), group)                          # [N(source = sequence slice), ...]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def sequence_to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[batch, seq, heads/N, d] -> [batch, seq/N, heads, d] (the layout transformers' attention returns)."""
    b, s, h, d = x.shape
    x = x.reshape(b, size, s // size, h, d).transpose(0, 1)            # [N(dest = sequence slice), b, s/N, h/N, d]
    x = _AllToAll.apply(x.contiguous(), group)                          # [N(source = head slice), ...]
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)


# -- attention -----------------------------------------------------------------------------------------------------
PREFIX = "fsdpzero_ulysses"


class UlyssesAttention:
    """The attention function registered for a model: all-to-all, the core attention on whole sequences and 1/N of
    the heads, all-to-all back."""

    def __init__(self, core: str, group, size: int, heads: int, kv_heads: int, key: str = ""):
        self.core, self.group, self.size, self.key = core, group, size, key
        self.heads, self.kv_heads = heads, kv_heads
        self.kv_repeat = size // kv_heads if kv_heads < size else 1   # DeepSpeed's kv_replication_factor
        # DeepSpeed's disable_in_eval (accelerate sets it for the HF Trainer, whose evaluation batches are whole
        # sequences, one per rank): in eval mode the core attention runs on this rank's batch alone
        self.disable_in_eval = False
        self.warned_eval = False

    def core_function(self, module):
        if self.core == "eager":   # each modeling file has its own eager, called directly by the model
            return inspect.getmodule(type(module)).eager_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        return ALL_ATTENTION_FUNCTIONS[self.core]

    @staticmethod
    def causal_mask(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Eager adds the mask it gets; without one it would not be causal (the mask builder gives none)."""
        n, m = q.shape[2], k.shape[2]
        return torch.full((n, m), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(m - n + 1)[None, None]

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        if self.disable_in_eval and not module.training:
            if torch.is_grad_enabled() and not self.warned_eval:   # a training step on a model left in eval mode
                self.warned_eval = True
                log.warning("sequence parallelism is off in attention: the model is in eval mode and disable_in_eval "
                            "is set (accelerate sets it), so each rank attends only within its own slice of the "
                            "sequence -> call model.train() before training (from_pretrained returns eval mode)")
            mask = self.causal_mask(query, key) if self.core == "eager" else None
            out, _ = self.core_function(module)(module, query, key, value, mask, *args, **kwargs)
            return out, None
        if self.kv_repeat > 1:
            key = key.repeat_interleave(self.kv_repeat, dim=1)
            value = value.repeat_interleave(self.kv_repeat, dim=1)
        q = heads_to_sequence(query, self.group, self.size)
        k = heads_to_sequence(key, self.group, self.size)
        v = heads_to_sequence(value, self.group, self.size)
        mask = self.causal_mask(q, k) if self.core == "eager" else None
        if self.core.startswith("flash") and kwargs.get("position_ids") is not None:
            # flash reads position_ids to find packed documents: the global ones, as DeepSpeed gathers them
            pos = kwargs["position_ids"].contiguous()
            parts = [torch.empty_like(pos) for _ in range(self.size)]
            dist.all_gather(parts, pos, group=self.group)
            kwargs["position_ids"] = torch.cat(parts, dim=1)
        groups = module.num_key_value_groups
        module.num_key_value_groups = q.shape[1] // k.shape[1]   # changed only with replicated KV heads
        try:
            out, _ = self.core_function(module)(module, q, k, v, mask, *args, **kwargs)
        finally:
            module.num_key_value_groups = groups
        # the attention weights cover 1/N of the heads of the whole sequence: not returned, as DeepSpeed's eager
        # path cannot return them either
        return sequence_to_heads(out, self.group, self.size), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask builder for the wrapper's key: no mask for the local slice (useless after the all-to-all and
    O(seq^2) to build), as DeepSpeed discards it."""
    return None


def register_with_transformers(model, group, size: int, tp: int = 1) -> UlyssesAttention:
    """Register the Ulysses attention for `model` and switch the model to it; returns it (its `key` is the
    registered name). The core is the model's attn_implementation (sdpa, eager, flash_attention_2/3). `tp`:
    tensor-parallel ranks, each holding 1/tp of the heads."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    core = check_model(model, size, tp)
    text = model.config.get_text_config()
    heads = text.num_attention_heads // tp
    kv = (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) // tp
    key = f"{PREFIX}-{id(group):x}-{core}"
    attention = UlyssesAttention(core, group, size, heads, kv, key)
    AttentionInterface.register(key, attention)
    AttentionMaskInterface.register(key, _no_mask)
    model.set_attn_implementation(key)
    if model.config._attn_implementation != key:   # transformers only warns when a model cannot switch
        raise ValueError(f"{KEY} = {size}: {type(model).__name__} kept attn_implementation "
                         f"{model.config._attn_implementation!r}; Ulysses cannot wrap its attention")
    return attention


# -- data ----------------------------------------------------------------------------------------------------------
def shard_batch(batch: dict, sp_rank: int, sp_size: int) -> dict:
    """DeepSpeed's per-batch step: `labels` shifted over the whole sequence into `shift_labels` (one -100 padded at
    the end), then this rank's 1/N of every tensor along dim 1; non-tensors copied. position_ids are required
    (they must be global: each rank's RoPE reads them)."""
    if "position_ids" not in batch:
        raise ValueError(f"{KEY} > 1 needs `position_ids` in every batch (global positions: "
                         "torch.arange(seq_len) per sample, restarting at each document when packed): add them in "
                         "the collator")
    seq_len = batch["input_ids"].shape[1]
    check_seq_len(seq_len, sp_size)
    batch = dict(batch)
    if "labels" in batch:
        labels = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)
        batch["shift_labels"] = labels[..., 1:].contiguous()
    chunk = seq_len // sp_size
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v):
            if v.dim() < 2 or v.shape[1] != seq_len:
                raise ValueError(f"batch[{k!r}] has shape {list(v.shape)}; under {KEY} every tensor is "
                                 f"[batch, seq_len={seq_len}, ...] (it is sliced along the sequence)")
            out[k] = v[:, chunk * sp_rank:chunk * (sp_rank + 1)].contiguous()   # a copy: the batch is freed
        else:
            out[k] = v
    return out


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's adapter, same signature: each rank's loader yields its own batches; one refill gathers the next
    batch of every rank of the sequence-parallel group, and hands them out in rank order, each sharded with
    `shard_batch`. N iterations of the adapter consume one batch of each rank: over N steps the group trains on
    the samples the N ranks' loaders gave."""

    def __init__(self, dl: Iterable, sp_rank: int, sp_group, sp_world_size: int, device):
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device = torch.device(device)
        self.iter = iter(dl)
        self.taken = 0   # batches read from self.iter
        self.peeked = None
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        # a pass read to its end without meeting the StopIteration that resets it starts over here: the HF Trainer
        # takes exactly len(self) batches an epoch, so the next epoch's first batch met the spent iterator and that
        # update was lost (one optimizer step an epoch; DeepSpeed's adapter does that)
        if not self.micro_batches and self.peeked is None and hasattr(self.dl, "__len__") \
                and self.taken >= len(self.dl):
            try:   # run the spent pass to its end (accelerate's loader counts its epochs there: the next shuffle)
                self.peeked = next(self.iter)   # a loader longer than its len(): kept for the next refill
            except StopIteration:
                self.iter, self.taken = iter(self.dl), 0
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch, self.peeked = (next(self.iter) if self.peeked is None else self.peeked), None
        except StopIteration:
            self.iter, self.taken = iter(self.dl), 0    # the next epoch starts on the next call, as DeepSpeed's
            raise
        self.taken += 1
        if "position_ids" not in batch:   # same error on every rank before any collective: the collators match
            shard_batch(batch, 0, 1)
        n, group = self.sp_world_size, self.sp_group
        names = sorted(batch)
        # shapes first (batches may differ in length across ranks; gloo gathers equal shapes only): pad to the
        # longest along dim 1, gather, cut back
        shapes = [(k, list(batch[k].shape)) if torch.is_tensor(batch[k]) else (k, None) for k in names]
        all_shapes: list = [None] * n
        dist.all_gather_object(all_shapes, shapes, group=group)
        gathered: list[dict] = [{} for _ in range(n)]
        for k in names:
            v = batch[k]
            if not torch.is_tensor(v):
                objs: list = [None] * n
                dist.all_gather_object(objs, v, group=group)
                for r in range(n):
                    gathered[r][k] = objs[r]
                continue
            theirs = [dict(s)[k] for s in all_shapes]
            longest = max(s[1] for s in theirs)
            v = v.to(self.device)
            padded = torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, longest - v.shape[1]))
            parts = [torch.empty([theirs[r][0], longest, *theirs[r][2:]], dtype=v.dtype, device=self.device)
                     for r in range(n)]
            if any(p.shape[0] != padded.shape[0] or p.shape[2:] != padded.shape[2:] for p in parts):
                raise ValueError(f"batch[{k!r}] shapes differ across the {KEY} group beyond the sequence "
                                 f"length: {[s for s in theirs]}; give every rank the same micro-batch size")
            dist.all_gather(parts, padded.contiguous(), group=group)
            for r in range(n):
                gathered[r][k] = parts[r][:, :theirs[r][1]]
        for b in gathered:
            self.micro_batches.append(shard_batch(b, self.sp_rank, n))


# -- the loss ------------------------------------------------------------------------------------------------------
def sequence_parallel_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group) -> torch.Tensor:
    """Each rank's mean loss over its real tokens -> the mean over the real tokens of the whole sequence, on every
    rank of the group, differentiable (the HF Trainer's weighted aggregation for DeepSpeed SP). A rank whose slice
    has no real token (its mean is nan) weighs zero."""
    good = (shift_labels != -100).sum().to(loss.dtype)
    weighted = torch.where(good > 0, loss * good, torch.zeros_like(loss))
    total = _AllReduceSum.apply(weighted, group)
    count = good.detach().clone()
    dist.all_reduce(count, group=group)
    return total / count.clamp(min=1)


# -- what the engine holds -----------------------------------------------------------------------------------------
@dataclass
class SequenceParallel:
    size: int
    rank: int           # in the group
    group: Any          # the ranks [i*size, (i+1)*size), as DeepSpeed's parallel_state_sp
    key: str            # the attention key registered for the model
    attention: UlyssesAttention | None = None   # what is registered under it
    # DeepSpeed's engine semantics (accelerate's ALST door, fsdpzero/compat/sequence_parallel.py): the batch goes to
    # the model as it is (shift_labels, no labels: no loss in forward) and the loop weighs the ranks' losses itself
    loss_in_loop: bool = False

    def model_inputs(self, kwargs: dict) -> dict:
        """Before the model: a sharded batch carries position_ids (else RoPE would restart on every slice), and its
        `shift_labels` are the labels the model's loss reads (labels are already shifted: transformers' loss uses
        shift_labels when given)."""
        if "input_ids" in kwargs or "inputs_embeds" in kwargs:
            if kwargs.get("position_ids") is None:
                raise ValueError(f"{KEY} = {self.size}: the model was called without position_ids; feed the batches "
                                 "of UlyssesSPDataLoaderAdapter / shard_batch (they carry the global positions)")
            if kwargs.get("labels") is not None and "shift_labels" not in kwargs:
                # a batch that was never split: its labels are unshifted, and each rank would take its whole
                # sequence for a slice of a longer one
                raise ValueError(f"{KEY} = {self.size}: the batch has `labels` but no `shift_labels`, so it was not "
                                 "split along the sequence; feed it through UlyssesSPDataLoaderAdapter "
                                 "(fsdpzero.initialize(training_data=...) does) or "
                                 "fsdpzero.parallel.ulysses.shard_batch")
        if "shift_labels" in kwargs and kwargs.get("labels") is None and not self.loss_in_loop:
            kwargs = dict(kwargs, labels=kwargs["shift_labels"])
        return kwargs

    def reduce_output(self, out: Any, kwargs: dict) -> Any:
        """After the model: its loss (this slice's mean) becomes the whole sequence's mean."""
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None or "shift_labels" not in kwargs or self.loss_in_loop:
            return out
        out["loss"] = sequence_parallel_loss(loss, kwargs["shift_labels"], self.group)
        return out

    def dataloader(self, dl: Iterable, device) -> UlyssesSPDataLoaderAdapter:
        return UlyssesSPDataLoaderAdapter(dl, self.rank, self.group, self.size, device)

    # DeepSpeed's mpu (parallel_state_sp) accessors
    def get_sequence_parallel_group(self):
        return self.group

    def get_sequence_parallel_world_size(self) -> int:
        return self.size

    def get_sequence_parallel_rank(self) -> int:
        return self.rank


def sequence_parallel_ranks(world: int, size: int, tp: int = 1) -> list[list[int]]:
    """The sp groups: `size` consecutive data-parallel replicas (DeepSpeed's groups of consecutive ranks); with
    tensor parallelism (tp innermost in the mesh, a replica = tp consecutive ranks) one group per tp coordinate."""
    return [[(i * size + j) * tp + t for j in range(size)] for i in range(world // (size * tp)) for t in range(tp)]


def apply_sequence_parallel(model, plan) -> SequenceParallel | None:
    """After the process group exists, before sharding: the sp groups (sequence_parallel_ranks), and the model's
    attention registered over this rank's group. None when the size is 1."""
    size, tp = plan.sequence_parallel.size, plan.tensor_parallel.size
    if size <= 1:
        return None
    rank, mine = dist.get_rank(), None
    for ranks in sequence_parallel_ranks(dist.get_world_size(), size, tp):
        group = dist.new_group(ranks)   # every rank creates every group, in the same order
        if rank in ranks:
            mine = group
    attention = register_with_transformers(model, mine, size, tp)
    log.info("sequence parallelism: %d groups of %d ranks%s, %s attention behind head/sequence all-to-alls",
             dist.get_world_size() // size, size, f" (one per tp rank, {tp})" if tp > 1 else " (consecutive)",
             attention.core)
    return SequenceParallel(size=size, rank=dist.get_rank(mine), group=mine, key=attention.key, attention=attention)


__all__ = ["CORES", "SequenceParallel", "UlyssesAttention", "UlyssesSPDataLoaderAdapter", "apply_sequence_parallel",
           "check_model", "check_seq_len", "heads_to_sequence", "register_with_transformers",
           "sequence_parallel_loss", "sequence_parallel_ranks", "sequence_to_heads", "shard_batch"]
