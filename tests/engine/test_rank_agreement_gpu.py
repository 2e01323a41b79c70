"""GPU: the cross-rank agreement on NCCL. One rank's failure (a bad tag, a client_state value, a directory it cannot
create, a full disk, a damaged shard it re-hashes, a NaN loss, a different config) gives the same error (or the same
skipped step) on every rank, never a hang, and the collectives stay in step afterwards: the NCCL halves of
tests/engine/test_rank_agreement.py, tests/checkpoint/test_checkpoint_ranks.py and test_engine_nonfinite.py.

Two kinds of default group: NCCL alone, as Hugging Face Accelerate and a hand-written `init_process_group("nccl")`
create it (the agreement helpers then talk through CUDA tensors: fsdpzero.dist._comm_device, checkpoint/agree.py's
tag check), and `cuda:nccl,cpu:gloo`, as fsdpzero creates it. 2 and 4 ranks, one GPU each; all scenarios run one
after another in the same ranks, so each later one also proves the earlier left the process group usable. A hang
becomes a failure: the ranks' NCCL timeout is 60 s, the job's 300 s. Not part of CPU CI; run with

    pytest -m gpu tests/engine/test_rank_agreement_gpu.py -v
"""
from __future__ import annotations

import dataclasses
import os
import resource
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers  # noqa: F401  imported before the ranks start

pytestmark = pytest.mark.gpu
STATE_NUMEL = 131072   # per rank: each rank writes its own DCP data file


def _attempt(fn) -> str:
    """The error's class and text, "ok", or "unexpected ..." for anything that is not an agreed error."""
    from fsdpzero.dist import RanksError
    try:
        fn()
        return "ok"
    except (RanksError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    except BaseException as e:   # noqa: BLE001  reported, the test then fails on it
        return f"unexpected {type(e).__name__}: {e}"


def _device() -> str:
    """The ranks' GPU under NCCL; the CPU under gloo (the jobs then run on CPU too: a quick check of the test)."""
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


def _sharded_state(seed: int, world: int) -> dict:
    """A DTensor sharded over the ranks' GPUs (Shard(0)): a real FSDP-like state for DCP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(world, STATE_NUMEL, generator=g).to(_device())
    return {"w": {"x": distribute_tensor(full, init_device_mesh(_device(), (world,)), [Shard(0)])}}


def _in_step(rank: int) -> float:
    t = torch.tensor([rank + 1.0], device=_device())
    dist.all_reduce(t)
    return t.item()


def _scenarios(rank: int, world: int, root: str) -> dict:
    import fsdpzero
    from fsdpzero.checkpoint import dcp as ck
    from fsdpzero.dist import agree_on_error, agreed_errors, check_same_on_all_ranks
    from fsdpzero.plan import CheckpointPlan
    from tests.engine_cases import build_model, make_plan
    root, last, out = Path(root), world - 1, {}
    out["backend"] = str(dist.get_backend())
    # -- fsdpzero.dist: the helpers themselves
    out["one_fails"] = _attempt(lambda: agree_on_error(ValueError("bad value here") if rank == last else None))
    out["all_fail"] = _attempt(lambda: agree_on_error(f"disk full on rank {rank}"))
    out["none_fails"] = _attempt(lambda: agree_on_error(None))
    (root / "a_file").touch()

    def mkdir_under_a_file():
        with agreed_errors():
            if rank == 0:
                os.makedirs(root / "a_file" / "ckpt")   # NotADirectoryError on rank 0 only
    out["agreed_block"] = _attempt(mkdir_under_a_file)
    out["facts"] = _attempt(lambda: check_same_on_all_ranks({"a": "1", "b": str(rank == last)}, "settings"))
    # -- wrap: a different ZeRO stage on the last rank, refused before any collective could mismatch
    out["stage"] = _attempt(lambda: fsdpzero.wrap(build_model("llama"),
                                                  make_plan(stage=2 + (rank == last), world=world)))
    # -- DCP save/load of CUDA DTensors
    out["mkdir"] = _attempt(lambda: ck.save_checkpoint(root / "a_file", "t", _sharded_state(0, world)))
    mine = root / ("good" if rank != last else "a_file")     # only the last rank cannot write
    out["last_dir"] = _attempt(lambda: ck.save_checkpoint(mine, "t", _sharded_state(0, world)))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)   # a full disk on the last rank while DCP writes
    if rank == last:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    try:
        out["disk_full"] = _attempt(lambda: ck.save_checkpoint(root / "good", "t", _sharded_state(0, world)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["tmp_left"] = (root / "good" / ".tmp-t").exists()
    ck.save_checkpoint(root / "good", "t", _sharded_state(0, world))   # the retry works
    into = _sharded_state(1, world)
    ck.load_checkpoint(root / "good", "t", into)
    out["loaded"] = torch.equal(into["w"]["x"].full_tensor(), _sharded_state(0, world)["w"]["x"].full_tensor())
    dist.barrier()
    if rank == 0:   # damage the last rank's data file: only the rank that re-hashes it sees the damage
        f = root / "good" / "t" / f"__{last}_0.distcp"
        blob = bytearray(f.read_bytes())
        blob[len(blob) // 2] ^= 0x40
        f.write_bytes(bytes(blob))
    dist.barrier()
    out["damaged"] = _attempt(lambda: ck.load_checkpoint(root / "good", "t", _sharded_state(1, world)))
    # -- the Engine: one rank's bad tag / client_state, tag_validation=fail
    m = torch.nn.Linear(4, 4)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = fsdpzero.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    out["client"] = _attempt(lambda: engine.save_checkpoint(root / "ck", tag="x",
                                                            client_state={"obj": object() if rank == last else 1}))
    out["tag"] = _attempt(lambda: engine.save_checkpoint(root / "ck", tag="ok" if rank != last else "../bad"))
    engine.save_checkpoint(root / "ck", tag="good")
    out["saved"] = (root / "ck" / "good").is_dir()
    engine.destroy()
    plan = dataclasses.replace(make_plan(stage=3, world=world, micro=1),
                               checkpoint=CheckpointPlan(tag_validation="fail"))
    engine = fsdpzero.wrap(build_model("gpt2"), plan)
    out["tag_validation"] = _attempt(lambda: engine.save_checkpoint(root / "tv", tag=f"rank{rank}"))
    out["tv_written"] = (root / "tv").exists() and any((root / "tv").iterdir())
    engine.destroy()
    out["in_step"] = _in_step(rank)
    return out


NAN_CASES = {"z1": (1, False), "z2": (2, False), "z3": (3, False), "z3_sync": (3, True)}   # stage, sync verdict


def _nan_job(rank: int, world: int) -> dict:
    """fp32: rank 0's loss is NaN on step 1; every rank skips that step (weights kept bit for bit, skipped_steps 1
    right after step(), the scheduler held), with the deferred verdict (fused Adam on the GPU) or the synchronous
    one (FSDPZERO_SYNC_OVERFLOW_CHECK=1)."""
    import fsdpzero
    from fsdpzero.plan import SchedulerPlan
    from tests.engine_cases import batches, build_model, full_params, make_plan
    sched = SchedulerPlan(type="WarmupLR", params={"warmup_min_lr": 0.0, "warmup_max_lr": 5e-4,
                                                   "warmup_num_steps": 4, "warmup_type": "linear"})
    data = batches(4, 1, world)
    out = {}
    for name, (stage, sync) in NAN_CASES.items():
        if sync:
            os.environ["FSDPZERO_SYNC_OVERFLOW_CHECK"] = "1"
        else:
            os.environ.pop("FSDPZERO_SYNC_OVERFLOW_CHECK", None)
        plan = dataclasses.replace(make_plan(stage=stage, world=world, micro=1), scheduler=sched)
        engine = fsdpzero.wrap(build_model("llama"), plan)
        seen = []
        for i in range(4):
            x = data[i][0][rank:rank + 1].to(engine.device)
            loss = engine(input_ids=x, labels=x).loss
            if i == 1:
                before = full_params(engine.module)
                if rank == 0:
                    loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
            seen.append((engine.skipped_steps, engine.get_lr()[0]))
            if i == 1:
                after = full_params(engine.module)
        final = full_params(engine.module)
        out[name] = {"deferred": engine._defer_verdict, "seen": seen,
                     "kept": all(torch.equal(before[k], after[k]) for k in before),
                     "finite": all(bool(torch.isfinite(v).all()) for v in final.values()),
                     "digest": sum(float(v.double().sum()) for v in final.values())}
        engine.destroy()
    out["in_step"] = _in_step(rank)
    return out


def _need(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")


@pytest.mark.parametrize("world", [2, 4], ids=["2gpu", "4gpu"])
@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl,cpu:gloo"])
def test_one_ranks_error_is_every_ranks_error_on_nccl(tmp_path, backend, world):
    from tests.multirank import run_distributed
    _need(world)
    results = run_distributed(_scenarios, world, str(tmp_path), backend=backend, timeout=300)
    r0 = results[0]
    for key in r0:
        if key not in ("tmp_left", "tv_written"):
            assert all(r[key] == r0[key] for r in results), (key, [r[key] for r in results])   # same words
    assert all(not str(v).startswith("unexpected") for v in r0.values()), r0
    last = world - 1
    assert r0["backend"] == backend
    assert r0["one_fails"] == f"RanksValueError: ValueError: bad value here (on rank {last})", r0["one_fails"]
    assert r0["all_fail"].startswith(f"RanksError: {world} ranks failed:\n  rank 0: disk full on rank 0")
    assert r0["none_fails"] == "ok"
    assert r0["agreed_block"].startswith("RanksNotADirectoryError: NotADirectoryError")
    assert r0["agreed_block"].endswith("(on rank 0)")
    assert r0["facts"].startswith("RanksError: the ranks were started with different settings"), r0["facts"]
    assert r0["facts"].endswith(f"rank {last} has True") and "\n  b: rank" in r0["facts"], r0["facts"]
    assert "different configs or models" in r0["stage"] and "shard.stage" in r0["stage"], r0["stage"]
    assert "cannot write" in r0["mkdir"] and "(on rank 0)" in r0["mkdir"], r0["mkdir"]
    assert f"rng_{last}.safetensors" in r0["last_dir"] and f"(on rank {last})" in r0["last_dir"], r0["last_dir"]
    assert "File too large" in r0["disk_full"] and "removed" in r0["disk_full"], r0["disk_full"]
    assert not any(r["tmp_left"] for r in results) and all(r["loaded"] for r in results)
    assert f"__{last}_0.distcp does not match its checksum" in r0["damaged"], r0["damaged"]
    assert "client_state/obj" in r0["client"] and f"(on rank {last})" in r0["client"], r0["client"]
    assert "contains a path separator" in r0["tag"] and f"(on rank {last})" in r0["tag"], r0["tag"]
    assert r0["saved"]
    for rank, r in enumerate(results):   # DeepSpeed's FAIL: refused on every rank before anything is written
        assert r["tag_validation"].startswith("ValueError: checkpoint tag is not the same on every rank (rank 0 has")
        assert "tag_validation=FAIL" in r["tag_validation"]
    assert not any(r["tv_written"] for r in results)
    assert r0["in_step"] == world * (world + 1) / 2


@pytest.mark.parametrize("world", [2, 4], ids=["2gpu", "4gpu"])
@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl,cpu:gloo"])
def test_nan_on_one_rank_is_skipped_on_every_rank_on_nccl(backend, world):
    from tests.multirank import run_distributed
    _need(world)
    results = run_distributed(_nan_job, world, backend=backend, timeout=300)
    for name, (stage, sync) in NAN_CASES.items():
        r0 = results[0][name]
        assert r0["deferred"] is (not sync), name
        for r in (r[name] for r in results):
            assert [s for s, _ in r["seen"]] == [0, 1, 1, 1], (name, r["seen"])   # agreed right after the bad step
            assert r["kept"] and r["finite"], name
            assert r["digest"] == r0["digest"], name                              # the same weights on every rank
        lrs = [lr for _, lr in r0["seen"]]
        assert lrs[1] == lrs[0] and lrs[3] == 2 * lrs[2] > 0, (name, lrs)        # no scheduler step on the skip
    assert all(r["in_step"] == world * (world + 1) / 2 for r in results)
