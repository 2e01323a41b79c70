"""offload_param.device: nvme (stage 3) — FSDP2's CPU shards live in a swap file between uses: the same losses and
final params as offload_param cpu, bit for bit (with offload_optimizer cpu and nvme); evicted units hold no CPU
memory and the swap file holds their values; checkpoints resume; bad buffer settings give clear errors."""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fsdpzero_ops  # noqa: F401
from fsdpzero.offload import nvme_adam as nvme
from fsdpzero.plan import OffloadPlan, Plan, PrecisionPlan, ShardPlan
from fsdpzero.offload import swapdir
from tests.multirank import run_distributed


def _plan(opt_device, param_device, nvme_path, dtype, **param_knobs):
    knobs = dict(param_buffer_count=3, max_in_cpu=10**9, param_buffer_size=10**8) | param_knobs
    return Plan(shard=ShardPlan(stage=3, reshard_after_forward=True),
                offload=OffloadPlan(optimizer_device=opt_device, param_device=param_device,
                                    optimizer_nvme_path=nvme_path, param_nvme_path=nvme_path, sub_group_size=700,
                                    buffer_count=3, **knobs),
                precision=PrecisionPlan(param_dtype=dtype))


def _resident(model):
    """Elements of CPU shard storage actually allocated, per FSDP unit (module order)."""
    from fsdpzero.fsdp2_internals import fsdp_units
    from fsdpzero.fsdp2_internals import param_groups
    out = []
    for m in fsdp_units(model):
        fps = [fp for g in param_groups(m) for fp in g.fsdp_params]
        out.append(sum(fp._sharded_param_data.untyped_storage().nbytes() // fp._sharded_param_data.element_size()
                       for fp in fps))
    return out


def _path_run(rank, world, opt_device, nvme_path, dtype, max_in_cpu):
    """offload_param cpu vs nvme through fsdpzero.offload.build.build_offload_path on the same model and data."""
    from fsdpzero.offload import build as offload
    from fsdpzero.optim import clip_factor
    from tests.offload.test_offload import HYPER, _model
    torch.set_num_threads(1)
    bf16 = dtype == "bfloat16"
    runs, checks = [], {}
    for param_device in ("cpu", "nvme"):
        plan = _plan(opt_device, param_device, nvme_path, dtype, max_in_cpu=max_in_cpu)
        model = _model(param_dtype=torch.bfloat16 if bf16 else None, cpu_offload=True)
        path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER))
        gen = torch.Generator().manual_seed(100 + rank)
        losses, bounds = [], []
        for _ in range(5):
            x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            path.finish_gradients()
            path.scale_grads_(clip_factor(path.grad_norm(), 0.05))
            path.step()
            path.zero_grad()
            dist.all_reduce(loss := loss.detach())
            losses.append(loss.item())
            if param_device == "nvme":
                bounds.append(_resident(model))
        if param_device == "nvme":
            sw = path.param_swapper
            checks["resident"] = bounds
            checks["peak"] = sw.peak                       # (units, elements) at any point of fwd / bwd / step
            checks["numel"] = [u.numel for u in sw.units]
            checks["evicted_match_file"] = _evicted_match_file(sw)
            swap = sw.swap_dir.path
            assert (swap / "params.swp").exists()
        path.close()                                       # nvme: the shards back in memory, swap files gone
        if param_device == "nvme":
            assert not swap.exists()
        runs.append((losses, {n: p.full_tensor().float() for n, p in model.named_parameters()}))
    return runs, checks


def _evicted_match_file(sw):
    """For every unit swapped out now: its storages are empty, and restoring it gives exactly the swap file's
    bytes (read here with plain file I/O, not through the engine)."""
    evicted = [k for k, u in enumerate(sw.units) if not u.resident]
    assert evicted, "nothing was swapped out"
    raw = (sw.swap_dir.path / "params.swp").read_bytes()
    for k in evicted:
        u = sw.units[k]
        assert all(fp._sharded_param_data.untyped_storage().nbytes() == 0 for fp in u.shards)
    sw.restore_all()
    for k in evicted:
        u = sw.units[k]
        for fp, n, off in zip(u.shards, u.nbytes, u.offsets):
            mem = bytes(torch.empty(0, dtype=torch.uint8).set_(fp._sharded_param_data.untyped_storage(), 0,
                                                                (n,)).numpy())
            assert mem == raw[off:off + n]
    return len(evicted)


@pytest.mark.slow
@pytest.mark.parametrize("opt_device,dtype", [("cpu", "float32"), ("nvme", "bfloat16"), ("cpu", "bfloat16"),
                                              ("nvme", "float32")])
def test_param_nvme_equals_param_cpu(tmp_path, opt_device, dtype):
    """2 gloo ranks, 5 steps with clipping: losses and final params bit-identical to offload_param cpu; at most
    max_in_cpu elements of shards resident after every step; evicted units' storages are empty and the swap file
    holds their values."""
    max_in_cpu = 4000          # per rank: blocks ~1776 elements each, the root ~160; two blocks must fit
    for (cpu, ours), checks in run_distributed(_path_run, 2, opt_device, str(tmp_path), dtype, max_in_cpu,
                                               timeout=240):
        assert cpu[0] == ours[0] and cpu[0][0] != cpu[0][-1]
        for name, v in cpu[1].items():
            assert torch.equal(v, ours[1][name]), name
        assert all(sum(r) <= max_in_cpu for r in checks["resident"]), checks
        assert all(sum(1 for x in r if x) <= 3 for r in checks["resident"])          # param buffer_count
        assert checks["peak"][0] <= 3 and 0 < checks["peak"][1] <= max_in_cpu
        assert sum(checks["numel"]) > max_in_cpu and checks["evicted_match_file"] >= 1
    assert not (tmp_path / swapdir.SWAP_ROOT).exists()


# ---------------------------------------------------------------- end to end: a ds_config through fsdpzero.wrap

def _engine_run(rank, world, param_device, nvme_path, save_dir):
    from safetensors.torch import load_file
    from fsdpzero.api import wrap
    from tests.engine_cases import batches, build_model, engine_losses, full_params
    offload_param = {"device": param_device, "pin_memory": True}
    if param_device == "nvme":
        offload_param.update(nvme_path=nvme_path, buffer_count=2, buffer_size=40_000, max_in_cpu=60_000)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "offload_param": offload_param, "sub_group_size": 20000,
                                 "stage3_param_persistence_threshold": 0,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3},
                                 "stage3_gather_16bit_weights_on_model_save": True},
           "aio": {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 1},
           "activation_checkpointing": {"contiguous_memory_optimization": False}}   # recompute inside backward
    engine = wrap(build_model("gpt2"), cfg)
    data = batches(4, 1, 2 * world)
    losses = engine_losses(engine, data[:2], rank, world)
    swapper = engine.grad_path.param_swapper
    if param_device == "nvme":
        assert sum(u.resident for u in swapper.units) <= 2 < len(swapper.units)
        assert any(not u.resident for u in swapper.units)
    engine.save_checkpoint(save_dir)
    assert not any(swapdir.is_swap_dir(p) for p in Path(save_dir).rglob("*")), "swap files in a checkpoint"
    losses += engine_losses(engine, data[2:], rank, world)
    again = None
    if param_device == "nvme":
        resumed = wrap(build_model("gpt2", seed=7), cfg)
        resumed.load_checkpoint(save_dir)
        again = engine_losses(resumed, data[2:], rank, world)
        assert sum(u.resident for u in resumed.grad_path.param_swapper.units) <= 2
    reads = []   # save_16bit_model reads each swapped shard on its own (read_shard): no unit comes back
    if param_device == "nvme":
        start_read = swapper._start_read
        swapper._start_read = lambda u: (reads.append(u), start_read(u))[1]
    engine.save_16bit_model(f"{save_dir}_16bit")
    assert not reads and (param_device != "nvme" or sum(u.resident for u in swapper.units) <= 2)
    exported = load_file(f"{save_dir}_16bit/model.safetensors") if rank == 0 else None
    return losses, again, full_params(engine.module), exported


@pytest.mark.slow
def test_ds_config_param_nvme_end_to_end(tmp_path):
    """`offload_param: {device: nvme}` + `offload_optimizer: nvme` in a ds_config through fsdpzero.wrap on 2 gloo
    ranks (GPT-2, 3 units, buffer_count 2, activation checkpointing): losses and final params equal `offload_param: cpu`
    bit for bit; a checkpoint (no swap files in it) resumes identically into a fresh param-NVMe engine; save_16bit_model
    exports the real weights, reading the swapped shards one by one (no unit is swapped back in for it)."""
    cpu = run_distributed(_engine_run, 2, "cpu", str(tmp_path), str(tmp_path / "ck_cpu"), timeout=300)
    ours = run_distributed(_engine_run, 2, "nvme", str(tmp_path), str(tmp_path / "ck_nvme"), timeout=300)
    for (l_cpu, _, p_cpu, x_cpu), (l_nvme, again, p_nvme, x_nvme) in zip(cpu, ours):
        assert l_cpu == l_nvme and l_nvme[0] != l_nvme[-1]
        assert again == l_nvme[2:]
        for k, v in p_cpu.items():
            assert torch.equal(v, p_nvme[k]), k
    x_cpu, x_nvme = cpu[0][3], ours[0][3]
    assert x_cpu.keys() == x_nvme.keys() and all(torch.equal(x_cpu[k], x_nvme[k]) for k in x_cpu)
    swapdir.remove_stale_swap_dirs(tmp_path)    # whatever a rank left (forked ranks may skip atexit) is stale now
    assert not (tmp_path / swapdir.SWAP_ROOT).exists()


def _hpz_run(rank, world, param_device, hpz, nvme_path):
    from fsdpzero.api import wrap
    from tests.engine_cases import batches, build_model, engine_losses, full_params
    offload_param = {"device": param_device}
    if param_device == "nvme":
        offload_param.update(nvme_path=nvme_path, buffer_count=2, buffer_size=40_000, max_in_cpu=60_000)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "offload_param": offload_param, "zero_hpz_partition_size": hpz,
                                 "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}}}
    engine = wrap(build_model("gpt2"), cfg)
    losses = engine_losses(engine, batches(3, 1, 2 * world), rank, world)
    swapped = engine.grad_path.param_swapper is not None and \
        any(not u.resident for u in engine.grad_path.param_swapper.units)
    return losses, full_params(engine.module), swapped


@pytest.mark.slow
def test_hpz_with_param_nvme_equals_param_cpu(tmp_path):
    """ZeRO++ hpZ (zero_hpz_partition_size 2: FSDP2 keeps a 1/2 copy after forward) with offload_param nvme on 4 gloo
    ranks: the same losses and params as offload_param cpu with hpZ, and as plain stage 3, bit for bit."""
    plain = run_distributed(_hpz_run, 4, "cpu", 1, str(tmp_path), timeout=300)
    cpu = run_distributed(_hpz_run, 4, "cpu", 2, str(tmp_path), timeout=300)
    ours = run_distributed(_hpz_run, 4, "nvme", 2, str(tmp_path), timeout=300)
    assert ours[0][2], "no unit was ever evicted: the test would not exercise the swapper"
    for (l_plain, p_plain, _), (l_cpu, p_cpu, _), (l_nvme, p_nvme, _) in zip(plain, cpu, ours):
        assert l_plain == l_cpu == l_nvme
        for k, v in p_plain.items():
            assert torch.equal(v, p_cpu[k]) and torch.equal(v, p_nvme[k]), k


# ------------------------------------------------------------------------------------------ bad settings

def _swapper_errors(rank, world, nvme_path):
    from fsdpzero.offload.param_swapper import ParamSwapper
    from fsdpzero.fsdp2_internals import fsdp_units
    from tests.offload.test_offload import _model
    model = _model(cpu_offload=True)                 # per rank: the root ~160 elements, 3 blocks ~1776 each
    errors = []
    for knobs in (dict(param_buffer_size=1000), dict(param_buffer_count=1), dict(max_in_cpu=3000)):
        try:
            ParamSwapper(fsdp_units(model), offload=OffloadPlan(param_nvme_path=nvme_path, **knobs))
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors, list(Path(nvme_path).iterdir())


def test_bad_buffer_settings_are_clear_errors(tmp_path):
    """Model-dependent limits fail when the swapper is built (before step 1, before any swap file), naming the key,
    the value and the value that works; values < 1 fail in the config layer, before any process group."""
    from fsdpzero.config import ConfigError
    from fsdpzero.plan.translate import build_plan
    from fsdpzero.plan import Env
    (errors, left), = run_distributed(_swapper_errors, 1, str(tmp_path), timeout=120)
    assert errors[0].startswith("offload_param.buffer_size=1000 is smaller than the largest FSDP unit's shard on "
                                "this rank (3552 elements): set buffer_size >= 3552"), errors[0]
    assert errors[1].startswith("offload_param.buffer_count=1: FSDP2 needs 2 units in CPU memory at once"), errors[1]
    assert errors[2].startswith("offload_param.max_in_cpu=3000: the unit in use and the 1 prefetched after it hold "
                                "up to 7104 elements on this rank; set max_in_cpu >= 7104"), errors[2]
    assert left == []
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0, "buffer_size": 0}}}
    with pytest.raises(ConfigError) as e:
        build_plan(cfg, Env())
    msg = str(e.value)
    assert "zero_optimization.offload_param.max_in_cpu: = 0: the NVMe parameter swapper needs at least 1" in msg
    assert "set zero_optimization.offload_param.buffer_size >= 1 (DeepSpeed's default: 100000000)" in msg


@pytest.mark.gpu
@pytest.mark.parametrize("opt_device", ["cpu", "nvme"])
def test_param_nvme_on_gpu_equals_param_cpu(tmp_path, opt_device, one_rank_nccl):
    """1 GPU, bf16 compute, CPUOffloadPolicy(pin_memory=True): offload_param nvme == cpu, bit for bit, with units
    evicted between uses (FSDP2 copies the shards H2D from memory we resize and refill). The swapper moves FSDP2's
    pinned shards to pageable storages and empties torch's pinned cache: afterwards the pinned allocator holds less
    than the shards (before, it held them twice: FSDP2's originals cached, plus pinned copies eviction never freed),
    and a load_state_dict keeps both of FSDP2's aliases of a shard on the one swapped storage. save_16bit_model
    (NCCL gathers of CPU shards) exports the final weights without swapping a unit back in."""
    from torch.distributed.device_mesh import init_device_mesh
    from safetensors.torch import load_file
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from fsdpzero.offload import build as offload
    from fsdpzero.checkpoint.export import save_16bit_model
    from tests.offload.test_offload import HYPER, Net, gpu_path_losses
    import gc
    runs = []
    for param_device in ("cpu", "nvme"):
        gc.collect()   # the pinned memory of the previous run's model is gone: `base` counts only what others hold
        base = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
        torch.manual_seed(0)
        model = Net(d=256, n=4).cuda()
        mesh = init_device_mesh("cuda", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=True))
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=True))
        plan = _plan(opt_device, param_device, str(tmp_path), "bfloat16", param_buffer_count=3,
                     max_in_cpu=1_000_000)           # blocks ~394k elements, 4 of them: 2 fit, evictions happen
        path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER))
        if param_device == "nvme":
            units = path.param_swapper.units
            assert not any(fp._sharded_param_data.is_pinned() for u in units for fp in u.shards if u.resident)
            held = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - base
            # with the optimizer on the CPU the fp32 masters are FSDP2's original shards, pinned here by the test's
            # CPUOffloadPolicy and alive as masters (8.4 MB held for 3.2 MB of shards on H200): the pinned-bytes
            # check holds only where nothing else pinned stays, i.e. with the optimizer on NVMe
            if not any(e.master.is_pinned() for e in path.entries):
                assert held < sum(sum(u.nbytes) for u in units), (held, base)
        # FSDP2's post-load hook must not re-pin into a copy (checked below); the load also refreshes the masters
        # from the bf16 shards, so both runs load, or their masters would differ
        model.load_state_dict(model.state_dict())
        if param_device == "nvme":
            for u in units:
                for fp in u.shards:
                    assert fp.sharded_param._local_tensor.untyped_storage()._cdata == \
                        fp._sharded_param_data.untyped_storage()._cdata

        def some_unit_evicted():
            assert param_device == "cpu" or any(not u.resident for u in path.param_swapper.units)
        losses = gpu_path_losses(model, path, after_step=some_unit_evicted)
        torch.cuda.synchronize()
        # the export gathers over NCCL from CPU shards: read one by one from the swap file (no unit comes back)
        reads, swapper = [], path.param_swapper
        if swapper is not None:
            start_read = swapper._start_read
            swapper._start_read = lambda u: (reads.append(u), start_read(u))[1]
        save_16bit_model(model, tmp_path / f"export_{param_device}", dtype=None, param_swapper=swapper)
        assert not reads
        path.close()
        params = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
        exported = load_file(tmp_path / f"export_{param_device}" / "model.safetensors")
        assert exported.keys() == params.keys() and all(torch.equal(exported[n], v) for n, v in params.items())
        runs.append((losses, params))
        path = model = None   # frees this run's pinned memory before the next run's baseline
    assert runs[0][0] == runs[1][0]
    for n, v in runs[0][1].items():
        assert torch.equal(v, runs[1][1][n]), n


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _evict_rss_run(rank, world, nvme_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from fsdpzero import fsdp2_internals as offload_fsdp
    from fsdpzero.offload import param_swapper as nvme_params
    from tests.offload.test_offload import Net
    torch.manual_seed(0)
    model = Net(d=1024, n=6)                  # blocks of 24 MiB (fp32): heap-sized pieces of 12 MiB
    mesh = init_device_mesh("cpu", (1,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    units = offload_fsdp.fsdp_units(model)
    units[0]._get_fsdp_state()._lazy_init()
    scratch = torch.ones(6 << 20)             # a freed 24 MiB temporary raises glibc's mmap threshold (any real
    del scratch                               # run has them): the shards below then live in the heap
    offload_fsdp.own_resizable_storages(units)
    pinned_down = [torch.ones(4096) for _ in range(16)]   # later small allocations: the heap cannot just shrink
    before = _rss_bytes()
    sw = nvme_params.ParamSwapper(units, offload=OffloadPlan(param_nvme_path=nvme_path, param_buffer_count=2,
                                                           max_in_cpu=10**9, param_buffer_size=10**8))
    dropped = before - _rss_bytes()
    evicted = sum(sum(u.nbytes) for u in sw.units if not u.resident)
    sw.close(restore=False)
    del pinned_down
    return dropped, evicted


@pytest.mark.timeout(120)
def test_evicted_units_leave_the_resident_set(tmp_path):
    """Evicting a unit must lower the process's RSS, not only free the storage into the allocator: with the shards
    in glibc's heap, freed chunks stay resident until malloc_trim (measured: RSS +13 MB after evicting 252 MB
    without it). The swapper must give back at least half of what it evicted."""
    [(dropped, evicted)] = run_distributed(_evict_rss_run, 1, str(tmp_path), timeout=110)
    assert evicted > 64 << 20
    assert dropped >= evicted // 2, (dropped, evicted)


def test_nvme_shards_are_created_pageable(tmp_path):
    """offload_param nvme: FSDP2 must not pin the shards even with pin_memory true (pinned blocks never leave torch's
    pinned cache, rounded up to powers of two: at setup they would add ~1.7x the shards to the host peak)."""
    import dataclasses
    from fsdpzero.sharding import offload_policy
    for device, pinned in (("nvme", False), ("cpu", True)):
        plan = _plan("nvme", device, str(tmp_path), "bfloat16")
        plan = dataclasses.replace(plan, offload=dataclasses.replace(plan.offload, pin_memory=True))
        assert offload_policy(plan, "cuda").pin_memory is pinned, device


def test_meta_models_materialise_offloaded_shards_on_the_cpu(tmp_path):
    """wrap() of a meta-device model with offload_param: FSDP2's CPUOffloadPolicy refuses shards materialised on
    the GPU ("FSDP parameters should be materialized on CPU"), so the shards go to the CPU and only the buffers to
    the compute device."""
    from fsdpzero.sharding import shard_home
    cuda = torch.device("cuda", 0)
    for device, home in (("nvme", "cpu"), ("cpu", "cpu"), ("none", "cuda:0")):
        plan = _plan("nvme", device, str(tmp_path), "bfloat16")
        assert shard_home(plan, cuda) == torch.device(home), device
