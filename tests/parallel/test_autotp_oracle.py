"""DeepSpeed 0.19.8's AutoTP as the oracle: the same ds_config (tensor_parallel.autotp_size 2), model, data and seed
through `deepspeed.initialize` and `fsdpzero.initialize` on 4 forked gloo ranks (tp 2 x dp 2, DS_ACCELERATOR=cpu),
ZeRO 1/2/3 in fp32: per-step losses and global grad norms must agree (1e-5).

Needs the `oracle` extra (skipped without DeepSpeed). DeepSpeed runs AutoTP training on the CPU; its batch triad
counts the whole world, tp ranks included (test_deepspeed_triad_counts_the_world records its exact error), so the
configs here give train_batch_size = micro x GA x world, and each data replica (two tp ranks) reads the same rows.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from tests.engine.test_oracle_deepspeed import _deepspeed
from tests.engine_cases import batches, build_model
from tests.multirank import run_distributed
from tests.parallel.test_autotp import GAS, MICRO, TP, WORLD, ds_config

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

STEPS = 3
TOL = 1e-5


def _engine(library, config):
    if library == "deepspeed":
        import deepspeed
        initialize = deepspeed.initialize
    else:
        import fsdpzero
        initialize = fsdpzero.initialize
    model = build_model("llama")
    return initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))[0]


def _run(rank, world, stages):
    _deepspeed()
    out = {}
    data = batches(STEPS, GAS, MICRO * (world // TP))
    d = rank // TP   # DeepSpeed's (data_parallel, tensor_parallel) mesh: tp innermost, as fsdpzero's
    for stage in stages:
        config = ds_config(stage)
        # no train_batch_size: DeepSpeed's ZeRO-3 re-checks the triad over dp only (zero.Init's config gets the
        # mpu) after its engine checked it over the whole world, so any explicit value fails one of the two
        # (test_deepspeed_triad_counts_the_world); micro and GA alone pass both
        del config["train_batch_size"]
        config["optimizer"]["params"]["torch_adam"] = True   # DeepSpeed's pure-torch AdamW (no 61 s JIT build)
        for library in ("deepspeed", "fsdpzero"):
            engine = _engine(library, config)
            losses, norms = [], []
            for step in data:
                acc = torch.zeros(())
                for micro in step:
                    x = micro[d * MICRO:(d + 1) * MICRO]
                    loss = engine(input_ids=x, labels=x).loss
                    engine.backward(loss)
                    engine.step()
                    acc += loss.detach().float()
                dist.all_reduce(acc)
                losses.append(acc.item() / (GAS * world))
                norm = engine.get_global_grad_norm()
                norms.append(None if norm is None else float(norm))
            out[(stage, library)] = (losses, norms)
            if library == "deepspeed":
                from deepspeed.utils import groups
                groups._TENSOR_MODEL_PARALLEL_GROUP = None   # let the next DeepSpeed engine build its groups again
    return out


def _triad(rank, world):
    _deepspeed()
    import deepspeed
    from deepspeed.utils import groups
    out = []
    for stage, train in ((2, MICRO * GAS * (world // TP)), (3, MICRO * GAS * world)):   # dp-counted, world-counted
        model = build_model("llama")
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                 config={**ds_config(stage), "train_batch_size": train})
            out.append("accepted")
        except AssertionError as e:
            out.append(str(e))
        groups._TENSOR_MODEL_PARALLEL_GROUP = None
    return out


@pytest.fixture(scope="module")
def oracle_runs():
    """One 4-rank job for both tests (spawned ranks shared): both engines per stage, then DeepSpeed's triad checks."""
    _deepspeed()
    return run_distributed(_job, WORLD, (1, 2, 3), timeout=900)[0]


def _job(rank, world, stages):
    runs = _run(rank, world, stages)   # first: the triad's failed ZeRO-3 init may leave DeepSpeed state behind
    return {"runs": runs, "triad": _triad(rank, world)}


def test_autotp_matches_deepspeed(oracle_runs):
    out = oracle_runs["runs"]
    report = {}
    for stage in (1, 2, 3):
        (dl, dn), (fl, fn) = out[(stage, "deepspeed")], out[(stage, "fsdpzero")]
        report[stage] = {"loss": max(abs(a - b) for a, b in zip(dl, fl)),
                         "norm": max(abs(a - b) for a, b in zip(dn, fn)) if None not in dn else None,
                         "deepspeed_losses": dl, "deepspeed_norms": dn}
    print(report)
    for stage, r in report.items():
        assert r["loss"] <= TOL, (stage, r)
        assert r["norm"] is not None and r["norm"] <= TOL, (stage, r)


def test_deepspeed_triad_counts_the_world(oracle_runs):
    """DeepSpeed 0.19.8 under AutoTP refuses train_batch_size = micro x GA x dp (its config has no mpu and counts
    dist.get_world_size(); fsdpzero refuses it with the same message: tests/parallel/test_autotp.py), and at ZeRO-3
    it also refuses micro x GA x world, in zero.Init, whose config counts dp. fsdpzero accepts the world count at
    every stage (a config DeepSpeed's engine accepts runs here)."""
    dp_counted, world_counted_z3 = oracle_runs["triad"]
    message = ("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
               "gradient_acc_step * world_size {} != {} * {} * {}")
    assert dp_counted == message.format(MICRO * GAS * 2, MICRO, GAS, WORLD), dp_counted
    assert world_counted_z3 == message.format(MICRO * GAS * WORLD, MICRO, GAS, WORLD // TP), world_counted_z3

