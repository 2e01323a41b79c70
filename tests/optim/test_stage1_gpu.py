"""GPU, 4 ranks: stage 1's bucketed reduce-scatter / all-gather on NCCL where the shard count matters. The tiny model's
tensors (370, 230, 23, ... elements) split unevenly over 4 ranks and over the 300-element buckets, so a bucket
boundary, a padded shard or a rank's offset that is wrong by one shows at 4 ranks even where 2 pass. The same rank
functions as the 2-GPU tests in tests/optim/test_stage1.py. Not part of CPU CI; run with

    pytest -m gpu tests/optim/test_stage1_gpu.py -v
"""
from __future__ import annotations

import pytest
import torch

from tests.optim.test_stage1 import _check_deferred_is_bit_identical, _nccl_deferred_rank, _nccl_rank

pytestmark = pytest.mark.gpu
WORLD = 4


def _need() -> None:
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")


@pytest.mark.parametrize("fused", [False, True])
def test_nccl_4gpu_match_replicated(tmp_path, fused):
    """Overlapped reduce-scatter hooks, 300-element buckets, GA 2, clipping, against replicated data parallel on the
    same 4 GPUs (all-reduced grads, torch AdamW), fp32: within 1e-5 after 4 steps."""
    _need()
    torch.multiprocessing.spawn(_nccl_rank, args=(WORLD, str(tmp_path / "rv"), str(tmp_path / "diff"), fused),
                                nprocs=WORLD)
    for rank in range(WORLD):
        assert torch.load(tmp_path / f"diff.{rank}") <= 1e-5


def test_nccl_4gpu_allgather_finished_by_next_forward_is_bit_identical(tmp_path):
    """The all-gather left in flight for the next forward, on 4 GPUs: bit-identical to finishing it in step()."""
    _need()
    torch.multiprocessing.spawn(_nccl_deferred_rank, args=(WORLD, str(tmp_path / "rv"), str(tmp_path / "out")),
                                nprocs=WORLD)
    _check_deferred_is_bit_identical([torch.load(tmp_path / f"out.{rank}") for rank in range(WORLD)])
