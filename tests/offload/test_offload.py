"""Optimizer (and param) offload against the plain FSDP2 path with torch.optim.AdamW, on 2 gloo ranks.

Both runs drive the engine's GradPath contract identically (set_sync/backward, finish_gradients, grad_norm, clip,
step, zero_grad). fp32: losses and final full params within 1e-5. bf16 (grads rounded to bf16 before the CPU step,
as on a GPU): losses within 2e-2 relative. The GPU test needs CUDA (run by `pytest -m gpu`).
"""
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fsdpzero.offload import build as offload
from fsdpzero.optim import FSDPGradPath, clip_factor
from fsdpzero.plan import OffloadPlan, Plan, PrecisionPlan
from tests.multirank import run_distributed

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, d=24, n=3):
        super().__init__()
        self.inp = nn.Linear(7, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 5)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _model(param_dtype=None, cpu_offload=False):
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy()
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=True, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    return model


def _train(model, path, steps=8, micro=1, clip=0.0):
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)   # each rank its own half of the global batch
    losses = []
    for _ in range(steps):
        total = 0.0
        for mi in range(micro):
            x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
            path.set_sync(mi == micro - 1)
            loss = nn.functional.mse_loss(model(x).float(), y) / micro
            loss.backward()
            total += loss.detach()
        path.finish_gradients()
        path.scale_grads_(clip_factor(path.grad_norm(), clip))
        path.step()
        path.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    if hasattr(path, "wait"):
        path.wait()
    full = {n: p.full_tensor().float() for n, p in model.named_parameters()}
    return losses, full


def _scenario(rank, world, kind, micro, clip, overlap=False):
    torch.set_num_threads(1)
    base_model = _model()
    base = FSDPGradPath(base_model, torch.optim.AdamW(base_model.parameters(), **HYPER, foreach=False))
    ref = _train(base_model, base, micro=micro, clip=clip)

    plan = Plan(offload=OffloadPlan(optimizer_device="cpu", param_device="cpu" if kind == "param" else "none",
                                    sub_group_size=700))   # several pipeline chunks per rank
    model = _model(cpu_offload=kind == "param")
    from fsdpzero.ops import cpu_adam
    built, available = [], cpu_adam.available_impls
    cpu_adam.available_impls = lambda: built.append(1) or available()
    path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER),
                                   stage=(kind == "staged"), overlap=overlap)
    cpu_adam.available_impls = available
    assert built, "the CPU Adam op is JIT-built while the path is set up, not inside the first step"
    assert path.overlap == overlap
    if overlap:   # a slow CPU step: the next forward must wait for each unit's update, not read stale shards
        step_param = path.optimizer.step_param
        path.optimizer.step_param = lambda *a, **k: (time.sleep(0.01), step_param(*a, **k))
    got = _train(model, path, micro=micro, clip=clip)
    return ref, got, len(path.chunks)


@pytest.mark.parametrize("kind,micro,clip,overlap", [
    ("staged", 1, 0.0, False), ("staged", 2, 0.05, False), ("inplace", 1, 0.05, False), ("param", 2, 0.0, False),
    ("staged", 2, 0.05, True), ("param", 1, 0.05, True)])
def test_offload_matches_fsdp_fp32(kind, micro, clip, overlap):
    """overlap=True: the CPU step runs in a worker thread while the next forward waits per FSDP unit."""
    results = run_distributed(_scenario, 2, kind, micro, clip, overlap, timeout=120)
    for (ref_losses, ref_params), (losses, params), chunks in results:
        assert chunks > 1
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name in ref_params:
            torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-5, msg=name)
    assert results[0][1][0] == results[1][1][0]   # every rank reports the same global loss


def _bf16_scenario(rank, world):
    torch.set_num_threads(1)
    base_model = _model(param_dtype=torch.bfloat16)
    base = FSDPGradPath(base_model, torch.optim.AdamW(base_model.parameters(), **HYPER, foreach=False))
    ref = _train(base_model, base, steps=5, clip=1.0)
    plan = Plan(offload=OffloadPlan(optimizer_device="cpu", param_device="cpu"),
                precision=PrecisionPlan(param_dtype="bfloat16"))
    model = _model(param_dtype=torch.bfloat16, cpu_offload=True)
    path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER))
    dtypes = {p.dtype for p in model.parameters()}
    masters_fp32 = all(e.master.dtype == torch.float32 for e in path.entries)
    return ref, _train(model, path, steps=5, clip=1.0), dtypes, masters_fp32


def test_offload_bf16_shards_fp32_masters():
    for (ref_losses, _), (losses, _), dtypes, masters_fp32 in run_distributed(_bf16_scenario, 2, timeout=120):
        assert dtypes == {torch.bfloat16} and masters_fp32
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=1e-3)


def _state_roundtrip(rank, world, ckpt_dir):
    """DCP save of the path's state dict, load into a fresh model + path, continue: identical trajectories."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    torch.set_num_threads(1)
    plan = Plan(offload=OffloadPlan(optimizer_device="cpu"))
    make = lambda ps: torch.optim.AdamW(ps, **HYPER)  # noqa: E731
    model = _model()
    path = offload.build_offload_path(model, plan, make, stage=True)
    _train(model, path, steps=3)
    dcp.save({"model": get_model_state_dict(model), "optim": path.state_dict()}, checkpoint_id=ckpt_dir)
    torch.manual_seed(123)
    fresh = Net()   # different weights until loaded
    for b in fresh.blocks:
        fully_shard(b, mesh=init_device_mesh("cpu", (world,)))
    fully_shard(fresh, mesh=init_device_mesh("cpu", (world,)))
    path2 = offload.build_offload_path(fresh, plan, make, stage=True)
    state = {"model": get_model_state_dict(fresh), "optim": path2.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_model_state_dict(fresh, state["model"])   # the post-load hook refreshes the masters
    masters_follow_model = all(torch.equal(e.master, e.param.to_local()) for e in path2.entries)
    path2.load_state_dict(state["optim"])
    a, b = _train(model, path, steps=2), _train(fresh, path2, steps=2)
    return a[0], b[0], masters_follow_model


def test_dcp_state_dict_roundtrip_continues_identically(tmp_path):
    for a, b, masters_follow_model in run_distributed(_state_roundtrip, 2, str(tmp_path / "ckpt"), timeout=120):
        assert masters_follow_model
        assert a == b


def test_threads_default_and_override(monkeypatch):
    from fsdpzero.tuning import current
    monkeypatch.setenv("FSDPZERO_OFFLOAD_THREADS", "3")   # the offload_threads knob, typed by fsdpzero.tuning
    assert offload.cpu_threads(8, current().offload_threads) == 3
    monkeypatch.delenv("FSDPZERO_OFFLOAD_THREADS")
    assert current().offload_threads is None and offload.cpu_threads(1) >= 1


def test_non_adam_optimizer_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="Adam"):
        offload._hyper_groups(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1))


def gpu_path_losses(model, path, steps: int = 6, after_step=None) -> list[float]:
    """The GPU tests' loop: `steps` fixed random MSE batches through a gradient path with clip 1.0, as the engine
    drives it; the per-step losses. after_step(): a check to run after each step."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 7, device="cuda", generator=gen)
        y = torch.randn(32, 5, device="cuda", generator=gen)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        path.finish_gradients()
        path.scale_grads_(clip_factor(path.grad_norm(), 1.0))
        path.step()
        path.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step()
    return losses


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_offload_on_gpu_matches_fsdp(overlap, one_rank_nccl):
    """1 GPU, bf16 shards on the device, staged D2H / CPU step / H2D on side streams (and the overlapped worker),
    vs plain FSDP2 + fused AdamW on the GPU."""

    def build(offloaded):
        torch.manual_seed(0)
        model = Net(d=256, n=4).cuda()
        mesh = init_device_mesh("cuda", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if not offloaded:
            return model, FSDPGradPath(model, torch.optim.AdamW(model.parameters(), **HYPER, fused=True))
        plan = dataclasses.replace(Plan(), offload=OffloadPlan(optimizer_device="cpu", sub_group_size=100_000),
                                   precision=PrecisionPlan(param_dtype="bfloat16"))
        return model, offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER),
                                              overlap=overlap)

    runs = []
    for offloaded in (False, True):
        model, path = build(offloaded)
        losses = gpu_path_losses(model, path)
        runs.append(losses)
        if offloaded:
            path.wait()
            assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
            assert all(e.grad_buf.is_pinned() and e.out_buf.is_pinned() for e in path.entries)
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=2e-2, atol=1e-3)
