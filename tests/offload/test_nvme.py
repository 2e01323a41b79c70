"""offload_optimizer.device: nvme — NVMeAdam equals CPUAdam (states in memory) bit for bit, alone and on 2 gloo
ranks under FSDP2; swap directories are checked before step 1, removed on close, and cleaned after a kill."""
import errno
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import fsdpzero_ops  # noqa: F401
from fsdpzero.offload import nvme_adam as nvme
from fsdpzero.offload.nvme_adam import NVMeAdam, SwapDir, nvme_optimizer_from_plan
from fsdpzero.plan import AioPlan, OffloadPlan, OptimizerPlan, Plan
from fsdpzero_ops.cpu_adam import CPUAdam
from fsdpzero.offload import swapdir
from tests.multirank import run_distributed
from tests.ops.test_aio import _in_child

SHAPES = [(37,), (100, 30), (5000,), (3,), (64, 65)]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def _disk(nvme_path, **offload):
    """The plan's offload section with the optimizer's states under nvme_path (the schema's defaults otherwise)."""
    return OffloadPlan(optimizer_nvme_path=nvme_path, **offload)


def _groups(params):
    """Two param groups with different hyperparameters."""
    return [{"params": params[:2], "lr": 3e-2, "weight_decay": 0.1}, {"params": params[2:], "lr": 1e-2}]


def _train(opt, params, steps, dtype, seed=1, skip=None):
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g).to(dtype)
            p.grad = None if (skip is not None and i == skip and step % 2) else grad
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sub_group_size,buffer_count", [(2000, 4), (777, 2), (10**9, 1), (1500, 3)])
def test_matches_cpu_adam_bit_exact(tmp_path, dtype, sub_group_size, buffer_count):
    ref, ours = _params(dtype), _params(dtype)
    a = CPUAdam(_groups(ref), betas=(0.8, 0.99), adamw_mode=True)
    b = NVMeAdam(_groups(ours), betas=(0.8, 0.99), adamw_mode=True,
                 offload=_disk(tmp_path, sub_group_size=sub_group_size, buffer_count=buffer_count,
                               aio=AioPlan(block_size=8192)))
    if sub_group_size < 5000:
        assert any(s[2] > 0 for g in b._groups for s in g.slices)       # a param split across sub-groups
    _train(a, ref, 6, dtype, skip=3)
    _train(b, ours, 6, dtype, skip=3)
    for x, y in zip(ref, ours):
        assert torch.equal(x, y)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"] or all(
        {k: v for k, v in ga.items() if k != "decoupled_weight_decay"} ==
        {k: v for k, v in gb.items() if k != "decoupled_weight_decay"} for ga, gb in zip(sa["param_groups"],
                                                                                         sb["param_groups"]))
    for i, st in sa["state"].items():
        assert sorted(st) == sorted(sb["state"][i])
        for k in st:
            assert torch.equal(st[k], sb["state"][i][k]), (i, k)
    swap = b.swap_dir.path
    assert swap.exists() and (swap / swapdir.MARKER).exists() and swapdir.is_swap_dir(swap)
    assert len(list(swap.parent.iterdir())) == 1
    b.close()
    assert not swap.exists() and not (tmp_path / swapdir.SWAP_ROOT).exists()


def test_state_dict_round_trip(tmp_path):
    """CPUAdam state -> NVMeAdam.load_state_dict -> continue == CPUAdam continuing; fp32 moments kept exactly."""
    dtype = torch.bfloat16
    ref, ours = _params(dtype), _params(dtype)
    a = CPUAdam(_groups(ref), adamw_mode=True)
    _train(a, ref, 3, dtype)
    for x, y in zip(ref, ours):
        y.data.copy_(x.data)
    b = NVMeAdam(_groups(ours), adamw_mode=True, offload=_disk(tmp_path, sub_group_size=3000))
    b.load_state_dict(a.state_dict())
    assert all(set(st) == {"step"} for st in b.state.values())          # moments went to disk, not memory
    _train(a, ref, 3, dtype, seed=5)
    _train(b, ours, 3, dtype, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(ref, ours))
    b.close()


def test_from_plan_and_errors(tmp_path):
    plan = Plan(offload=OffloadPlan(optimizer_device="nvme", optimizer_nvme_path=str(tmp_path), sub_group_size=999,
                                    buffer_count=3),
                optimizer=OptimizerPlan(type="adamw", params={"lr": 1e-3, "betas": [0.9, 0.95]}))
    opt = nvme_optimizer_from_plan(_params(torch.float32), plan)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["decoupled_weight_decay"]
    assert len(opt._buffers) == 3 and max(g.numel for g in opt._groups) <= 2 * 999 + 2 * 3 * 1024
    opt.close()
    with pytest.raises(ValueError, match="needs optimizer.type Adam or AdamW .* got 'sgd'"):
        nvme_optimizer_from_plan(_params(torch.float32), Plan(optimizer=OptimizerPlan(type="sgd")))
    with pytest.raises(ValueError, match="'offload_optimizer.nvme_path' is not set"):
        NVMeAdam(_params(torch.float32), offload=_disk(None))


def test_warns_when_swap_buffers_hold_most_of_the_state(tmp_path, caplog):
    """DeepSpeed's default sub_group_size (1e9) makes one sub-group per rank below 1e9 params: its one buffer is the
    whole state, in memory. That is said once at construction; small sub-groups stay silent."""
    p = torch.zeros(1 << 23, requires_grad=True)            # 64 MiB of moments on disk (fp32: its own master)
    for size, warned in ((10**9, True), (1 << 19, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="fsdpzero"):
            NVMeAdam([p], offload=_disk(tmp_path, sub_group_size=size)).close()
        assert any("lower sub_group_size" in r.getMessage() for r in caplog.records) == warned, size


def test_missing_path_errors_before_anything(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"offload_optimizer.nvme_path' = '.*/nope': the directory does not "
                                                r"exist; create it"):
        NVMeAdam(_params(torch.float32), offload=_disk(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        NVMeAdam(_params(torch.float32), offload=_disk(tmp_path / "file"))


def test_unwritable_path(tmp_path):
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="fsdpzero_ro_"))   # pytest's tmp root is 0700: the child could not reach it
    top.chmod(0o755)
    d = top / "ro"
    d.mkdir(mode=0o555)

    def attempt():
        if os.geteuid() == 0:          # root ignores modes: drop to nobody, after a warm-up run for lazy imports
            NVMeAdam(_params(torch.float32), offload=_disk(tmp_path)).close()
            os.setgid(65534), os.setuid(65534)
        NVMeAdam(_params(torch.float32), offload=_disk(d))
        return "constructed"
    try:
        msg = _in_child(attempt)
    finally:
        d.chmod(0o755)
        shutil.rmtree(top)
    assert msg.startswith("PermissionError: [Errno 13] config key 'offload_optimizer.nvme_path' = ") and \
        "not writable (or not reachable) by this user" in msg, msg


def test_not_enough_free_space(tmp_path, monkeypatch):
    """The free-space check names the bytes needed and found (disk_usage reports a nearly full disk)."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=12345))
    with pytest.raises(OSError, match=r"needs 1\d+ bytes \(0.00 GiB\) of swap space, the file system has 12345 "
                                      r"bytes") as e:
        NVMeAdam(_params(torch.float32), offload=_disk(tmp_path))
    assert e.value.errno == errno.ENOSPC
    assert not (tmp_path / swapdir.SWAP_ROOT).exists()                     # nothing left behind


def test_real_small_file_system(tmp_path):
    """A 64 KiB tmpfs (needs mount rights; skipped otherwise): the clear error, before step 1."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(OSError, match=r"needs \d+ bytes .* swap space, the file system has \d+ bytes"):
            NVMeAdam(_params(torch.float32), offload=_disk(mnt))
        assert not (mnt / swapdir.SWAP_ROOT).exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_write_limit_hit_during_setup(tmp_path):
    """Space reported free but writes refused (quota / ulimit -f): the initial state write fails in the
    constructor, before step 1, naming the file; the swap directory is removed."""
    def attempt():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
        NVMeAdam(_params(torch.float32), offload=_disk(tmp_path, sub_group_size=1000))
        return "constructed"
    msg = _in_child(attempt)
    assert msg.startswith("OSError: [Errno 27] fsdpzero aio: write of") and "optimizer_states.swp" in msg, msg
    assert not (tmp_path / swapdir.SWAP_ROOT).exists()


def test_killed_mid_step_leaves_nothing_after_next_start(tmp_path, monkeypatch):
    pid = os.fork()
    if pid == 0:     # child: SIGKILL inside the second sub-group's Adam step of step 2
        calls = []

        def dying_step(*a, **k):
            calls.append(1)
            if len(calls) == len(SHAPES) + 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_step(*a, **k)
        real_step = nvme.adam_step_
        nvme.adam_step_ = dying_step
        ps = _params(torch.float32)
        opt = NVMeAdam(ps, offload=_disk(tmp_path, sub_group_size=1000))
        _train(opt, ps, 2, torch.float32)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    stale = list((tmp_path / swapdir.SWAP_ROOT).iterdir())
    assert len(stale) == 1 and f".{pid}." in stale[0].name and stale[0].name.endswith(".rank0")
    assert any(stale[0].iterdir())
    opt = NVMeAdam(_params(torch.float32), offload=_disk(tmp_path))            # the next start
    assert list((tmp_path / swapdir.SWAP_ROOT).iterdir()) == [opt.swap_dir.path]
    opt.close()
    assert not (tmp_path / swapdir.SWAP_ROOT).exists()


def test_live_and_foreign_dirs_are_kept(tmp_path):
    """Another live process's directory, and other hosts' ones, are never removed."""
    live = SwapDir(tmp_path, rank=0)
    foreign = tmp_path / swapdir.SWAP_ROOT / "otherhost.1.0.rank0"
    foreign.mkdir()
    assert swapdir.remove_stale_swap_dirs(tmp_path) == []
    assert live.path.exists() and foreign.exists()
    live.close()
    assert foreign.exists()


# --------------------------------------------------------------------------------------------- 2 ranks, FSDP2

def _fsdp_run(rank, world, nvme_path, use_nvme):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 33),
                                torch.nn.GELU(), torch.nn.Linear(33, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    if use_nvme:
        plan = Plan(offload=OffloadPlan(optimizer_device="nvme", optimizer_nvme_path=nvme_path, sub_group_size=300,
                                        buffer_count=3, aio=OffloadPlan().aio),
                    optimizer=OptimizerPlan(type="adamw", params={"lr": 1e-2, "weight_decay": 0.01}))
        opt = nvme_optimizer_from_plan(model.parameters(), plan)
        swap = opt.swap_dir.path
        assert swap.name.endswith(f".rank{rank}") and swap.exists()
    else:
        opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01, adamw_mode=True)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if use_nvme:
        opt.close()
        assert not swap.exists()
    return losses, full


@pytest.mark.slow
def test_two_rank_fsdp_nvme_equals_cpu_offload(tmp_path):
    cpu = run_distributed(_fsdp_run, 2, str(tmp_path), False, timeout=120)
    ours = run_distributed(_fsdp_run, 2, str(tmp_path), True, timeout=120)
    assert cpu[0][0] == ours[0][0]                                       # loss trajectory, bit-exact
    assert cpu[0][0][0] != cpu[0][0][-1]                                 # and it trained
    for k, v in cpu[0][1].items():
        assert torch.equal(v, ours[0][1][k]), k
    assert not (tmp_path / swapdir.SWAP_ROOT).exists()


def test_removed_when_collected_and_at_exit(tmp_path):
    import gc
    import sys
    opt = NVMeAdam(_params(torch.float32), offload=_disk(tmp_path))
    assert (tmp_path / swapdir.SWAP_ROOT).exists()
    del opt
    gc.collect()
    assert not (tmp_path / swapdir.SWAP_ROOT).exists()
    code = ("import torch, fsdpzero.offload.nvme_adam as n; from fsdpzero.plan import OffloadPlan; "
            "p = [torch.zeros(10, requires_grad=True)]; "
            f"o = n.NVMeAdam(p, offload=OffloadPlan(optimizer_nvme_path={str(tmp_path)!r})); "
            "p[0].grad = torch.ones(10); o.step(); "
            "print(o.swap_dir.path)")           # exits without close(): the atexit finalizer cleans up
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert "fsdpzero_swap" in out.stdout and not (tmp_path / swapdir.SWAP_ROOT).exists()


# ------------------------------------------------------------- the engine's offload path: nvme == cpu, bit for bit

def _offload_nvme_vs_cpu(rank, world, kind, nvme_path, dtype, overlap=False):
    from fsdpzero.offload import build as offload
    from fsdpzero.plan import PrecisionPlan
    from fsdpzero.optim import clip_factor
    from tests.offload.test_offload import HYPER, _model

    def _train(model, path, steps, clip=0.0):
        gen = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(steps):
            x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            path.finish_gradients()
            path.scale_grads_(clip_factor(path.grad_norm(), clip))
            path.step()
            path.zero_grad()
            dist.all_reduce(loss := loss.detach())
            losses.append(loss.item())
        path.wait()                                      # an overlapped step may still be running
        return losses, {n: p.full_tensor().float() for n, p in model.named_parameters()}
    torch.set_num_threads(1)
    bf16 = dtype == "bfloat16"
    runs = []
    for device in ("cpu", "nvme"):
        plan = Plan(offload=OffloadPlan(optimizer_device=device, param_device="cpu" if kind == "param" else "none",
                                        optimizer_nvme_path=nvme_path, sub_group_size=700, buffer_count=3),
                    precision=PrecisionPlan(param_dtype=dtype))
        model = _model(param_dtype=torch.bfloat16 if bf16 else None, cpu_offload=kind == "param")
        path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER),
                                       stage=kind == "staged", overlap=overlap)
        runs.append(_train(model, path, steps=5, clip=0.05))
        if device == "nvme":
            assert len(path.optimizer._groups) > 1 and path.optimizer.swap_dir.path.exists()
            sd = path.state_dict()                       # the cpu path's checkpoint layout, read from disk
            fresh = _model(param_dtype=torch.bfloat16 if bf16 else None, cpu_offload=kind == "param")
            path2 = offload.build_offload_path(fresh, plan, lambda ps: torch.optim.AdamW(ps, **HYPER),
                                            stage=kind == "staged")
            path2.load_state_dict(sd)
            resumed = (_train(model, path, steps=2)[0], _train(fresh, path2, steps=2)[0])
            path.close(), path2.close()
    return runs, resumed


@pytest.mark.slow
@pytest.mark.parametrize("kind,dtype,overlap", [("staged", "float32", False), ("inplace", "float32", False),
                                                ("param", "float32", True), ("param", "bfloat16", False)])
def test_offload_path_nvme_equals_cpu(tmp_path, kind, dtype, overlap):
    """offload_optimizer nvme through fsdpzero.offload.build.build_offload_path (the engine's GradPath) on 2 gloo ranks:
    the same loss trajectory and final params as offload_optimizer cpu, bit for bit; resuming from its
    state_dict continues identically; no swap files remain."""
    for (cpu, ours), (a, b) in run_distributed(_offload_nvme_vs_cpu, 2, kind, str(tmp_path), dtype, overlap,
                                               timeout=180):
        assert cpu[0] == ours[0]
        for name, v in cpu[1].items():
            assert torch.equal(v, ours[1][name]), name
        assert a == b
    assert not (tmp_path / swapdir.SWAP_ROOT).exists()


# ---------------------------------------------------------------- end to end: a ds_config through fsdpzero.wrap

def _engine_run(rank, world, device, stage, nvme_path, save_dir):
    from fsdpzero.api import wrap
    from tests.engine_cases import batches, build_model, engine_losses, full_params
    offload = {"device": device, "pin_memory": True}
    if device == "nvme":
        offload.update(nvme_path=nvme_path, buffer_count=3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "offload_optimizer": offload, "sub_group_size": 20000},
           "aio": {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 1}}
    engine = wrap(build_model("gpt2"), cfg)
    data = batches(4, 1, 2 * world)
    losses = engine_losses(engine, data[:2], rank, world)
    engine.save_checkpoint(save_dir)
    assert not any(swapdir.is_swap_dir(p) for p in Path(save_dir).rglob("*")), "swap files in a checkpoint"
    if device == "nvme":
        assert any(d.name.endswith(f".rank{rank}") for d in (Path(nvme_path) / swapdir.SWAP_ROOT).iterdir())
    losses += engine_losses(engine, data[2:], rank, world)
    again = None
    if device == "nvme":   # (a fresh cpu-offload engine cannot load yet: its CPUAdam has no states before step 1)
        resumed = wrap(build_model("gpt2", seed=7), cfg)
        resumed.load_checkpoint(save_dir)
        again = engine_losses(resumed, data[2:], rank, world)
    return losses, again, full_params(engine.module)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3])     # stage 2 passes too; one stage keeps CI short
def test_ds_config_nvme_equals_cpu_offload_end_to_end(tmp_path, stage):
    """`offload_optimizer: {device: nvme}` in a ds_config, through fsdpzero.wrap, 2 gloo ranks: the same losses and
    final params as `device: cpu`, bit for bit; its checkpoint resumes identically and holds no swap files."""
    cpu = run_distributed(_engine_run, 2, "cpu", stage, str(tmp_path), str(tmp_path / "ck_cpu"), timeout=240)
    ours = run_distributed(_engine_run, 2, "nvme", stage, str(tmp_path), str(tmp_path / "ck_nvme"), timeout=240)
    for (l_cpu, _, p_cpu), (l_nvme, again, p_nvme) in zip(cpu, ours):
        assert l_cpu == l_nvme and l_nvme[0] != l_nvme[-1]
        assert again == l_nvme[2:]
        for k, v in p_cpu.items():
            assert torch.equal(v, p_nvme[k]), k
    swapdir.remove_stale_swap_dirs(tmp_path)    # whatever a rank left (forked ranks may skip atexit) is stale now
    assert not (tmp_path / swapdir.SWAP_ROOT).exists()


@pytest.mark.gpu
def test_nvme_offload_on_gpu_equals_cpu_offload(tmp_path, one_rank_nccl):
    """1 GPU, bf16 shards on the device, staged D2H / CPU step / H2D: offload_optimizer nvme == cpu, bit for bit."""
    import dataclasses
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from fsdpzero.offload import build as offload
    from fsdpzero.plan import PrecisionPlan
    from tests.offload.test_offload import HYPER, Net, gpu_path_losses
    runs = []
    for device in ("cpu", "nvme"):
        torch.manual_seed(0)
        model = Net(d=256, n=4).cuda()
        mesh = init_device_mesh("cuda", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        plan = dataclasses.replace(Plan(), offload=OffloadPlan(optimizer_device=device, sub_group_size=100_000,
                                                               optimizer_nvme_path=str(tmp_path)),
                                   precision=PrecisionPlan(param_dtype="bfloat16"))
        path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER))
        losses = gpu_path_losses(model, path)
        torch.cuda.synchronize()
        runs.append((losses, {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}))
        if device == "nvme":
            assert len(path.optimizer._groups) > 1
            path.close()
    assert runs[0][0] == runs[1][0]
    for n, v in runs[0][1].items():
        assert torch.equal(v, runs[1][1][n]), n
