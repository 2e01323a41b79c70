"""Engine pieces: refusal before any process group, optimizer semantics, client optimizer/scheduler rebinding,
block detection, meta-device init (rotary inv_freq), activation checkpointing really recomputing, fp32 master
upcast logging, DeepSpeed-style step lines, --local_rank."""
import dataclasses
import logging

import pytest
import torch
import torch.distributed as dist
import transformers  # noqa: F401

from fsdpzero import api
from fsdpzero.dist import local_rank_from_argv
from fsdpzero.optim import AdamNoBiasCorrection, make_optimizer_factory
from fsdpzero.plan import Decision, OptimizerPlan, Plan
from fsdpzero.sharding import find_blocks
from tests.engine_cases import ADAMW, batches, build_model, engine_losses, full_params, make_plan, reference_run
from tests.multirank import run_distributed


# -- refused before any process group ---------------------------------------------------------------------------
def test_unsupported_plan_refused_before_process_group():
    plan = dataclasses.replace(make_plan(), decisions=(
        Decision(key="optimizer.type", value="OneBitAdam", status="unsupported", detail="compressed comm"),
        Decision(key="zero_optimization.stage", value=3, status="mapped", detail="fully_shard")))
    with pytest.raises(ValueError, match=r"optimizer.type = 'OneBitAdam'"):
        api.wrap(build_model("llama"), plan)
    assert not dist.is_initialized()


def test_missing_and_untested_optimizer_refused_before_process_group():
    plan = dataclasses.replace(make_plan(stage=2), optimizer=OptimizerPlan())
    with pytest.raises(ValueError, match="'optimizer' is missing"):
        api.wrap(build_model("llama"), plan)
    plan = dataclasses.replace(make_plan(stage=2), optimizer=OptimizerPlan(type="sgd", params={"lr": 0.1}))
    with pytest.raises(ValueError, match="zero_allow_untested_optimizer"):
        api.wrap(build_model("llama"), plan)
    assert not dist.is_initialized()


# -- optimizer semantics ----------------------------------------------------------------------------------------
def _factory(type_, params, **kw):
    return make_optimizer_factory(Plan(optimizer=OptimizerPlan(type=type_, params=params, **kw)))


def test_adam_flavours_follow_deepspeed():
    p = [torch.nn.Parameter(torch.randn(4))]
    assert type(_factory("adamw", {"lr": 1e-3})(p)) is torch.optim.AdamW
    adam = _factory("adam", {"lr": 1e-3}, adam_w_mode=False)(p)          # "Adam" + adam_w_mode false: L2 Adam
    assert type(adam) is torch.optim.Adam
    # DeepSpeed's FusedAdam defaults to weight_decay 0; torch_adam means torch's own defaults (AdamW: 0.01)
    assert _factory("adamw", {"lr": 1e-3})(p).defaults["weight_decay"] == 0.0
    assert _factory("adamw", {"lr": 1e-3}, torch_adam=True)(p).defaults["weight_decay"] == 0.01
    assert type(_factory("sgd", {"lr": 0.1})(p)) is torch.optim.SGD
    assert type(_factory("RMSprop", {"lr": 0.1})(p)) is torch.optim.RMSprop
    from fsdpzero.optim.lamb import Lamb
    lamb = _factory("lamb", {"lr": 1e-3, "bias_correction": False})(p)
    assert type(lamb) is Lamb and lamb.defaults["bias_correction"] is False


@pytest.mark.parametrize("adamw", [True, False])
def test_adam_without_bias_correction_matches_formula(adamw):
    torch.manual_seed(0)
    w0 = torch.randn(32)
    grads = [torch.randn(32) for _ in range(5)]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-6, 0.1
    p = torch.nn.Parameter(w0.clone())
    opt = _factory("adamw" if adamw else "adam", {"lr": lr, "betas": [b1, b2], "eps": eps, "weight_decay": wd,
                                                  "bias_correction": False}, adam_w_mode=adamw)([p])
    assert isinstance(opt, AdamNoBiasCorrection)
    w, m, v = w0.double().clone(), torch.zeros(32, dtype=torch.double), torch.zeros(32, dtype=torch.double)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        g = g.double() + (0 if adamw else wd * w)       # Adam: L2 into the gradient; AdamW: decoupled decay
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (v.sqrt() + eps) + (wd * w if adamw else 0))
    assert torch.allclose(p.detach().double(), w, atol=1e-6)


# -- client optimizer with param groups + client scheduler, rebound onto the shards ------------------------------
def _client_groups(rank, world, steps):
    plan = make_plan(stage=3, world=world, gas=2)
    plan = dataclasses.replace(plan, optimizer=OptimizerPlan())
    model = build_model("llama")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=ADAMW["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    engine, optimizer, _, scheduler = api.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=plan)
    assert optimizer is opt and scheduler is sched
    data = batches(steps, 2, plan.batch.micro_batch_size * world)
    losses = engine_losses(engine, data, rank, world)
    return {"losses": losses, "params": full_params(engine.module), "lr": engine.get_lr()}


def test_client_optimizer_groups_and_scheduler():
    steps = 4
    results = run_distributed(_client_groups, 2, steps, timeout=180)
    model = build_model("llama")
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=ADAMW["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    for step in batches(steps, 2, 4):
        for micro in step:
            (model(input_ids=micro, labels=micro).loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    assert results[0]["lr"] == [g["lr"] for g in opt.param_groups]
    worst = max((results[0]["params"][k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert worst <= 1e-5, worst


# -- blocks -----------------------------------------------------------------------------------------------------
def test_block_detection():
    llama = build_model("llama")
    assert [type(b).__name__ for b in find_blocks(llama)] == ["LlamaDecoderLayer"] * 2
    assert len(find_blocks(llama, predicate=lambda m: type(m).__name__ == "LlamaMLP")) == 2
    with pytest.raises(ValueError, match="GPT2Block"):
        find_blocks(llama, block_classes=["GPT2Block"])
    assert find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []     # no declaration: root only


# -- meta-device init: weights from rank 0, non-persistent rotary buffers rebuilt -------------------------------
def _meta(rank, world, steps):
    full = build_model("llama").state_dict() if rank == 0 else {}
    model = build_model("llama", device="meta")
    assert model.model.rotary_emb.inv_freq.is_meta
    engine = api.wrap(model, make_plan(stage=3, world=world), full_state_dict=full)
    rotary = engine.module.model.rotary_emb
    data = batches(steps, 1, 2 * world)
    return {"losses": engine_losses(engine, data, rank, world), "inv_freq": rotary.inv_freq.clone()}


def test_meta_init_rebuilds_rotary_buffers_and_matches():
    steps = 4
    results = run_distributed(_meta, 2, steps, timeout=180)
    ref_losses, _ = reference_run("llama", batches(steps, 1, 4), clip=1.0)
    assert torch.equal(results[0]["inv_freq"], build_model("llama").model.rotary_emb.inv_freq)
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], ref_losses)) <= 1e-5


# -- activation checkpointing really recomputes; fp32 upcast is logged; step lines printed -----------------------
def _single(rank, world):
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("fsdpzero").addHandler(handler)
    model = build_model("llama").to(torch.bfloat16)                 # loaded in 16 bits: masters must be fp32
    plan = make_plan(stage=3, world=world, dtype="bfloat16", ac=True, steps_per_print=2,
                     wall_clock_breakdown=True)
    engine = api.wrap(model, plan)
    calls = []
    engine.module.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    engine_losses(engine, batches(2, 1, 2 * world), rank, world)
    return {"records": records, "mlp_calls": len(calls),
            "dtypes": {p.dtype for p in engine.module.parameters()}}


def test_checkpointing_upcast_logging_single_rank():
    r = run_distributed(_single, 1, timeout=120)[0]
    assert r["mlp_calls"] == 4                      # 2 steps x (forward + recompute in backward)
    assert r["dtypes"] == {torch.float32}
    upcast = [m for m in r["records"] if "master weights" in m]
    assert upcast and upcast[0].startswith("cast 21 trainable parameters to float32")
    assert "model.embed_tokens.weight" in upcast[0]
    steps = [m for m in r["records"] if m.startswith("step=")]
    assert steps and steps[0].startswith("step=2, skipped=0, loss=") and "samples/s=" in steps[0]
    # wall_clock_breakdown: the timings every optimizer step (DeepSpeed logs them every step), steps_per_print or not
    assert sum(m.startswith("time (ms) | forward:") for m in r["records"]) == 2, r["records"]


def test_local_rank_from_argv():
    assert local_rank_from_argv(["x.py", "--local_rank=3"]) == 3
    assert local_rank_from_argv(["x.py", "--local-rank", "1", "--foo"]) == 1
    assert local_rank_from_argv(["x.py"]) is None
