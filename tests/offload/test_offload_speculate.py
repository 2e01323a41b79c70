"""The speculative CPU step of the offload path (fsdpzero/offload/speculate.py) on 2 gloo ranks, staged through
buffers as on a GPU. Speculation may only change *when* the CPU works, never a bit of the result: every run equals
the same run without it (FSDPZERO_OFFLOAD_SPECULATE=0) exactly (losses and final params), across steps that
commit (factor 1.0), steps that clip (dropped), a skipped step (backward, no step), an lr changed between backward and
step, the early stop on the partial norm, and the overlapped step. The counters prove each branch ran."""
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdpzero.offload import build as offload
from fsdpzero.optim import clip_factor
from fsdpzero.plan import BatchPlan, OffloadPlan, Plan
from fsdpzero.offload import speculate as spec_mod
from tests.multirank import run_distributed
from tests.offload.test_offload import HYPER
from tests.offload.test_offload_pipeline import _stage2_model

NEVER, ALWAYS = 1e9, 1e-3   # clip thresholds: never clips / always clips on this model
# per step: (clip used by the step, skip the step, halve the lr after backward)
SCHEDULE = [(NEVER, False, False), (ALWAYS, False, False), (NEVER, False, False), (NEVER, True, False),
            (NEVER, False, False), (NEVER, False, True), (ALWAYS, False, False), (NEVER, False, False)]


def _run(speculate, overlap, plan_clip, drain=True, budget_frac=None, schedule=SCHEDULE):
    """speculate: True/False (knob 1/0) or "auto" (the default)."""
    if speculate == "auto":
        os.environ.pop("FSDPZERO_OFFLOAD_SPECULATE", None)
    else:
        os.environ["FSDPZERO_OFFLOAD_SPECULATE"] = "1" if speculate else "0"
    from fsdpzero.offload import speculate as spec_mod
    full_budget = spec_mod.shadow_budget
    if budget_frac is not None:   # a host with room for only part of the shadows
        spec_mod.shadow_budget = lambda entries, lw, pending=0: int(spec_mod.shadow_bytes(entries) * budget_frac)
    try:
        model = _stage2_model()
        plan = Plan(offload=OffloadPlan(optimizer_device="cpu", sub_group_size=700),
                    batch=BatchPlan(gradient_clipping=plan_clip))
        path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER), stage=True,
                                          overlap=overlap)
    finally:
        spec_mod.shadow_budget = full_budget
    assert (path.spec is not None) == bool(speculate)
    if speculate:   # a slow speculative worker: zero_grad() and the step come while it is still behind backward
        step_param = path.optimizer.step_param
        path.optimizer.step_param = lambda *a, **k: (k.get("into") is not None and time.sleep(0.01),
                                                     step_param(*a, **k))
    gen = torch.Generator().manual_seed(300 + dist.get_rank())
    losses, outcomes = [], []
    covered_at_start = len(path.spec.covered) if path.spec is not None else 0
    for clip, skip, halve_lr in schedule:
        x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
        path.set_sync(True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        path.finish_gradients()
        if speculate and drain:  # every chunk speculated before the step: the outcome does not depend on timing
            path.spec.drain()
        if halve_lr:             # e.g. a hand-written lr rule between backward and step
            for g in path.optimizer.param_groups:
                g["lr"] = g["lr"] * 0.5
        path.scale_grads_(clip_factor(path.grad_norm(), clip))
        before = path.spec.stats["entries_committed"] if speculate else 0
        if not skip:
            path.step()
        path.zero_grad()
        if speculate:
            path.wait()
            outcomes.append((path.spec.last, path.spec.stats["entries_committed"] - before))
        losses.append(loss.item())
    path.wait()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    stats = dict(path.spec.stats) if path.spec is not None else {}
    if path.spec is not None:
        stats["covered"], stats["chunks"] = len(path.spec.covered), len(path.cpu_chunks)
        stats["covered_at_start"] = covered_at_start
        staged = [e for c in path.cpu_chunks for e in c.entries]
        stats["shadow_fraction"] = path.spec.shadow_used_bytes / spec_mod.shadow_bytes(staged)
    path.close()
    return losses, full, outcomes, stats


def _scenario(rank, world, overlap, plan_clip):
    torch.set_num_threads(1)   # the worker threads add their own OpenMP teams: keep 2 ranks within 2 cores
    return _run(False, overlap, plan_clip), _run(True, overlap, plan_clip), _run(True, overlap, plan_clip, False)


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_speculation_commits_drops_and_changes_nothing(overlap):
    for (ref_losses, ref, _, _), drained, timed in run_distributed(_scenario, 2, overlap, NEVER, timeout=180):
        for losses, got, _, _ in (drained, timed):   # the worker's progress at step() changes nothing
            assert losses == ref_losses
            assert all(torch.equal(got[k], ref[k]) for k in ref)
        outcomes, stats = drained[2], drained[3]
        # drained: every entry is committed where the factor was 1.0 and the lr unchanged, none when the lr
        # changed after backward (made with the old lr) or the step clipped or was skipped
        entries = max(k for _, k in outcomes)
        assert entries > 0 and [outcomes[i] for i in (0, 2, 4, 7)] == [("committed", entries)] * 4, outcomes
        assert outcomes[5] == ("committed", 0), outcomes
        assert [outcomes[i] for i in (1, 3, 6)] == [("dropped", 0)] * 3, outcomes
        assert stats["entries_committed"] > 0 and stats["stopped_early"] == 0


def _scenario_budget(rank, world):
    torch.set_num_threads(1)
    return _run(False, True, NEVER), _run(True, True, NEVER, budget_frac=0.5), _run("auto", True, NEVER)


def test_shadows_limited_by_host_memory_cover_the_last_chunks():
    """Shadows for only half of the bytes (a host without room for all), and the default (auto: at most 40%): the
    last chunks are speculated and committed, the others step after backward; the results are those of the run
    without speculation."""
    for (ref_losses, ref, _, _), *runs in run_distributed(_scenario_budget, 2, timeout=180):
        for (losses, got, outcomes, stats), most in zip(runs, (0.5, 0.4)):
            assert losses == ref_losses
            assert all(torch.equal(got[k], ref[k]) for k in ref)
            assert 0 < stats["covered"] < stats["chunks"] and stats["shadow_fraction"] <= most, stats
            assert stats["entries_committed"] > 0 and outcomes[0][0] == "committed", (stats, outcomes)


def _scenario_trim(rank, world):
    torch.set_num_threads(1)
    steps = [(NEVER, False, False)] * 9
    return _run(False, True, NEVER, schedule=steps), _run(True, True, NEVER, drain=False, schedule=steps)


def test_shadows_the_worker_never_reaches_are_released():
    """A slow speculative worker (10 ms per param) and the step right after backward: after TRIM_AFTER committed
    steps the shadows of the chunks it never reached are released; the run stays bit-identical, before and after."""
    from fsdpzero.offload.speculate import TRIM_AFTER
    assert TRIM_AFTER < 9
    for (ref_losses, ref, _, _), (losses, got, outcomes, stats) in run_distributed(_scenario_trim, 2, timeout=180):
        assert losses == ref_losses
        assert all(torch.equal(got[k], ref[k]) for k in ref)
        assert stats["covered"] < stats["covered_at_start"], stats
        assert [o for o, _ in outcomes] == ["committed"] * 9, outcomes


def test_partial_norm_stops_speculation_early():
    """gradient_clipping far below this model's norms: this rank's partial sum of squares already proves the step
    will clip, so the worker stops stepping; the results are still those of the run without speculation."""
    for (ref_losses, ref, _, _), (losses, got, outcomes, stats), _ in run_distributed(_scenario, 2, False, ALWAYS,
                                                                                        timeout=180):
        assert losses == ref_losses
        assert all(torch.equal(got[k], ref[k]) for k in ref)
        assert stats["stopped_early"] >= 6 and stats["entries_committed"] == 0


@pytest.mark.gpu
def test_speculation_on_gpu_is_bit_identical(one_rank_nccl):
    """1 GPU, bf16 shards: grads land through the D2H stream and its events, the worker waits on them, and the
    committed buffers go back H2D. Bit-identical to FSDPZERO_OFFLOAD_SPECULATE=0, with commits and drops."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdpzero.plan import PrecisionPlan
    from tests.offload.test_offload import Net

    def run(speculate):
        os.environ["FSDPZERO_OFFLOAD_SPECULATE"] = "1" if speculate else "0"
        torch.manual_seed(0)
        model = Net(d=256, n=4).cuda()
        mesh = init_device_mesh("cuda", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        plan = dataclasses.replace(Plan(), offload=OffloadPlan(optimizer_device="cpu", sub_group_size=100_000),
                                   precision=PrecisionPlan(param_dtype="bfloat16"),
                                   batch=BatchPlan(gradient_clipping=NEVER))
        path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER), overlap=True)
        gen = torch.Generator(device="cuda").manual_seed(5)
        losses = []
        for clip, skip, _ in SCHEDULE:
            x = torch.randn(32, 7, device="cuda", generator=gen)
            y = torch.randn(32, 5, device="cuda", generator=gen)
            loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            path.finish_gradients()
            path.scale_grads_(clip_factor(path.grad_norm(), clip))
            if not skip:
                path.step()
            path.zero_grad()
            losses.append(loss.item())
        path.wait()
        stats = dict(path.spec.stats) if path.spec is not None else {}
        return losses, {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}, stats

    (ref_losses, ref, _), (losses, got, stats) = run(False), run(True)
    assert losses == ref_losses
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert stats["entries_committed"] > 0 and stats["dropped"] >= 2


def _steps(model, path, gen, n, clip, reads):
    losses = []
    for i in range(n):
        x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
        path.set_sync(True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        path.finish_gradients()
        if path.spec is not None:   # every chunk speculated before the step: commits do not depend on timing
            path.spec.drain()
        path.scale_grads_(clip_factor(path.grad_norm(), clip))
        path.step()
        path.zero_grad()
        reads.append([p.to_local().clone() for p in model.parameters()])   # right after step(): must wait
        losses.append(loss.item())
    return losses


def _checkpoint_scenario(rank, world, ckpt_dir):
    """8 serial steps against 4 speculative + overlapped steps, a DCP checkpoint taken right after the 4th step()
    (the CPU step may still be running), a fresh model and path loading it, and 4 more steps. Steps alternate
    between never clipping (speculation committed) and always clipping (dropped)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    torch.set_num_threads(1)

    def build(speculate, overlap, seed=0):
        os.environ["FSDPZERO_OFFLOAD_SPECULATE"] = "1" if speculate else "0"
        torch.manual_seed(seed)
        model = _stage2_model() if seed == 0 else _reseeded_stage2_model(seed)
        plan = Plan(offload=OffloadPlan(optimizer_device="cpu", sub_group_size=700),
                    batch=BatchPlan(gradient_clipping=NEVER))
        path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER), stage=True,
                                          overlap=overlap)
        return model, path

    clips = [NEVER, ALWAYS, NEVER, NEVER, ALWAYS, NEVER, NEVER, ALWAYS]
    model, path = build(False, False)
    gen, ref_reads = torch.Generator().manual_seed(7 + rank), []
    ref = [l for c in clips for l in _steps(model, path, gen, 1, c, ref_reads)]
    ref_params = {n: p.full_tensor() for n, p in model.named_parameters()}

    model, path = build(True, True)
    step_param = path.optimizer.step_param   # a slow CPU step: the checkpoint comes while it is running
    path.optimizer.step_param = lambda *a, **k: (time.sleep(0.002), step_param(*a, **k))[1]
    gen, reads = torch.Generator().manual_seed(7 + rank), []
    first = [l for c in clips[:4] for l in _steps(model, path, gen, 1, c, reads)]
    dcp.save({"model": get_model_state_dict(model), "optim": path.state_dict()}, checkpoint_id=ckpt_dir)
    committed = path.spec.stats["entries_committed"]
    model2, path2 = build(True, True, seed=123)
    state = {"model": get_model_state_dict(model2), "optim": path2.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_model_state_dict(model2, state["model"])
    path2.load_state_dict(state["optim"])
    second = [l for c in clips[4:] for l in _steps(model2, path2, gen, 1, c, reads)]
    params = {n: p.full_tensor() for n, p in model2.named_parameters()}
    committed += path2.spec.stats["entries_committed"]
    waits = path.reads.waits + path2.reads.waits
    path.close(), path2.close()
    return ref, ref_reads, ref_params, first + second, reads, params, committed, waits


def _reseeded_stage2_model(seed):
    model = _stage2_model()
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(0.1 * seed)   # other weights until the checkpoint is loaded
    return model


def test_speculative_overlapped_run_reads_and_checkpoints_exactly(tmp_path):
    """Speculation + overlap against the serial path: the same losses, the same weights read through
    model.parameters() right after every step(), a checkpoint taken right after step() that resumes exactly."""
    for ref, ref_reads, ref_params, losses, reads, params, committed, waits in run_distributed(
            _checkpoint_scenario, 2, str(tmp_path / "ck"), timeout=240):
        assert committed > 0 and waits > 0      # speculation was committed, reads did wait
        assert losses == ref
        assert all(torch.equal(a, b) for ra, rb in zip(reads, ref_reads) for a, b in zip(ra, rb))
        assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)


def _tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(tmp_path / "proc"), str(tmp_path / "cg")


GiB = 2**30


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_host_available_reads_the_jobs_own_cgroup(tmp_path, layout):
    """A Slurm/systemd job sits in a sub-cgroup with its own limit: the shadow budget must see that limit, and the
    tightest of the cgroups above it, not only the mount's root (which often has none)."""
    mem = {"proc/meminfo": f"MemTotal: {128 * GiB // 1024} kB\nMemAvailable: {100 * GiB // 1024} kB\n"}
    if layout == "v2":
        files = {**mem, "proc/self/cgroup": "0::/slurm/job_7/step_0\n", "cg/cgroup.controllers": "memory\n",
                 "cg/memory.max": "max\n", "cg/memory.current": str(50 * GiB),
                 "cg/slurm/job_7/memory.max": str(40 * GiB), "cg/slurm/job_7/memory.current": str(30 * GiB),
                 "cg/slurm/job_7/step_0/memory.max": "max", "cg/slurm/job_7/step_0/memory.current": str(29 * GiB)}
    else:
        files = {**mem, "proc/self/cgroup": "5:devices:/\n4:memory:/slurm/job_7\n1:cpu:/\n",
                 "cg/memory/memory.limit_in_bytes": str(2**63 - 4096),
                 "cg/memory/memory.usage_in_bytes": str(50 * GiB),
                 "cg/memory/slurm/job_7/memory.limit_in_bytes": str(40 * GiB),
                 "cg/memory/slurm/job_7/memory.usage_in_bytes": str(30 * GiB)}
    proc, cg = _tree(tmp_path, files)
    assert spec_mod.host_available_bytes(proc, cg) == 10 * GiB       # the job's 40 GiB limit, 30 used
    job = "cg/slurm/job_7/memory.stat" if layout == "v2" else "cg/memory/slurm/job_7/memory.stat"
    key = "inactive_file" if layout == "v2" else "total_inactive_file"
    (tmp_path / job).write_text(f"active_file 5\n{key} {8 * GiB}\n")   # reclaimable page cache is room too
    assert spec_mod.host_available_bytes(proc, cg) == 18 * GiB
    (tmp_path / "proc/self/cgroup").write_text("0::/../../elsewhere\n" if layout == "v2" else
                                               "4:memory:/../elsewhere\n")   # outside the namespace: the mount
    assert spec_mod.host_available_bytes(proc, cg) == 100 * GiB
    # a cgroup namespace (container): the path is "/", the mount is the job's own cgroup
    (tmp_path / "proc/self/cgroup").write_text("0::/\n" if layout == "v2" else "4:memory:/\n")
    assert spec_mod.host_available_bytes(proc, cg) == 100 * GiB      # no limit at the mount: MemAvailable


# clipped, then unclipped, in runs: auto skips the backward right after each clipped step
RUNS = [(ALWAYS, False, False), (NEVER, False, False), (NEVER, False, False), (NEVER, False, False),
        (ALWAYS, False, False), (NEVER, False, False), (NEVER, False, False)]


def _scenario_after_clip(rank, world):
    torch.set_num_threads(1)
    runs = (_run(False, True, NEVER, schedule=RUNS), _run("auto", True, NEVER, schedule=RUNS),
            _run(True, True, NEVER, schedule=RUNS))
    os.environ["LOCAL_WORLD_SIZE"] = "1"   # as if each rank were alone on its host: auto speculates every backward
    return runs + (_run("auto", True, NEVER, schedule=RUNS),)


def test_auto_does_not_speculate_right_after_a_clipped_step():
    """offload_speculate auto with several local ranks: the backward after a clipped step is not speculated (a
    dropped speculation takes memory bandwidth that ranks sharing a host need); the next one is. The knob set on,
    or auto for a rank alone on its host, speculates every backward. None changes a bit of the result."""
    for (ref_losses, ref, _, _), auto, forced, alone in run_distributed(_scenario_after_clip, 2, timeout=180):
        for losses, got, _, _ in (auto, forced, alone):
            assert losses == ref_losses
            assert all(torch.equal(got[k], ref[k]) for k in ref)
        assert [o for o, _ in auto[2]] == ["dropped", None, "committed", "committed", "dropped", None, "committed"]
        assert auto[3]["skipped_after_clip"] == 2
        assert [o for o, _ in forced[2]] == ["dropped", "committed", "committed", "committed", "dropped",
                                              "committed", "committed"]
        assert forced[3]["skipped_after_clip"] == 0
        assert [o for o, _ in alone[2]] == [o for o, _ in forced[2]] and alone[3]["skipped_after_clip"] == 0
