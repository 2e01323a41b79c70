"""A client LR scheduler built on the client optimizer drives the learning rate that steps, whatever object the
engine steps (issue 32's "silently wrong" class).

With `offload_optimizer: cpu` the engine steps a CPU Adam over fp32 masters, not the client torch AdamW; it used to
copy the client's learning rate once, so `LambdaLR(client)` moved the client's lr to 0.5 while the updates went on at
1.0. DeepSpeed's ZeRO optimizer steps the client's own param groups, so the scheduler drives it. Reference: plain
torch AdamW + the same LambdaLR, one process, the same batches (fp32, no clipping): weights within 1e-6 after 4
steps (the schedule's effect is ~1e-2), and the engine's lr equals the client's after every step.
"""
import pytest
import torch

import fsdpzero
from tests.multirank import run_distributed

LR, STEPS = 1e-2, 4


def _lambda(step):
    return 1.0 if step == 0 else 0.5 ** step


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, 4, 8, generator=g)


def _reference():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    for x in _data():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine_rank(rank, world, stage, offload, door):
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(client, _lambda)
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": zero,
           "zero_allow_untested_optimizer": True}
    if door == "initialize":
        engine, engine_opt, _, engine_sched = fsdpzero.initialize(model=model, optimizer=client, lr_scheduler=sched,
                                                                  config=cfg)
    else:
        engine = fsdpzero.wrap(model, cfg, optimizer=client, lr_scheduler=sched)
        engine_opt, engine_sched = engine.optimizer, engine.lr_scheduler
    assert engine_sched is sched
    lrs = []
    for x in _data():
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        lrs.append(([g["lr"] for g in engine_opt.param_groups], [g["lr"] for g in client.param_groups]))
    engine.grad_path.wait()
    from tests.engine_cases import full_params
    return {"params": full_params(engine.module), "lrs": lrs, "optimizer": type(engine_opt).__name__}


@pytest.mark.parametrize("stage,offload,door", [(2, True, "initialize"), (3, True, "wrap"), (1, True, "wrap"),
                                                (2, False, "initialize")])
def test_client_scheduler_drives_the_stepped_lr(stage, offload, door):
    got = run_distributed(_engine_rank, 1, stage, offload, door, timeout=300)[0]
    for step, (engine_lr, client_lr) in enumerate(got["lrs"]):
        assert engine_lr == client_lr == [LR * _lambda(step + 1)], (step, engine_lr, client_lr, got["optimizer"])
    ref = _reference()
    worst = max((got["params"][k] - ref[k]).abs().max().item() for k in ref)
    moved = max((ref[k] - v).abs().max().item() for k, v in _model().state_dict().items())
    assert moved > 1e-2
    assert worst <= 1e-6, f"{got['optimizer']}: weights differ from torch AdamW + LambdaLR by {worst:.3g}"
