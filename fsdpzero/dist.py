"""Process group and device from the launcher's environment (torchrun, or DeepSpeed's launcher).

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; DeepSpeed's launcher also passes
`--local_rank=N` on the command line. No RANK means a single process: a one-rank group on an in-memory store, so
the same FSDP2 code runs without a launcher.
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def device_type(self) -> str:
        return self.device.type


def local_rank_from_argv(argv: list[str] | None = None) -> int | None:
    """`--local_rank=N` / `--local_rank N` / `--local-rank N` as DeepSpeed's launcher passes it."""
    argv = sys.argv if argv is None else argv
    for i, a in enumerate(argv):
        for flag in ("--local_rank", "--local-rank"):
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
            if a == flag and i + 1 < len(argv):
                return int(argv[i + 1])
    return None


def detect_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(device_type: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Join (or create) the default process group. GPU: `cuda:nccl,cpu:gloo` so CPU tensors (offload, the
    stage-1 CPU path) have a backend too. CPU: gloo. Reuses a group the caller already initialised."""
    device_type = device_type or detect_device_type()
    if "LOCAL_RANK" not in os.environ and (lr := local_rank_from_argv()) is not None:
        os.environ["LOCAL_RANK"] = str(lr)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout,
                                    device_id=device if device_type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank start from rank `src`'s weights and buffers, as DeepSpeed and DDP do at wrap time
    (FSDP2 trusts each rank to have built the same model)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=src)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t
