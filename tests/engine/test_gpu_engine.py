"""GPU: the engine on 2 GPUs with NCCL (stages 0-3; bf16 and fp32) and on 4 GPUs where the rank count matters
(stage 1's bucketed reduce-scatter/all-gather over 4 shards, stage 2, hpZ: zero_hpz_partition_size 2, MiCS: a
(2, 2) replicate x shard mesh) vs an unsharded single-GPU run of the same global batch. Not part of CPU CI; run with

    pytest -m gpu tests/engine/test_gpu_engine.py -v

Ranks are spawned (not forked: CUDA does not survive fork) with torchrun's environment, so `wrap` creates the
`cuda:nccl,cpu:gloo` process group itself."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.multirank import free_port

pytestmark = pytest.mark.gpu
STEPS = 10


def _rank(rank: int, world: int, port: int, workdir: str, kind: str, plan_kwargs: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from fsdpzero.api import wrap
    from tests.engine_cases import batches, build_model, engine_losses, full_params
    plan = _plan(world, plan_kwargs)
    data = batches(STEPS, plan.batch.gradient_accumulation_steps, plan.batch.micro_batch_size * world)
    engine = wrap(build_model(kind), plan)
    if torch.cuda.is_available():
        assert engine.device.type == "cuda" and "nccl" in str(dist.get_backend())
    losses = engine_losses(_OnDevice(engine), data, rank, world)
    params = full_params(engine.module)
    if rank == 0:
        torch.save({"losses": losses, "params": params}, Path(workdir) / "result.pt")
    dist.destroy_process_group()


SHARD_KEYS = ("reduce_bucket_size", "allgather_bucket_size")


def _plan(world: int, plan_kwargs: dict):
    """tests.engine_cases.make_plan, with the stage-1 bucket sizes (ShardPlan fields) set too."""
    import dataclasses

    from tests.engine_cases import make_plan
    shard = {k: v for k, v in plan_kwargs.items() if k in SHARD_KEYS}
    plan = make_plan(world=world, **{k: v for k, v in plan_kwargs.items() if k not in SHARD_KEYS})
    return dataclasses.replace(plan, shard=dataclasses.replace(plan.shard, **shard))


class _OnDevice:
    """engine_losses hands CPU token batches; move them to the rank's GPU."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, input_ids, labels):
        return self.engine(input_ids=input_ids.to(self.engine.device), labels=labels.to(self.engine.device))

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _reference(kind: str, data: torch.Tensor) -> tuple[list[float], dict]:
    from tests.engine_cases import ADAMW, build_model
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(kind).to(dev)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    gas, losses = data.shape[1], []
    for step in data.to(dev):
        total = 0.0
        for micro in step:
            loss = model(input_ids=micro, labels=micro).loss
            (loss / gas).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total / gas)
    return losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


CASES = [   # kind, plan, tolerance, GPUs
    ("llama", dict(stage=0, gas=2, dtype="bfloat16"), 2e-2, 2),
    ("llama", dict(stage=1, gas=2, dtype="bfloat16"), 2e-2, 2),
    ("llama", dict(stage=2, gas=2, dtype="bfloat16"), 2e-2, 2),
    ("llama", dict(stage=3, gas=2, dtype="bfloat16"), 2e-2, 2),
    ("llama", dict(stage=3, gas=1), 1e-4, 2),     # fp32 on GPU: TF32 off by default, cuBLAS order differs
    ("gpt2", dict(stage=3, gas=2, dtype="bfloat16"), 2e-2, 2),
    # 4 ranks, fp32 (a tight tolerance: a wrong shard, bucket or replica group is off by far more)
    ("llama", dict(stage=1, gas=2, reduce_bucket_size=2000, allgather_bucket_size=2000), 1e-4, 4),
    ("llama", dict(stage=2, gas=2), 1e-4, 4),
    ("llama", dict(stage=3, gas=1, hpz=2), 1e-4, 4),
    ("llama", dict(stage=3, gas=2, mesh=(2, 2)), 1e-4, 4),
]


@pytest.mark.parametrize("kind,plan_kwargs,tol,world", CASES,
                         ids=[f"{k}-" + "-".join(f"{a}{b}" for a, b in kw.items()) + ("" if w == 2 else f"-{w}gpu")
                              for k, kw, _, w in CASES])
def test_nccl_matches_unsharded(kind, plan_kwargs, tol, world):
    from tests.engine_cases import batches
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(_rank, args=(world, free_port(), workdir, kind, plan_kwargs), nprocs=world,
                           join=True, start_method="spawn")
        result = torch.load(Path(workdir) / "result.pt", weights_only=True)
    plan = _plan(world, plan_kwargs)
    data = batches(STEPS, plan.batch.gradient_accumulation_steps, plan.batch.micro_batch_size * world)
    ref_losses, ref_params = _reference(kind, data)
    diff = max(abs(a - b) for a, b in zip(result["losses"], ref_losses))
    assert diff <= tol, f"loss trajectory differs by {diff:.3g}: {result['losses']} vs {ref_losses}"
    worst = max((result["params"][k] - ref_params[k]).abs().max().item() for k in ref_params)
    assert worst <= tol, f"final params differ by {worst:.3g}"
