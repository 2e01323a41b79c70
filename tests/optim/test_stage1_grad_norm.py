"""Stage 1's global gradient norm against torch.nn.utils.clip_grad_norm_ over the unsharded gradients (issue 32's
"silently wrong" class: the norm sets the clip factor).

One fp32 vector_norm over a whole flat shard of ~5e5 elements is ~2e-5 relative off on the CPU (its fp32 partial
sums), against ~4e-7 per tensor; on a recipe's model that shifted the clip factor by 1e-5 at step 1. 2 gloo ranks,
a 1M-parameter model of 25k-element tensors (clip_grad_norm_ takes a norm per tensor; flat shards of ~5e5 elements per rank), the same gradients set on every rank (so the reduced
mean is exactly them); bar: 1e-6 relative to clip_grad_norm_, and to the fp64 norm.
"""
import torch
from torch import nn

from fsdpzero.plan import ShardPlan
from fsdpzero_ops.stage1 import Stage1Optimizer
from tests.multirank import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(250, 100) for _ in range(40)])   # 1M elements in tensors of 25k


def _grads(model):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(p.shape, generator=g) * (1 + 50 * torch.rand(p.shape, generator=g)) for p in model.parameters()]


def _rank(rank, world):
    model = _model()
    opt = Stage1Optimizer(list(model.named_parameters()), lambda groups: torch.optim.AdamW(groups, lr=1e-3),
                          reduce_bucket_size=ShardPlan().reduce_bucket_size,
                          allgather_bucket_size=ShardPlan().allgather_bucket_size)
    for p, g in zip(model.parameters(), _grads(model)):
        p.grad = g.clone()
    opt.reduce_gradients()
    shard = max(fg.master.numel() for fg in opt.flat_groups)
    return {"norm": opt.grad_norm(), "shard": shard}


def test_stage1_grad_norm_matches_clip_grad_norm():
    got = run_distributed(_rank, 2, timeout=180)
    model = _model()
    grads = _grads(model)
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    ref = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    exact = torch.stack([g.double().norm() for g in grads]).norm().item()
    assert abs(ref - exact) / exact <= 1e-6   # the reference itself
    for r in got:
        assert r["shard"] >= 400_000 and r["norm"].dtype == torch.float32 and r["norm"].dim() == 0
        rel = abs(r["norm"].item() - ref) / ref
        assert rel <= 1e-6, f"stage 1 grad norm {r['norm'].item()} vs clip_grad_norm_ {ref}: {rel:.3g} relative"
        assert abs(r["norm"].item() - exact) / exact <= 1e-6
