"""fp32: a step whose gradients hold a NaN/inf (on one rank only) is skipped on every rank, as DeepSpeed 0.19.8's
ZeRO 1-3 optimizers do (tests/engine/test_oracle_deepspeed.py runs DeepSpeed itself on the same loop): the weights
keep their values bit for bit, `skipped_steps` reads 1 as soon as the step returns (a deferred verdict is settled
when the counter is read), the scheduler does not advance, and the run goes on as if the bad step had never been
taken. Every gradient path: FSDP2 stages 0/2/3, stage 1, CPU offload (stage 1 and the offload path), NVMe; the
deferred (fused Adam, no host sync) and the synchronous verdict."""
import dataclasses
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers  # noqa: F401  imported before forking the ranks

import fsdpzero
from fsdpzero.plan import OffloadPlan, SchedulerPlan
from tests.engine_cases import batches, build_model, full_params, make_plan
from tests.multirank import run_distributed

SCHED = SchedulerPlan(type="WarmupLR", params={"warmup_min_lr": 0.0, "warmup_max_lr": 5e-4, "warmup_num_steps": 4,
                                               "warmup_type": "linear"})
BAD = 1      # the step whose rank-0 loss is multiplied by NaN
CASES = {    # name: (stage, offload device, FSDPZERO_SYNC_OVERFLOW_CHECK)
    "z0": (0, "none", False), "z1": (1, "none", False), "z2": (2, "none", False), "z3": (3, "none", False),
    "z2_sync": (2, "none", True), "z1_cpu": (1, "cpu", False), "z2_cpu": (2, "cpu", False),
    "z3_nvme": (3, "nvme", False),
}


def _engine(world, stage, offload, sync, tmp):
    if sync:
        os.environ["FSDPZERO_SYNC_OVERFLOW_CHECK"] = "1"
    else:
        os.environ.pop("FSDPZERO_SYNC_OVERFLOW_CHECK", None)
    plan = dataclasses.replace(make_plan(stage=stage, world=world), scheduler=SCHED)
    if offload != "none":
        plan = dataclasses.replace(plan, offload=OffloadPlan(optimizer_device=offload, optimizer_nvme_path=tmp,
                                                             pin_memory=False))
    return fsdpzero.wrap(build_model("llama"), plan)


def _run(engine, rank, world, steps, poison):
    """Train on `steps` (indices into the data); returns per step: skipped_steps read right after step(), lr."""
    data = batches(4, 1, 4)
    m = data.shape[2] // world
    seen = []
    for i in steps:
        x = data[i][0][rank * m:(rank + 1) * m]
        loss = engine(input_ids=x, labels=x).loss
        if i == poison and rank == 0:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        seen.append((engine.skipped_steps, engine.get_lr()[0]))
        if i == poison:
            seen.append(full_params(engine.module))
    return seen


def _cases(rank, world, names):
    out = {}
    for name in names:
        stage, offload, sync = CASES[name]
        with tempfile.TemporaryDirectory() as tmp:
            engine = _engine(world, stage, offload, sync, tmp)
            deferred = engine._defer_verdict
            ref = _run(engine, rank, world, [0], None)            # the weights before the bad step
            before = full_params(engine.module)
            seen = ref + _run(engine, rank, world, [BAD, 2, 3], BAD)
            after_bad = seen.pop(2)
            final = full_params(engine.module)
            engine.destroy()
            clean_engine = _engine(world, stage, offload, sync, tmp)   # the same run without the bad step
            clean = _run(clean_engine, rank, world, [0, 2, 3], None)
            clean_final = full_params(clean_engine.module)
            clean_engine.destroy()
        finite = all(bool(torch.isfinite(v).all()) for v in final.values())
        out[name] = dict(deferred=deferred, seen=seen, clean=clean, finite=finite,
                         kept=all(torch.equal(before[k], after_bad[k]) for k in before),
                         same_as_clean=max((final[k] - clean_final[k]).abs().max().item() for k in final))
        dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("names", [["z0", "z1", "z2", "z3"], ["z2_sync", "z1_cpu", "z2_cpu", "z3_nvme"]],
                         ids=["fsdp_stage1", "sync_offload_nvme"])
def test_fp32_nonfinite_step_is_skipped_on_every_rank(names):
    results = run_distributed(_cases, 2, names, timeout=400)
    for name in names:
        per_rank = [r[name] for r in results]
        r = per_rank[0]
        stage, offload, sync = CASES[name]
        # both verdict paths are exercised: the stage-1 CPU masters use fused torch AdamW too (skips on the device)
        assert r["deferred"] is (offload in ("none", "cpu" if stage == 1 else "none") and not sync), name
        for got in per_rank:
            skipped = [s for s, _ in got["seen"]]
            assert skipped == [0, 1, 1, 1], (name, skipped)                  # current right after the bad step
            assert got["kept"], f"{name}: the NaN step changed the weights"
            assert got["finite"], f"{name}: NaN reached the weights"
        lrs = [lr for _, lr in r["seen"]]
        assert lrs[1] == lrs[0], (name, lrs)                                   # no scheduler step on a skip
        assert [lrs[0], *lrs[2:]] == [lr for _, lr in r["clean"]], name
        # the skipped step left nothing behind: not the Adam step count, moments, nor the scheduler
        assert r["same_as_clean"] == 0.0, (name, r["same_as_clean"])
