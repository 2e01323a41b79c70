"""Errors that happen on some ranks only (a path one rank cannot write, a full disk, a corrupt file one rank checked)
agreed on by all of them before anyone moves on, so every rank raises the same error and no rank is left waiting in
a collective the others never reach: fsdpzero.dist.agree_on_error (one all-reduce when all is well), raised here as
the checkpoint wing's error types. Also what every rank must agree on before a load reads anything: which checkpoint
(resolve_on_rank0), and DeepSpeed's checkpoint.tag_validation.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from fsdpzero.checkpoint.files import LATEST, resolve_tag
from fsdpzero.dist import RanksError, agree_on_error, check_same_on_all_ranks


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
    # the default group: gloo (CPU), `cuda:nccl,cpu:gloo` as fsdpzero.dist makes it, or what a script's bare
    # init_process_group() made ("undefined" on a CPU-only torch): only NCCL alone wants CUDA tensors
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    try:   # the same words on every rank: which ranks have which tag
        check_same_on_all_ranks({"tag": repr(tag)}, "checkpoint tags")
        tags = "tags differ"   # the digests disagreed but the texts agree: cannot happen short of a SHA-1 collision
    except RanksError as e:
        tags = str(e).split("\n", 1)[1].strip().removeprefix("tag: ")
    message = (f"checkpoint tag is not the same on every rank ({tags}); a rank-specific tag breaks loading on "
               f"another world size. Use one tag on all ranks (checkpoint.tag_validation={mode.upper()})")
    if mode == "fail":
        raise ValueError(message)
    logging.getLogger("fsdpzero").warning("%s", message)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_text(text: str) -> str:
    """Rank 0's `text` on every rank (collective over the world; no pickle): its length, then its UTF-8 bytes."""
    if _world() == 1:
        return text
    device = _device()
    data = text.encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if data:
        buf.copy_(torch.tensor(list(data), dtype=torch.uint8))
    if buf.numel():
        dist.broadcast(buf, 0)
    return bytes(buf.cpu().tolist()).decode()


def resolve_on_rank0(load_dir: str | Path, tag: str | None = None, latest: str = LATEST) -> Path:
    """files.resolve_tag on rank 0 alone, its answer shared (collective): every rank loads the same checkpoint even
    if `latest` changes or vanishes meanwhile (another job saving there), before any tensor is read. A checkpoint
    directory that some ranks cannot see (storage that is not shared) is a CheckpointError on every rank; one that
    no rank sees is left to the load's completeness check. resolve_tag's own errors (no `latest`: FileNotFoundError;
    a bad tag: ValueError) are raised on every rank, as that type."""
    load_dir = Path(load_dir)
    if _world() == 1:
        return resolve_tag(load_dir, tag, latest)
    error, name = None, ""
    if dist.get_rank() == 0:
        try:
            name = resolve_tag(load_dir, tag, latest).name
        except (ValueError, OSError) as e:
            error = e
    agree_on_error(error)   # typed: a missing `latest` is a FileNotFoundError on every rank
    path = load_dir / broadcast_text(name)
    seen = torch.tensor([int(path.is_dir() and not path.is_symlink())], dtype=torch.int64, device=_device())
    dist.all_reduce(seen)
    problem = None
    if 0 < int(seen.item()) < _world() and not (path.is_dir() and not path.is_symlink()):
        named = f"tag={tag!r}" if tag is not None else f"{load_dir / latest}"
        problem = (f"checkpoint {path} (named by {named} on rank 0) is not on rank {dist.get_rank()}: every rank "
                   f"must see the same checkpoint directory (shared storage), or copy it to every node")
    agree(problem)
    return path
