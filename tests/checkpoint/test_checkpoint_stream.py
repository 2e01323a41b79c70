"""Checkpoints of NVMe-offloaded runs stream the on-disk optimizer state through DCP (fsdpzero.checkpoint.stream):
at most a few tensors of it are in host memory at once, saving and loading, and the files are the same as the
in-memory path's (a resharded load, then a save, gives back the same tensors)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdpzero.checkpoint import dcp as checkpoint
from fsdpzero.dist import local_tensor
from fsdpzero.offload import nvme_adam as nvme
from fsdpzero.offload import swapdir
from tests.multirank import run_distributed


def _cfg(nvme_path: str, streaming: bool = True) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "sub_group_size": 3000, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3}},
            "aio": {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 1}}


def _param_cfg(nvme_path: str, world: int) -> dict:
    cfg = _cfg(nvme_path)      # 2 units at most in memory (of 3: the root and 2 blocks)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2,
                                                 "buffer_size": 80_000 // world, "max_in_cpu": 120_000 // world}
    return cfg


def _recording(monkeypatch_target, name, seen):
    base = getattr(monkeypatch_target, name)

    class Recording(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self)
    setattr(monkeypatch_target, name, Recording)


def _entry_bytes(engine) -> list[int]:
    """Bytes of each on-disk state tensor of this rank: fp32, one per (param, segment)."""
    opt = engine.grad_path.optimizer
    return [4 * local_tensor(p).numel() for g in opt.param_groups for p in g["params"] for _ in nvme.state_segments(p)]


def _run(rank, world, nvme_path, save_dir, mode):
    from fsdpzero.api import wrap
    from tests.engine_cases import batches, build_model, engine_losses
    saves, loads = [], []
    _recording(checkpoint, "StreamingSavePlanner", saves)
    _recording(checkpoint, "StreamingLoadPlanner", loads)
    data = batches(4, 1, 2 * world)
    out = {"held": [0]}
    read_state, returned = nvme.NVMeAdam.read_state, []

    def read_and_track(self, p, key):
        # storage bytes of every state read so far that still holds its data (DCP keeps references to a file's
        # tensors until the file is closed: only released storages do not count)
        out["held"][0] = max(out["held"][0], sum(t.untyped_storage().nbytes() for t in returned))
        returned.append(read_state(self, p, key))
        return returned[-1]
    nvme.NVMeAdam.read_state = read_and_track
    if mode == "train":
        engine = wrap(build_model("gpt2"), _cfg(nvme_path))
        engine_losses(engine, data[:2], rank, world)
        engine.save_checkpoint(save_dir, tag="a")
        nvme.NVMeAdam.read_state = read_state                                  # measured: the streamed save
        engine.save_checkpoint(save_dir, tag="c", async_save=True).result()   # staged up front: read eagerly
        ref = engine.grad_path.state_dict()     # the in-memory path: every state read through NVMeAdam's pipeline
        out["ref"] = {f"state/train/optim/state/{name}/{k}": v.full_tensor() for name, st in ref["state"].items()
                      for k, v in st.items() if k != "step"}
        out["after"] = engine_losses(engine, data[2:], rank, world)
        resumed = wrap(build_model("gpt2", seed=7), _cfg(nvme_path))
        resumed.load_checkpoint(save_dir, tag="a")
        out["resumed"] = engine_losses(resumed, data[2:], rank, world)
    else:   # "reshard": load the 2-rank checkpoint on `world` ranks, save it again untouched
        resumed = engine = wrap(build_model("gpt2", seed=7), _cfg(nvme_path))
        resumed.load_checkpoint(save_dir, tag="a")
        resumed.save_checkpoint(save_dir, tag="b")
    sizes = _entry_bytes(engine)
    out["entries"] = (sum(sizes), max(sizes), len(sizes))
    out["save"] = [(p.bytes.total, p.bytes.peak) for p in saves]
    out["load"] = [(p.bytes.total, p.bytes.peak) for p in loads]
    return out


def _read_all(path: Path) -> dict:
    """Every tensor of a DCP checkpoint, whole, in this process."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    return sd


@pytest.mark.slow
def test_nvme_checkpoint_streams_and_reshards(tmp_path):
    """2 gloo ranks, stage 3, bf16, optimizer on NVMe (fp32 masters and moments on disk):
    - saving reads each rank's on-disk state (every master and moment) exactly once, with at most one tensor per
      DCP writer thread in memory; loading onto the same world size holds at most the largest tensor;
    - the saved states equal the in-memory path's (NVMeAdam.state_dict), and the resumed run continues bit for bit;
    - a load of that checkpoint onto 1 rank (entries filled from 2 pieces each), saved again, holds the same
      tensors as the original, bit for bit."""
    nvme_path, save_dir = str(tmp_path / "swap"), str(tmp_path / "ck")
    Path(nvme_path).mkdir()
    runs = run_distributed(_run, 2, nvme_path, save_dir, "train", timeout=240)
    for r in runs:
        total, largest, count = r["entries"]
        assert count > 20 and largest < total / 10
        assert r["after"] == r["resumed"]
        (s_total, s_peak), = r["save"]          # the async save does not stream
        assert s_total == total and s_peak <= checkpoint.writer_threads() * largest, (r["save"], r["entries"])
        assert r["held"][0] <= checkpoint.writer_threads() * largest, (r["held"], r["entries"])
        (l_total, l_peak), = r["load"]
        assert l_total == total and l_peak <= largest, (r["load"], r["entries"])
    one, = run_distributed(_run, 1, nvme_path, save_dir, "reshard", timeout=240)
    assert one["load"][0][0] == one["entries"][0] == sum(r["entries"][0] for r in runs)
    a, b = _read_all(Path(save_dir) / "a"), _read_all(Path(save_dir) / "b")
    optim = [k for k in a if "/optim/state/" in k]
    assert len(optim) > 60 and any(k.endswith("/master") for k in optim)
    assert sorted(a) == sorted(b) and set(runs[0]["ref"]) == set(optim) - {k for k in optim if k.endswith("/step")}
    for k, v in runs[0]["ref"].items():
        assert torch.equal(v, a[k]), k
    c = _read_all(Path(save_dir) / "c")
    assert all(torch.equal(c[k], a[k]) for k in optim)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
    swapdir.remove_stale_swap_dirs(nvme_path)


def _gpu_run(rank, world, nvme_path, save_dir, params):
    from fsdpzero.api import wrap
    from tests.engine_cases import batches, build_model, engine_losses
    data = batches(4, 1, 2 * world).cuda()
    cfg = _param_cfg(nvme_path, world) if params else _cfg(nvme_path)
    engine = wrap(build_model("gpt2"), cfg)
    engine_losses(engine, data[:2], rank, world)
    engine.save_checkpoint(save_dir, tag="a")
    after = engine_losses(engine, data[2:], rank, world)
    resumed = wrap(build_model("gpt2", seed=7), cfg)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    resumed.load_checkpoint(save_dir, tag="a")
    load_gpu_bytes = torch.cuda.max_memory_allocated() - base
    return after, engine_losses(resumed, data[2:], rank, world), load_gpu_bytes, sum(_entry_bytes(engine))


@pytest.mark.gpu
@pytest.mark.parametrize("params", [False, True])
def test_nvme_checkpoint_streams_on_gpu(tmp_path, params):
    """NCCL, bf16 shards on the GPUs (staged CPU stand-ins), optimizer on NVMe: the streamed save and load resume
    bit for bit, and the load takes no GPU memory for the on-disk states (DCP would allocate meta entries on the
    process group's device). params: offload_param nvme too (CPU shards swapped, 2 of 3 units in memory): the
    shards stream as well."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    world = min(2, torch.cuda.device_count())
    nvme_path = tmp_path / "swap"
    nvme_path.mkdir()
    for after, again, load_gpu_bytes, state_bytes in run_distributed(
            _gpu_run, world, str(nvme_path), str(tmp_path / "ck"), params, init_pg=False, timeout=300):
        assert after == again
        assert load_gpu_bytes < state_bytes / 2, (load_gpu_bytes, state_bytes)


def _param_run(rank, world, nvme_path, save_dir, shards, mode):
    import os

    from fsdpzero.api import wrap
    from tests.engine_cases import batches, build_model, engine_losses, full_params

    def model(seed):
        m = build_model("gpt2", seed=seed)
        return m.to(torch.bfloat16) if shards == "bfloat16" else m   # bf16 shards: separate fp32 masters on disk

    def resident(engine):
        return sum(u.resident for u in engine.grad_path.param_swapper.units)

    data, out = batches(4, 1, 2 * world), {}
    if mode == "train":
        engine = wrap(model(0), _param_cfg(nvme_path, world))
        swapper = engine.grad_path.param_swapper
        out["units"], out["budget"] = len(swapper.units), swapper.buffer_count
        engine_losses(engine, data[:2], rank, world)
        read_shard, seen = swapper.read_shard, []
        swapper.read_shard = lambda k, i: (seen.append(resident(engine)), read_shard(k, i))[1]
        engine.save_checkpoint(save_dir, tag="a")
        out["save_resident"] = max(seen + [resident(engine)])
        # the in-memory path: every unit brought back (the ckpt_stream knob, for this save)
        engine.save_checkpoint(save_dir, tag="ref", tuning=engine.tuning.replace(ckpt_stream=False))
        out["after"] = engine_losses(engine, data[2:], rank, world)
        out["params"] = full_params(engine.module)
        resumed = wrap(model(7), _param_cfg(nvme_path, world))
        resumed.load_checkpoint(save_dir, tag="a")
        out["load_resident"] = resident(resumed)
        out["resumed"] = engine_losses(resumed, data[2:], rank, world)
        out["resumed_params"] = full_params(resumed.module)
    else:   # "reshard": the 2-rank checkpoint onto `world` ranks, saved again untouched
        engine = wrap(model(7), _param_cfg(nvme_path, world))
        engine.load_checkpoint(save_dir, tag="a")
        out["load_resident"] = resident(engine)
        engine.save_checkpoint(save_dir, tag="b")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("shards", ["float32", "bfloat16"])
def test_param_nvme_checkpoint_streams_shards(tmp_path, shards):
    """2 gloo ranks, stage 3, offload_param and offload_optimizer on NVMe (3 FSDP units, at most 2 in memory):
    - a save and a load leave no more units in memory than buffer_count (the in-memory path brings all back);
    - the streamed save holds the same tensors, bit for bit, as the in-memory save of the same state;
    - the resumed run continues bit for bit (losses and final params);
    - a load onto 1 rank, saved again, gives back the same tensors.
    fp32 shards are their own masters (stepped in place); bf16 shards have fp32 masters on disk besides."""
    nvme_path, save_dir = str(tmp_path / "swap"), str(tmp_path / "ck")
    Path(nvme_path).mkdir()
    runs = run_distributed(_param_run, 2, nvme_path, save_dir, shards, "train", timeout=300)
    for r in runs:
        assert r["units"] > r["budget"]
        assert r["save_resident"] <= r["budget"] and r["load_resident"] <= r["budget"], r
        assert r["after"] == r["resumed"]
        assert all(torch.equal(v, r["resumed_params"][k]) for k, v in r["params"].items())
    a, ref = _read_all(Path(save_dir) / "a"), _read_all(Path(save_dir) / "ref")
    assert sorted(a) == sorted(ref) and any("/model/" in k for k in a) and any(k.endswith("/master") for k in a)
    for k, v in a.items():
        assert torch.equal(v, ref[k]), k
    one, = run_distributed(_param_run, 1, nvme_path, save_dir, shards, "reshard", timeout=300)
    assert one["load_resident"] <= 2
    b = _read_all(Path(save_dir) / "b")
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k
    swapdir.remove_stale_swap_dirs(nvme_path)
