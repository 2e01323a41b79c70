"""GPU: fp16 with the loss scaler on the device (deferred overflow verdict: no host sync per step) gives bit for
bit what FSDPZERO_SYNC_OVERFLOW_CHECK=1 gives, on 2 GPUs with NCCL, real fp16 compute that overflows by itself
(2**24 start, window 2) plus an inf injected on one rank (stages 1 and 2 also on 4 GPUs): the CUDA half of
tests/engine/test_engine_overflow.py (fused CUDA Adam's found_inf skip, the pinned verdict copy). Not part of CPU CI;
run with

    pytest -m gpu tests/engine/test_gpu_fp16.py -v
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.multirank import free_port

pytestmark = pytest.mark.gpu
STEPS, BAD_STEP, GLOBAL_MICRO = 12, 5, 4


def _rank(rank: int, world: int, port: int, workdir: str, stage: int, sync: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUBLAS_WORKSPACE_CONFIG=":4096:8")
    if sync:
        os.environ["FSDPZERO_SYNC_OVERFLOW_CHECK"] = "1"
    torch.use_deterministic_algorithms(True, warn_only=True)   # two runs of one program must match exactly
    import dataclasses

    import torch.distributed as dist

    from fsdpzero.api import wrap
    from fsdpzero.plan import LossScalePlan, SchedulerPlan
    from tests.engine_cases import batches, build_model, full_params, make_plan
    m = GLOBAL_MICRO // world
    plan = make_plan(stage=stage, world=world, gas=2, micro=m, dtype="float16",
                     fp16=LossScalePlan(initial_scale_power=24, loss_scale_window=2, hysteresis=2))
    plan = dataclasses.replace(plan, scheduler=SchedulerPlan(type="WarmupDecayLR", params={
        "warmup_min_lr": 0.0, "warmup_max_lr": 5e-4, "warmup_num_steps": 3, "total_num_steps": 20}))
    engine = wrap(build_model("llama"), plan)
    assert engine.device.type == "cuda" and engine._defer_verdict is (not sync)
    data = batches(STEPS, 2, GLOBAL_MICRO)
    losses, scales = [], []
    for i, step in enumerate(data):
        for j, micro in enumerate(step):
            x = micro[rank * m:(rank + 1) * m].to(engine.device)
            loss = engine(input_ids=x, labels=x).loss
            if i == BAD_STEP and j == 0 and rank == 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())       # no host sync in the loop: read at the end
        if sync or i % 4 == 3:
            scales.append(engine.get_loss_scale())     # the deferred run settles only now and then
    state = engine.client_state()
    params = full_params(engine.module)
    if rank == 0:
        torch.save({"losses": torch.stack(losses).cpu(), "params": params, "scales": scales,
                    "skipped": state["skipped_steps"], "lr": engine.get_lr(), "sched": state["lr_scheduler"],
                    "scaler": state["loss_scaler"]}, Path(workdir) / "result.pt")
    dist.destroy_process_group()


def _result(stage: int, sync: bool, world: int) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(_rank, args=(world, free_port(), workdir, stage, sync), nprocs=world, join=True,
                           start_method="spawn")
        return torch.load(Path(workdir) / "result.pt", weights_only=True)


@pytest.mark.parametrize("stage,world", [(2, 2), (1, 2), (3, 2), (1, 4), (2, 4)],
                         ids=["2", "1", "3", "1-4gpu", "2-4gpu"])
def test_fp16_device_scaler_equals_synchronous_on_gpu(stage, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    synced, deferred = _result(stage, True, world), _result(stage, False, world)
    assert synced["skipped"] >= 3, synced["skipped"]                        # it overflows several times
    assert deferred["scales"] == synced["scales"][3::4]
    for key in ("skipped", "lr", "sched", "scaler"):
        assert deferred[key] == synced[key], key
    assert torch.equal(deferred["losses"].nan_to_num(), synced["losses"].nan_to_num())   # inf on the bad step
    for k in synced["params"]:
        assert torch.equal(deferred["params"][k], synced["params"][k]), k
