"""Errors that happen on some ranks only (a path one rank cannot write, a full disk, a corrupt file one rank checked)
agreed on by all of them before anyone moves on, so every rank raises the same error and no rank is left waiting in
a collective the others never reach: fsdpzero.dist.agree_on_error (one all-reduce when all is well), raised here as
the checkpoint wing's error types. Also DeepSpeed's checkpoint.tag_validation.
"""
from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist

from fsdpzero.dist import RanksError, agree_on_error


class CheckpointError(RanksError):
    """A checkpoint save or load failed; raised with the same message on every rank."""


def agree(message: str | None, error: type[BaseException] = CheckpointError, distributed: bool = True) -> None:
    """Collective over the world when `distributed`: if any rank passed a message, every rank raises
    `error`(the message, with the failing ranks named). Not distributed (this process alone, e.g. an offline
    conversion inside a distributed program): `message` alone decides, with no collective."""
    if not distributed or not dist.is_initialized():
        if message is not None:
            raise error(message)
        return
    try:
        agree_on_error(message)
    except RanksError as e:
        raise error(str(e)) from None


def describe(e: BaseException) -> str:
    """One line for an exception, DCP's CheckpointException (a BaseException wrapping each rank's) included."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"{describe(inner)} (rank {rank})"
    seen, cause = set(), e   # torch.save hides a full disk behind "unexpected pos": name the OSError underneath
    while cause is not None and id(cause) not in seen and not isinstance(cause, OSError):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    e = cause if isinstance(cause, OSError) else e
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _device() -> torch.device:
    # the default group: gloo (CPU), or `cuda:nccl,cpu:gloo` as fsdpzero.dist makes it; NCCL alone wants CUDA
    if "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def check_tag_across_ranks(tag: str, mode: str) -> None:
    """DeepSpeed's checkpoint.tag_validation: compare the tag's SHA-1 across ranks (one all-reduce of the digest
    and its negation, MAX); "warn" logs, "fail" raises ValueError on every rank, "ignore" skips the collective."""
    if mode == "ignore" or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = torch.tensor(list(hashlib.sha1(tag.encode()).digest()), dtype=torch.int32)   # gloo: no int16
    both = torch.cat([digest, -digest]).to(_device())
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if torch.equal(both[:20].cpu(), digest) and torch.equal(-both[20:].cpu(), digest):
        return
    message = (f"checkpoint tag {tag!r} (rank {dist.get_rank()}) is not the same on every rank; a rank-specific "
               f"tag breaks loading on another world size. Use one tag on all ranks (checkpoint.tag_validation="
               f"{mode.upper()})")
    if mode == "fail":
        raise ValueError(message)
    logging.getLogger("fsdpzero").warning("%s", message)
