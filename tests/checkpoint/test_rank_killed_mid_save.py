"""kill -9 of ONE rank while an engine saves (issue 31 item 2): the other ranks are left blocked in the save's
collectives (the launcher ends them, as torchrun does), and the directory still holds a loadable checkpoint: the
previous one when the victim died before writing its data, or the new one only if the save had committed it
complete. The same job on gloo (CPU) and on NCCL (2 GPUs, `pytest -m gpu`)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  imported before forking the ranks
from safetensors.torch import load_file, save_file
from torch.multiprocessing import ProcessExitedException

from fsdpzero.api import wrap
from fsdpzero.checkpoint.files import checkpoint_problems
from tests.engine_cases import batches, build_model, engine_losses, full_params, make_plan
from tests.multirank import run_distributed

VICTIM = 1
GLOBAL_MICRO = 4


def _engine(world, seed):
    return wrap(build_model("llama", seed=seed), make_plan(stage=3, world=world, micro=GLOBAL_MICRO // world))


def _data():
    return batches(4, 1, GLOBAL_MICRO).to("cuda" if torch.cuda.is_available() else "cpu")   # as wrap picks


def _kill_victim_at(point: str) -> None:
    """This rank dies by SIGKILL (no Python cleanup, no atexit) when its save reaches `point`."""
    import fsdpzero.checkpoint.dcp as dcp
    import fsdpzero.checkpoint.files as files

    def crash_point(name, crash_at):
        if name == point:
            os.kill(os.getpid(), signal.SIGKILL)
    dcp.crash_point = files.crash_point = crash_point


def _save_then_die(rank, world, save_dir, point):
    engine = _engine(world, 0)
    data = _data()
    for step in (1, 2):
        engine_losses(engine, data[step - 1:step], rank, world)
        params = full_params(engine.module)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in params.items()}, f"{save_dir}/../params_step{step}.safetensors")
        if step == 2 and rank == VICTIM:
            _kill_victim_at(point)
        engine.save_checkpoint(save_dir)
    return "not killed"


def _load(rank, world, save_dir):
    engine = _engine(world, 7)
    path, _ = engine.load_checkpoint(save_dir)
    return Path(path).name, engine.global_steps, full_params(engine.module)


def _check(tmp_path, point):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    with pytest.raises((RuntimeError, ProcessExitedException)):
        run_distributed(_save_then_die, 2, str(save_dir), point, init_pg=False, timeout=120)
    name, steps, params = run_distributed(_load, 2, str(save_dir), init_pg=False, timeout=120)[0]
    if point == "before_data":   # the victim wrote nothing of step 2: the save cannot have committed
        assert name == "global_step1" and steps == 1
    else:                        # the data was complete when it died: either tag is acceptable, loaded exactly
        assert name in ("global_step1", "global_step2") and steps == int(name.removeprefix("global_step"))
    ref = load_file(str(tmp_path / f"params_step{steps}.safetensors"))
    assert ref.keys() == params.keys()
    assert all(torch.equal(params[k].cpu(), ref[k].cpu()) for k in ref)
    assert checkpoint_problems(save_dir / name) == []


@pytest.mark.parametrize("point", ["before_data", "mid_write"])
def test_one_rank_killed_mid_save_leaves_a_loadable_checkpoint(tmp_path, point):
    if torch.cuda.is_available():
        pytest.skip("a CUDA host runs the NCCL case (pytest -m gpu)")
    _check(tmp_path, point)


@pytest.mark.gpu
@pytest.mark.parametrize("point", ["before_data", "mid_write"])
def test_one_rank_killed_mid_save_on_nccl(tmp_path, point):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check(tmp_path, point)   # wrap joins NCCL (with gloo for CPU tensors) where CUDA is available
