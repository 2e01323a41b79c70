"""The offload paths built from a plan and a model that is already fully_shard-ed, as the engine builds them
(fsdpzero.api.grad_path_type(plan).build): for tests, benchmarks and scripts that hold a plan and a model. The build
itself is OffloadGradPath.build (fsdpzero/offload/path.py), its steps fsdpzero/offload/prepare.py.
"""
from __future__ import annotations

from torch import nn

from fsdpzero.offload.nvme_path import NVMeGradPath
from fsdpzero.offload.path import OffloadGradPath
from fsdpzero.offload.prepare import (  # noqa: F401  (what callers of this module use)
    cpu_threads, device_stepped, drop_shards_default, hyper_groups_of,
)
from fsdpzero.optim.factory import OptimizerFactory
from fsdpzero.plan import Plan
from fsdpzero.tuning import Tuning

_hyper_groups = hyper_groups_of   # the name tests/offload call it by


def build_offload_path(model: nn.Module, plan: Plan, make_optimizer: OptimizerFactory, mesh=None,
                       *, stage: bool | None = None, overlap: bool | None = None,
                       tuning: Tuning | None = None) -> OffloadGradPath:
    """OffloadGradPath.build, or NVMeGradPath.build for offload_optimizer nvme (the types fsdpzero.api.grad_path_type
    gives these plans). `stage`, `overlap`, `tuning`: see OffloadGradPath.build."""
    path_type = NVMeGradPath if plan.offload.optimizer_device == "nvme" else OffloadGradPath
    return path_type.build(model, plan, make_optimizer, mesh, tuning=tuning, stage=stage, overlap=overlap)
