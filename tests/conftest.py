import os

# One compute thread per process unless told otherwise: the CI machine has two cores and the multi-rank tests fork
# two ranks (oversubscription was measured 37x slower). Set before torch starts its thread pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# The recipes are scripts run from their own folder (their modules import each other by bare name, as under
# torchrun); tests import them the same way.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
# One build cache for the run: our ops and DeepSpeed's (the oracle's CPU Adam builds once, ~135 s on 2 cores).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped (and so not counted) where there is none."""
    try:
        import torch
        have_cuda = torch.cuda.is_available()
    except ImportError:
        have_cuda = False
    if have_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_process_group_leaks():
    """A process group left in the pytest process is inherited by every rank forked later (they then fail to
    initialise their own, or hang tearing the inherited one down): destroy it, and fail the test that leaked it."""
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a torch.distributed process group initialised in the test process")


@pytest.fixture
def one_rank_nccl(tmp_path):
    """A 1-rank cuda:nccl,cpu:gloo process group for the in-process GPU tests, destroyed after the test."""
    import torch.distributed as dist
    dist.init_process_group("cuda:nccl,cpu:gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
