"""Each gradient path lays the model out itself (GradPath.lay_out, chosen by fsdpzero.api.grad_path_type): stage 1
leaves the model unwrapped but still checkpoints activations; the FSDP paths fully_shard each block."""
import dataclasses

import torch
from torch.distributed.fsdp import FSDPModule

from fsdpzero.api import grad_path_type, wrap
from fsdpzero.optim import FSDPGradPath
from fsdpzero.plan import OffloadPlan
from tests.engine_cases import batches, build_model, engine_losses, make_plan
from tests.multirank import run_distributed


def test_the_dispatch_names_one_path_per_plan():
    from fsdpzero.offload.path import OffloadGradPath
    from fsdpzero.optim.stage1 import Stage1GradPath
    offload = OffloadPlan(optimizer_device="cpu")
    assert grad_path_type(make_plan(stage=1)) is Stage1GradPath
    assert grad_path_type(make_plan(stage=2)) is FSDPGradPath
    assert grad_path_type(dataclasses.replace(make_plan(stage=3), offload=offload)) is OffloadGradPath
    assert grad_path_type(dataclasses.replace(make_plan(stage=1), offload=offload)) is Stage1GradPath


def _layouts(rank, world):
    out = {}
    data = batches(2, 1, 2 * world)
    for stage, ac in ((1, False), (1, True), (2, True)):
        engine = wrap(build_model("llama"), make_plan(stage=stage, world=world, ac=ac))
        out[(stage, ac)] = dict(checkpointing=bool(engine.module.is_gradient_checkpointing),
                                fsdp_units=sum(isinstance(m, FSDPModule) for m in engine.module.modules()),
                                losses=engine_losses(engine, data, rank, world))
    return out


def test_stage1_lays_out_unwrapped_with_checkpointing_and_fsdp_shards_blocks():
    out = run_distributed(_layouts, 1, timeout=240)[0]
    assert out[(1, True)]["checkpointing"] and not out[(1, False)]["checkpointing"]
    assert out[(1, True)]["fsdp_units"] == out[(1, False)]["fsdp_units"] == 0
    assert out[(2, True)]["checkpointing"] and out[(2, True)]["fsdp_units"] == 3   # 2 blocks and the root
    # recomputing the blocks in backward changes nothing in the update
    assert torch.allclose(torch.tensor(out[(1, True)]["losses"]), torch.tensor(out[(1, False)]["losses"]),
                          rtol=0, atol=1e-6), (out[(1, True)]["losses"], out[(1, False)]["losses"])
