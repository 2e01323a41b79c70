"""fsdpzero.checkpoint.dcp on a plain fully_shard'ed GPT-2 + torch AdamW, 2 gloo ranks: exact resume, resharding,
async save, crash safety, completeness checks, rotation."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.multiprocessing.spawn import ProcessExitedException
from transformers import GPT2Config, GPT2LMHeadModel

from fsdpzero.checkpoint import dcp as ck
from tests.multirank import run_distributed

DATA = torch.randint(0, 64, (8, 4, 16), generator=torch.Generator().manual_seed(7))  # step, global batch, seq


def _build(world: int, seed: int, dropout: float):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps, rank, world) -> list[float]:
    losses = []
    for s in steps:
        batch = DATA[s].chunk(world)[rank]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _full_params(model) -> dict:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _state(model, opt, sched, counters):
    return {"train": ck.ModelOptimizer(model, opt), "scheduler": sched, "counters": counters}


def _save_job(rank, world, save_dir, dropout, async_save):
    model, opt, sched = _build(world, 0, dropout)
    _train(model, opt, sched, range(3), rank, world)
    counters = {"global_steps": 3, "data_position": 3 * DATA.shape[1]}
    pending = ck.save_checkpoint(save_dir, None, _state(model, opt, sched, counters), {"user": [1, 2]}, step=3,
                                 async_save=async_save)
    losses = _train(model, opt, sched, range(3, 6), rank, world)  # async: trains while the save writes
    if async_save:
        pending.result()
    return losses, _full_params(model)


def _resume_job(rank, world, save_dir, dropout):
    model, opt, sched = _build(world, 123, dropout)  # different init: everything must come from the checkpoint
    counters = {}
    path, client = ck.load_checkpoint(save_dir, None, _state(model, opt, sched, counters))
    assert path.name == "global_step3" and client == {"user": [1, 2]}
    assert counters == {"global_steps": 3, "data_position": 12}
    losses = _train(model, opt, sched, range(3, 6), rank, world)
    return losses, _full_params(model)


def test_exact_resume_two_ranks_with_dropout(tmp_path):
    """Per-rank RNG restored: with dropout on, 3 + save + fresh process group + 3 equals 6 straight, bit for bit."""
    ref_losses, ref_params = run_distributed(_save_job, 2, str(tmp_path), 0.1, False, timeout=120)[0]
    losses, params = run_distributed(_resume_job, 2, str(tmp_path), 0.1, timeout=120)[0]
    assert losses == ref_losses
    assert ref_params.keys() == params.keys()
    assert all(torch.equal(ref_params[k], params[k]) for k in ref_params)


def _save_before_first_step_job(rank, world, save_dir, save):
    model, opt, sched = _build(world, 0, 0.0)
    if save:   # torch builds the optimizer's state for the save by a zero-grad step at lr 0 (AdamW step -> 1)
        ck.save_checkpoint(save_dir, None, _state(model, opt, sched, {}), step=0)
    losses = _train(model, opt, sched, range(3), rank, world)
    return losses, _full_params(model)


def test_a_save_before_the_first_step_leaves_training_unchanged(tmp_path):
    """The lower-level ModelOptimizer, as the engine's path: the optimizer gets its empty state back after the
    save (before, AdamW's first update was taken at step 2's bias correction: weights 1e-3 apart after 3 steps)."""
    ref_losses, ref = run_distributed(_save_before_first_step_job, 1, str(tmp_path), False, timeout=120)[0]
    losses, got = run_distributed(_save_before_first_step_job, 1, str(tmp_path), True, timeout=120)[0]
    assert losses == ref_losses and all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (1, 2)])
def test_resharded_resume(tmp_path, save_world, load_world):
    ref_losses, ref_params = run_distributed(_save_job, save_world, str(tmp_path), 0.0, True, timeout=120)[0]
    assert (tmp_path / "global_step3" / ck.MANIFEST).is_file() and (tmp_path / "latest").read_text() == "global_step3"
    losses, params = run_distributed(_resume_job, load_world, str(tmp_path), 0.0, timeout=120)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=0, atol=1e-5)


def _crash_job(rank, world, save_dir, point):
    model, opt, sched = _build(world, 0, 0.0)
    _train(model, opt, sched, range(1), rank, world)
    ck.save_checkpoint(save_dir, None, _state(model, opt, sched, {"global_steps": 1}), step=1)
    full = _full_params(model)
    if rank == 0:
        torch.save(full, os.path.join(save_dir, "step1_params.pt"))
    _train(model, opt, sched, range(1, 2), rank, world)
    os.environ["FSDPZERO_CKPT_CRASH_AT"] = point
    ck.save_checkpoint(save_dir, None, _state(model, opt, sched, {"global_steps": 2}), step=2)
    return "not crashed"


def _load_latest_job(rank, world, save_dir):
    model, opt, sched = _build(world, 123, 0.0)
    counters = {}
    path, _ = ck.load_checkpoint(save_dir, None, _state(model, opt, sched, counters))
    return path.name, counters, _full_params(model)


@pytest.mark.parametrize("point", ["before_data", "mid_write", "before_rename", "before_latest"])
def test_crash_while_saving_leaves_previous_checkpoint_loadable(tmp_path, point):
    with pytest.raises((RuntimeError, ProcessExitedException)):  # the ranks are killed mid-save
        run_distributed(_crash_job, 2, str(tmp_path), point, timeout=120)
    name, counters, params = run_distributed(_load_latest_job, 1, str(tmp_path), timeout=60)[0]
    assert name == "global_step1" and counters == {"global_steps": 1}
    ref = torch.load(tmp_path / "step1_params.pt", weights_only=True)
    assert all(torch.equal(params[k], ref[k]) for k in ref)
    if point == "before_latest":  # the new checkpoint is complete, just not yet named by `latest`
        assert ck.checkpoint_problems(tmp_path / "global_step2") == []


def _rotation_job(rank, world, save_dir):
    model, opt, sched = _build(world, 0, 0.0)
    for step in range(1, 5):
        _train(model, opt, sched, range(step - 1, step), rank, world)
        ck.save_checkpoint(save_dir, None, _state(model, opt, sched, {"global_steps": step}), step=step,
                           keep_last=2)
    return sorted(p for p in os.listdir(save_dir) if not p.startswith("."))


def test_keep_last_rotation_and_completeness_check(tmp_path):
    kept = run_distributed(_rotation_job, 2, str(tmp_path), timeout=120)[0]
    assert kept == ["global_step3", "global_step4", "latest"]
    (tmp_path / "global_step4" / "__1_0.distcp").unlink()
    with pytest.raises(FileNotFoundError, match=r"incomplete:\n.*__1_0.distcp is missing"):
        ck.load_checkpoint(tmp_path, None, {})
    shutil.rmtree(tmp_path / "global_step3")
    (tmp_path / "global_step4" / ck.MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="save did not finish"):
        ck.load_checkpoint(tmp_path, "global_step4", {})
    state = json.loads(json.dumps({"a": 1}))
    with pytest.raises(TypeError, match=r"state/bad = object"):
        ck.save_checkpoint(tmp_path, "x", {"bad": object(), **state})
