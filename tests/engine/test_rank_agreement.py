"""Errors agreed across ranks: ranks started with different configs or models get one message naming the
difference at `wrap`/`initialize` (before any collective that could mismatch), and a failure on one rank becomes the
same error on every rank (fsdpzero.dist.agree_on_error / agreed_errors), leaving the collectives in step. All
scenarios run one after another in the same two ranks: each later one also proves the earlier left the process
group usable."""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import transformers  # noqa: F401  imported before forking the ranks

import fsdpzero
from fsdpzero.dist import RanksError, agree_on_error, agreed_errors, check_same_on_all_ranks
from tests.engine_cases import build_model, make_plan
from tests.multirank import run_distributed


def _outcome(fn):
    try:
        fn()
        return None
    except RanksError as e:
        return str(e)


def _scenarios(rank, world, tmp):
    out = {}
    # the same config and model everywhere: no error, and it trains
    engine = fsdpzero.wrap(build_model("llama"), make_plan(stage=2, world=world))
    x = torch.randint(3, 100, (2, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    engine.destroy()
    out["same"] = "ok"
    # a different ZeRO stage on rank 1
    out["stage"] = _outcome(lambda: fsdpzero.wrap(build_model("llama"), make_plan(stage=2 + rank, world=world)))
    # different precisions
    out["dtype"] = _outcome(lambda: fsdpzero.wrap(
        build_model("llama"), make_plan(stage=3, world=world, dtype=("float32", "bfloat16")[rank])))
    # different models (GPT-2 on rank 1)
    out["model"] = _outcome(lambda: fsdpzero.wrap(build_model(("llama", "gpt2")[rank]), make_plan(world=world)))
    # NVMe swap paths may differ per rank (a node-local disk each)
    plan = make_plan(stage=2, world=world)
    os.makedirs(f"{tmp}/nvme{rank}")
    plan = dataclasses.replace(plan, offload=dataclasses.replace(plan.offload, optimizer_device="nvme",
                                                                 optimizer_nvme_path=f"{tmp}/nvme{rank}",
                                                                 pin_memory=False))
    engine = fsdpzero.wrap(build_model("llama"), plan)
    engine.destroy()
    out["nvme_paths"] = "ok"
    # a monitor on rank 0 only: a monitored step averages the loss over the ranks, so this would hang at step 1
    from fsdpzero.plan.types import MonitorPlan
    csv = {"enabled": True, "output_path": f"{tmp}/csv", "job_name": "j"}
    out["monitor"] = _outcome(lambda: fsdpzero.wrap(build_model("llama"), dataclasses.replace(
        make_plan(stage=2, world=world), monitor=MonitorPlan(csv_monitor=csv if rank == 0 else None))))
    # one rank fails, both raise the same error; then the collectives are still in step
    out["one_fails"] = _outcome(lambda: agree_on_error(ValueError("bad value on this rank") if rank == 1 else None))
    out["both_fail"] = _outcome(lambda: agree_on_error(f"disk full on rank {rank}"))
    out["none_fails"] = _outcome(lambda: agree_on_error(None))
    blocked = os.path.join(tmp, "a_file")
    if rank == 0:
        open(blocked, "w").close()
    dist.barrier()

    def mkdir_under_a_file():
        with agreed_errors():
            if rank == 0:
                os.makedirs(os.path.join(blocked, "ckpt"))   # NotADirectoryError on rank 0 only

    out["agreed_block"] = _outcome(mkdir_under_a_file)
    out["facts"] = _outcome(lambda: check_same_on_all_ranks({"a": "1", "b": str(rank), "c": "x"}, "settings"))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["still_in_step"] = t.item()
    return out


@pytest.mark.slow
def test_ranks_agree_on_errors_and_on_what_they_run(tmp_path):
    r0, r1 = run_distributed(_scenarios, 2, str(tmp_path), timeout=300)
    for key in r0:
        assert r0[key] == r1[key], (key, r0[key], r1[key])     # the same outcome, the same words, on every rank
    assert r0["same"] == r0["nvme_paths"] == "ok"
    assert "different configs or models" in r0["stage"]
    assert "plan shard.stage: rank 0 has 2; rank 1 has 3" in r0["stage"], r0["stage"]
    assert "plan precision.param_dtype: rank 0 has \"float32\"; rank 1 has \"bfloat16\"" in r0["dtype"], r0["dtype"]
    assert "model parameters: rank 0 has 21 tensors" in r0["model"], r0["model"]
    assert "plan monitor" in r0["monitor"], r0["monitor"]
    assert "rank 1 has 28 tensors" in r0["model"], r0["model"]
    assert r0["one_fails"] == "ValueError: bad value on this rank (on rank 1)"
    assert r0["both_fail"] == "2 ranks failed:\n  rank 0: disk full on rank 0\n  rank 1: disk full on rank 1"
    assert r0["none_fails"] is None
    assert r0["agreed_block"].startswith("NotADirectoryError") and r0["agreed_block"].endswith("(on rank 0)")
    assert r0["facts"] == ("the ranks were started with different settings; every rank must run the same:\n"
                           "  b: rank 0 has 0; rank 1 has 1")
    assert r0["still_in_step"] == 3.0


def test_agree_on_error_without_a_process_group():
    assert not dist.is_initialized()
    agree_on_error(None)
    check_same_on_all_ranks({"a": "1"}, "settings")
    with pytest.raises(RanksError, match=r"^OSError: nope \(on rank 0\)$") as info:
        with agreed_errors():
            raise OSError("nope")
    assert isinstance(info.value.__cause__, OSError)
