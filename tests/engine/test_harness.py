import torch
import torch.distributed as dist

from tests.multirank import run_distributed


def _allreduce_rank(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_two_ranks_allreduce():
    assert run_distributed(_allreduce_rank, 2) == [3.0, 3.0]


def test_failure_surfaces_rank_traceback():
    import pytest
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_distributed(_fail_on_rank1, 2, timeout=60)
