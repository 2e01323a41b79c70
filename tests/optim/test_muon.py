"""`optimizer.type: "Muon"` against DeepSpeed 0.19.8's MuonWithAuxAdam: the same ds_config, Llama model, data and
seed through `deepspeed.initialize` and `fsdpzero.initialize` on 2 forked gloo ranks (fp32, CPU): per-step losses and
final weights within 1e-5 at ZeRO 0 to 3, 2 micro-batches per step (Muon runs once per optimizer step). In the same
fsdpzero ranks: Newton-Schulz runs once per matrix and step, on one rank; and a run saved after 2 steps and resumed
equals the uninterrupted one (the sharded momentum is in the checkpoint). DeepSpeed's `muon_update` is
torch.compile'd; its ranks run it eagerly (TORCH_COMPILE_DISABLE), which saves an inductor build and computes the same
fp32 math.
"""
import copy
import os

import pytest
import torch

from tests.engine.test_oracle_deepspeed import _deepspeed, _full, oracle_engine
from tests.multirank import run_distributed

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

STEPS, GA, MICRO, SEQ, VOCAB, WORLD, TOL = 4, 2, 2, 16, 128, 2, 1e-5


def _config(stage):
    # lr / weight_decay shared, muon_lr and adam_lr per half; betas/eps for AdamW, momentum for Muon. DeepSpeed
    # clips the orthogonalized update (fsdpzero refuses a clip with Muon), so gradient_clipping is 0.
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
           "train_batch_size": MICRO * GA * WORLD, "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
           "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 5e-3, "adam_lr": 2e-3, "momentum": 0.9,
                                                    "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if stage == 3:
        # DeepSpeed: "Muon and reduce scatter cannot be used together"
        cfg["zero_optimization"]["reduce_scatter"] = False
    return cfg


def _data(rank):
    """This rank's micro-batches, GA per step; the same global batch every step: the loss falls, so the comparison
    is between moving models."""
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(WORLD * GA)]
    return [data[micro * WORLD + rank] for micro in range(GA)] * STEPS


def _steps(engine, batches):
    """Per optimizer step, the loss averaged over its micro-batches and the ranks."""
    losses = []
    for i in range(0, len(batches), GA):
        total = torch.zeros(())
        for x in batches[i:i + GA]:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / (WORLD * GA))
    return losses


def _params(engine, library, stage):
    if library == "deepspeed" and stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {n: _full(p) for n, p in engine.module.named_parameters()}
    return {n: _full(p) for n, p in engine.module.named_parameters()}


def _train(rank, world, library, config, ckpt):
    stage = config["zero_optimization"]["stage"]
    if library == "deepspeed":
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
        engine = oracle_engine("deepspeed", config)
        return dict(losses=_steps(engine, _data(rank)), params=_params(engine, library, stage))
    from fsdpzero.optim import muon
    engine = oracle_engine("fsdpzero", config)
    # the parameters the optimizer gave Muon (stage 1: the matrices inside its flat shards)
    muon_names = sorted(n for n, p in engine.module.named_parameters() if getattr(p, "use_muon", False))
    before = muon.ns_calls
    losses = _steps(engine, _data(rank))
    out = dict(losses=losses, params=_params(engine, library, stage), muon_names=muon_names,
               ns_calls=muon.ns_calls - before)
    # resume: 2 steps, save, a fresh engine loads and takes the last 2 == the uninterrupted 4
    first = oracle_engine("fsdpzero", config)
    _steps(first, _data(rank)[:2 * GA])
    first.save_checkpoint(ckpt, tag="half")
    resumed = oracle_engine("fsdpzero", config)
    resumed.load_checkpoint(ckpt, tag="half")
    out["resumed_losses"] = _steps(resumed, _data(rank)[2 * GA:])
    out["resumed_params"] = _params(resumed, library, stage)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_matches_deepspeed(stage, tmp_path):
    _deepspeed()
    config = _config(stage)
    ds = run_distributed(_train, WORLD, "deepspeed", copy.deepcopy(config), None, timeout=400)
    ours = run_distributed(_train, WORLD, "fsdpzero", copy.deepcopy(config), str(tmp_path / "ckpt"), timeout=400)
    o, d = ours[0], ds[0]
    # DeepSpeed's split: every 2-D weight of the decoder layers, not the embeddings or the head (or 1-D norms)
    assert o["muon_names"] == sorted(n for n in d["params"] if d["params"][n].ndim == 2
                                     and "embed" not in n and "lm_head" not in n)
    assert len(o["muon_names"]) == 14
    for step, (a, b) in enumerate(zip(d["losses"], o["losses"])):
        assert abs(a - b) <= TOL, f"step {step} loss: deepspeed {a} vs fsdpzero {b}"
    assert d["losses"][-1] < d["losses"][0] - 0.05   # it trains
    for r in range(WORLD):
        worst = max((ds[r]["params"][n] - ours[r]["params"][n]).abs().max().item() for n in d["params"])
        assert worst <= TOL, f"rank {r}: final params differ from DeepSpeed's by {worst} (stage {stage})"
    # Newton-Schulz once per matrix and step, on one rank (round-robin: 7 matrices each)
    assert [r["ns_calls"] for r in ours] == [STEPS * 14 // WORLD] * WORLD
    # resumed == uninterrupted (exactly the same arithmetic)
    assert o["resumed_losses"] == o["losses"][2:]
    for r in range(WORLD):
        worst = max((ours[r]["resumed_params"][n] - ours[r]["params"][n]).abs().max().item() for n in d["params"])
        assert worst == 0.0, f"rank {r}: resumed run differs by {worst}"



@pytest.mark.parametrize("ns_method", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_muon_update_is_deepspeeds(ns_method, shape):
    """One matrix's update (nesterov blend, Newton-Schulz, aspect scale) as DeepSpeed's muon_update computes it, for
    wide, tall and square matrices, both NS methods (gram: fp32 on this CPU; standard: bf16). (DeepSpeed's muon_update
    fails on conv filters; fsdpzero refuses a non-matrix Muon parameter.)"""
    _deepspeed()
    from deepspeed.runtime.zero.muon import original_muon
    from fsdpzero.optim.muon import orthogonalize
    g = torch.Generator().manual_seed(0)
    grad, momentum = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    ref_m = momentum.clone()
    with torch._dynamo.config.patch(disable=True):   # DeepSpeed's kernels eagerly: no inductor build
        ref = original_muon.muon_update(grad.clone(), ref_m, beta=0.9, ns_method=ns_method)
    m = momentum.clone()
    m.lerp_(grad, 0.1)
    ours = orthogonalize(grad.lerp(m, 0.9), ns_method)
    assert torch.equal(m, ref_m)
    assert ours.dtype == ref.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= (1e-6 if ns_method == "gram" else 0.0)


BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "optimizer": {"type": "Muon", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}


@pytest.mark.parametrize("change,key", [
    ({"gradient_clipping": 1.0}, "gradient_clipping"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device"),
    ({"fp16": {"enabled": True}}, "fp16.enabled"),
    ({"optimizer": {"type": "Muon", "params": {"ns_method": "svd"}}}, "optimizer.params.ns_method"),
    ({"optimizer": {"type": "Muon", "params": {"per_head_muon": True}}}, "optimizer.params.per_head_muon"),
])
def test_muon_refusals_name_the_key(change, key):
    """What fsdpzero's Muon does not carry is refused before any process group, naming the key and the fix."""
    from fsdpzero.optim import check_optimizer
    from fsdpzero.plan import Env
    from fsdpzero.plan.translate import build_plan
    config = {**BASE, **change}
    with pytest.raises(ValueError, match=f"config key '{key}'"):
        check_optimizer(build_plan(config, Env(world_size=2)))
    check_optimizer(build_plan(BASE, Env(world_size=2)))   # the base config passes
