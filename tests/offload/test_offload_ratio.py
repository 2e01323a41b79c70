"""offload_optimizer.ratio < 1 (stage 3): the CPU steps about `ratio` of the elements (the last chunks in forward
order), torch's Adam steps the rest next to the params. 2 gloo ranks with CPU "devices" exercise the split.

Exactness: after one step, every device-stepped param equals the all-device run (FSDPGradPath + torch AdamW) bit
for bit and every CPU-stepped param equals the all-CPU run (ratio 1.0) bit for bit; over 8 steps (clip on, several
chunks, overlapped or not) the losses and params stay within 1e-5 of the all-device run.
"""
import pytest
import torch

from fsdpzero.offload import build as offload
from fsdpzero.optim import FSDPGradPath
from fsdpzero.plan import OffloadPlan, Plan
from tests.multirank import run_distributed
from tests.offload.test_offload import HYPER, _model, _train


def _offload_run(ratio, steps, clip, overlap, stage):
    plan = Plan(offload=OffloadPlan(optimizer_device="cpu", ratio=ratio, sub_group_size=700))
    model = _model()
    path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER), stage=stage,
                                   overlap=overlap)
    device_names = {e.name for c in path.device_chunks for e in c.entries}
    losses, params, _ = _train(model, path, steps=steps, clip=clip)
    state = path.state_dict()["state"]   # the device-stepped states are in the checkpoint too
    steps_seen = {float(s["step"]) for s in state.values()}
    return losses, params, device_names, len(path.cpu_chunks), steps_seen


def _scenario(rank, world, steps, clip, overlap, stage, step_group=None):
    torch.set_num_threads(1)
    if step_group is not None:   # the device step in many small Adam calls (device_step._groups)
        from fsdpzero.offload import device_step
        device_step.STEP_GROUP = step_group
    base_model = _model()
    base = FSDPGradPath(base_model, torch.optim.AdamW(base_model.parameters(), **HYPER, foreach=False))
    device_ref = _train(base_model, base, steps=steps, clip=clip)[:2]
    cpu_ref = _offload_run(1.0, steps, clip, False, stage)
    split = _offload_run(0.5, steps, clip, overlap, stage)
    return device_ref, cpu_ref, split


@pytest.mark.parametrize("stage,overlap,step_group", [(True, False, None), (False, True, None), (True, False, 64)])
def test_ratio_one_step_is_exact_on_both_sides(stage, overlap, step_group):
    """step_group 64: the device-stepped params in many Adam calls of a few tensors each, same bits."""
    for (ref_losses, ref), (_, cpu, none_on_device, _, _), (losses, got, on_device, cpu_chunks, seen) in \
            run_distributed(_scenario, 2, 1, 0.05, overlap, stage, step_group, timeout=120):
        assert not none_on_device and on_device and cpu_chunks > 0   # both sides take part
        assert seen == {1.0}
        for name in ref:
            want = ref[name] if name in on_device else cpu[name]
            assert torch.equal(got[name], want), name


def test_ratio_training_matches_all_device_run():
    for (ref_losses, ref), _, (losses, got, on_device, cpu_chunks, _) in \
            run_distributed(_scenario, 2, 8, 0.05, True, True, timeout=120):
        assert on_device and cpu_chunks > 0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-5, msg=name)


def test_ratio_splits_by_elements_last_chunks_to_cpu():
    units = [[("emb", 1000)], [("a", 300), ("b", 300)], [("c", 300), ("d", 300)]]
    assert offload.device_stepped(units, 10_000, 1.0) == set()
    assert offload.device_stepped(units, 10_000, 0.0) == {"emb", "a", "b", "c", "d"}
    # chunks: [emb] [a, b] [c, d]; half of 2200 elements: the last two chunks (their middles lie within 1100)
    assert offload.device_stepped(units, 10_000, 0.5) == {"emb"}
    assert offload.device_stepped(units, 10_000, 0.2) == {"emb", "a", "b"}


def test_ratio_with_param_offload_is_refused_clearly():
    plan = Plan(offload=OffloadPlan(optimizer_device="cpu", param_device="cpu", ratio=0.5))
    with pytest.raises(NotImplementedError, match="ratio"):
        offload.build_offload_path(torch.nn.Linear(2, 2), plan, lambda ps: torch.optim.AdamW(ps))


@pytest.mark.parametrize("param_device,fate,stage,opt_device", [
    ("none", "mapped", 3, "cpu"), ("cpu", "unsupported", 3, "cpu"), ("none", "mapped", 2, "cpu"),
    ("none", "noop", 1, "none")])   # no optimizer offload: ratio changes nothing (and is no error at stage 1)
def test_ratio_fate(param_device, fate, stage, opt_device):
    from fsdpzero.config import load_config
    from fsdpzero.plan.translate import Env, decisions
    zero = {"stage": stage, "offload_optimizer": {"device": opt_device, "ratio": 0.3}}
    if param_device != "none":
        zero["offload_param"] = {"device": param_device}
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    got = {d.key: d.status for d in decisions(cfg, Env())}
    assert got["zero_optimization.offload_optimizer.ratio"] == fate


@pytest.mark.gpu
def test_ratio_on_gpu_matches_fsdp(one_rank_nccl):
    """1 GPU, bf16 shards: half the chunks stepped by fused torch Adam on device fp32 masters, half by the CPU
    kernel through pinned buffers; vs plain FSDP2 + fused AdamW on the GPU (bf16-grad tolerance)."""
    import dataclasses

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from fsdpzero.plan import PrecisionPlan
    from tests.offload.test_offload import Net, gpu_path_losses
    runs = []
    for offloaded in (False, True):
        torch.manual_seed(0)
        model = Net(d=256, n=4).cuda()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            fully_shard(b, mesh=init_device_mesh("cuda", (1,)), mp_policy=mp)
        fully_shard(model, mesh=init_device_mesh("cuda", (1,)), mp_policy=mp)
        if offloaded:
            plan = dataclasses.replace(Plan(), offload=OffloadPlan(optimizer_device="cpu", ratio=0.5,
                                                                   sub_group_size=100_000),
                                       precision=PrecisionPlan(param_dtype="bfloat16"))
            path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER), overlap=True)
            assert path.device_chunks and path.cpu_chunks
            assert all(e.master.is_cuda for c in path.device_chunks for e in c.entries)
        else:
            path = FSDPGradPath(model, torch.optim.AdamW(model.parameters(), **HYPER, fused=True))
        losses = gpu_path_losses(model, path)
        runs.append(losses)
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=2e-2, atol=1e-3)
