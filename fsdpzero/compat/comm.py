"""`deepspeed.comm` under `fsdpzero launch`: torch.distributed, which DeepSpeed's comm wraps with the same names
(get_rank, get_world_size, barrier, all_reduce, ...), plus DeepSpeed's get_local_rank and init_distributed
(accelerate's PartialState joins the process group through `deepspeed.comm.init_distributed`)."""
from __future__ import annotations

import os

import torch.distributed as _dist

from fsdpzero.api import init_distributed  # noqa: F401  (DeepSpeed's name; the backend follows the device)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def __getattr__(name):
    return getattr(_dist, name)
