"""`optimizer.type: "OneBitAdam"` runs approximated: 1-bit Adam's uncompressed warm-up update on every step. DeepSpeed
0.19.8 has no 1-bit optimizers, so the reference is that update written out here from DeepSpeed's OnebitAdam (older
releases): m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; p -= lr (m / (sqrt(v) + eps) + wd p), no bias correction
whatever `bias_correction` says. Stage 0, 2 gloo ranks, fp32, against one unsharded process on the global batch.
"""
import copy

import pytest
import torch

from tests.engine.test_oracle_deepspeed import _full, _model, oracle_engine
from tests.multirank import run_distributed

STEPS, MICRO, SEQ, VOCAB, WORLD, TOL = 4, 2, 16, 128, 2, 1e-5
PARAMS = {"lr": 2e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.05, "bias_correction": True,
          "freeze_step": 2, "cuda_aware": False, "comm_backend_name": "nccl"}
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "train_batch_size": MICRO * WORLD,
          "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
          "optimizer": {"type": "OneBitAdam", "params": PARAMS}}


def _batches():
    """One fixed global batch every step (a micro-batch per rank): the loss falls."""
    g = torch.Generator().manual_seed(7)
    return [[torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(WORLD)]] * STEPS


def _train(rank, world, config):
    engine = oracle_engine("fsdpzero", config)
    losses = []
    for step in _batches():
        loss = engine(input_ids=step[rank], labels=step[rank]).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / WORLD)
    return dict(losses=losses, params={n: _full(p) for n, p in engine.module.named_parameters()})


def _reference():
    model = _model("llama")
    (b1, b2), eps, lr, wd = PARAMS["betas"], PARAMS["eps"], PARAMS["lr"], PARAMS["weight_decay"]
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in model.parameters()}
    losses = []
    for step in _batches():
        loss = sum(model(input_ids=x, labels=x).loss for x in step) / WORLD
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                m, v = state[p]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.sub_(lr * (m / (v.sqrt() + eps) + wd * p))
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.mark.timeout(600)
def test_onebit_adam_runs_its_uncompressed_update():
    ours = run_distributed(_train, WORLD, copy.deepcopy(CONFIG), timeout=300)[0]
    ref = _reference()
    for step, (a, b) in enumerate(zip(ref["losses"], ours["losses"])):
        assert abs(a - b) <= TOL, f"step {step} loss: reference {a} vs fsdpzero {b}"
    assert ref["losses"][-1] < ref["losses"][0] - 0.05   # it trains
    worst = max((ref["params"][n] - ours["params"][n]).abs().max().item() for n in ref["params"])
    assert worst <= TOL, f"final params differ by {worst}"


def test_onebit_adam_with_zero_is_refused():
    from fsdpzero.optim import check_optimizer
    from fsdpzero.plan import Env
    from fsdpzero.plan.translate import build_plan
    with pytest.raises(ValueError, match="config key 'optimizer.type' = 'OneBitAdam' with zero_optimization.stage 2"):
        check_optimizer(build_plan({**CONFIG, "zero_optimization": {"stage": 2}}, Env(world_size=2)))
