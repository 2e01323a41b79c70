"""Loads that every rank agrees on and that never reinterpret a tensor (issue 32): `latest` read once and shared,
a checkpoint seen by some ranks only, a tensor saved in another shape (GPT-2's Conv1D against a Linear of the same
names) at every stage, DCP's own load failures as fsdpzero's error, and a damaged state.json. 2 gloo ranks."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers  # noqa: F401  imported before forking the ranks

from fsdpzero.checkpoint import dcp as ck
from fsdpzero.checkpoint import files
from fsdpzero.checkpoint.agree import CheckpointError
from tests.multirank import run_distributed


def _attempt(fn) -> str:
    try:
        out = fn()
        return f"ok {out}"
    except CheckpointError as e:
        return f"CheckpointError: {e}"
    except BaseException as e:   # anything else is a failure of the test, reported as such
        return f"unexpected {type(e).__name__}: {e}"


def _linear_engine():
    import fsdpzero
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = fsdpzero.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    return engine


def _step(engine, rank):
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * engine.global_steps + rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _weight(engine) -> torch.Tensor:
    from tests.engine_cases import full_params
    return full_params(engine.module)["weight"]


def _latest_job(rank, world, root):
    root = Path(root)
    engine = _linear_engine()
    saved = {}
    for tag in ("s1", "s2"):
        _step(engine, rank)
        engine.save_checkpoint(root / "run", tag=tag)
        saved[tag] = _weight(engine)
    out = {}
    # `latest` moves from s1 to s2 (another job saving into the directory) after rank 0 has read it and before rank
    # 1 would: the ranks must still load one checkpoint. The hooks fire in the old code and the new alike: rank 0
    # flips `latest` when it starts checking the checkpoint; rank 1, if it reads `latest` itself, reads after that.
    (root / "run" / "latest").write_text("s1")
    flipped = root / "flipped"
    real_read, real_problems = files.read_latest, ck.checkpoint_problems

    def rank1_read_latest(*args, **kwargs):
        import time
        deadline = time.monotonic() + 30
        while not flipped.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_read(*args, **kwargs)

    def rank0_problems(path):
        if not flipped.exists():
            files.write_atomic(root / "run" / "latest", "s2")
            flipped.touch()
        return real_problems(path)
    if rank == 0:
        ck.checkpoint_problems = rank0_problems
    else:
        files.read_latest = rank1_read_latest
    fresh = _linear_engine()
    path, _ = fresh.load_checkpoint(root / "run")
    files.read_latest, ck.checkpoint_problems = real_read, real_problems
    out["flip"] = (Path(path).name, fresh.global_steps, torch.equal(_weight(fresh), saved[Path(path).name]))
    dist.barrier()
    # the checkpoint directory is there for rank 0 only (storage that is not shared): an error on both, no hang
    mine = root / ("run" if rank == 0 else "elsewhere")
    mine.mkdir(exist_ok=True)
    out["visible"] = _attempt(lambda: _linear_engine().load_checkpoint(mine)[0])
    # a flipped byte in state.json ('{' -> 'z': no longer JSON): the checksum is checked before it is parsed
    dist.barrier()
    if rank == 0:
        f = root / "run" / "s1" / "state.json"
        blob = bytearray(f.read_bytes())
        blob[0] ^= 0x01
        f.write_bytes(bytes(blob))
    dist.barrier()
    out["state_json"] = _attempt(lambda: _linear_engine().load_checkpoint(root / "run", tag="s1")[0])
    dist.barrier()
    out["resaved"] = _attempt(lambda: _load_while_rank1_sees_a_resave(rank, root / "run", "s2"))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["in_step"] = t.item()
    return out


def _load_while_rank1_sees_a_resave(rank, run: Path, tag: str):
    """Another job re-saves `tag` after rank 0 has checked, after its last read, that it still loads the checkpoint
    it verified, and before rank 1 checks: rank 0 alone would report success (issue 32 F1). The swap is a re-save
    as a commit makes it: a new directory renamed into place."""
    import shutil
    import time
    engine = _linear_engine()
    real_replaced, real_json = ck.replaced, ck.read_saved_json
    checks = [0]

    def rank0_replaced(path, manifest):
        result = real_replaced(path, manifest)
        checks[0] += 1
        (run.parent / f"rank0_checked{checks[0]}").touch()
        return result

    def rank1_json(path, name):
        if name == "client_state.json":   # the last read; rank 0 is past its own check
            deadline = time.monotonic() + 60
            while not (run.parent / "rank0_checked2").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            shutil.copytree(run / tag, run.parent / "resaved")
            os.rename(run / tag, run.parent / "previous")
            os.rename(run.parent / "resaved", run / tag)
        return real_json(path, name)
    if rank == 0:
        ck.replaced = rank0_replaced
    else:
        ck.read_saved_json = rank1_json
    try:
        return engine.load_checkpoint(run, tag=tag)[0]
    finally:
        ck.replaced, ck.read_saved_json = real_replaced, real_json


def test_ranks_agree_on_latest_and_refuse_what_only_some_see(tmp_path):
    r0, r1 = run_distributed(_latest_job, 2, str(tmp_path), timeout=240)
    assert r0["flip"] == r1["flip"] == ("s1", 1, True), (r0["flip"], r1["flip"])
    for key in ("visible", "state_json"):
        assert r0[key] == r1[key] and r0[key].startswith("CheckpointError: "), (key, r0[key], r1[key])
        assert "\n" not in r0[key]
    assert "s2 (named by" in r0["visible"] and "not on rank 1" in r0["visible"], r0["visible"]
    assert "state.json does not match its checksum" in r0["state_json"], r0["state_json"]
    assert r0["resaved"] == r1["resaved"] and "was replaced while it was being loaded" in r0["resaved"], \
        (r0["resaved"], r1["resaved"])
    assert r0["in_step"] == r1["in_step"] == 3.0


# ---- shapes --------------------------------------------------------------------------------------------------

OFFLOAD_CPU = "offload"


def _gpt2_engine(stage, world, linear: bool):
    from transformers.pytorch_utils import Conv1D

    from fsdpzero.api import wrap
    from fsdpzero.plan import OffloadPlan
    from tests.engine_cases import build_model, make_plan
    model = build_model("gpt2")
    if linear:   # the same names, each weight transposed: Conv1D keeps (in, out), Linear (out, in)
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, Conv1D):
                    setattr(module, name, torch.nn.Linear(*child.weight.shape))
    plan = make_plan(stage=3 if stage == OFFLOAD_CPU else stage, world=world)
    if stage == OFFLOAD_CPU:
        plan = dataclasses.replace(plan, offload=OffloadPlan(optimizer_device="cpu"))
    return wrap(model, plan)


def _shapes_job(rank, world, root, pairs):
    from tests.engine_cases import batches, engine_losses
    out = {}
    for saved_stage, loaded_stage in pairs:
        d = f"{root}/{saved_stage}"
        if not Path(d, "latest").exists():
            engine = _gpt2_engine(saved_stage, world, linear=False)
            engine_losses(engine, batches(1, 1, 4), rank, world)   # optimizer state exists too
            engine.save_checkpoint(d)
            dist.barrier()
        live = _gpt2_engine(loaded_stage, world, linear=True)
        out[f"{saved_stage}->{loaded_stage}"] = _attempt(lambda: live.load_checkpoint(d)[0])
    return out


@pytest.mark.parametrize("pairs", [[(0, 0), (1, 1), (2, 2)], [(3, 3), (OFFLOAD_CPU, OFFLOAD_CPU), (1, 3), (3, 1)]],
                         ids=["stages012", "stage3_offload_cross"])
def test_a_transposed_weight_of_the_same_size_is_refused_at_every_stage(tmp_path, pairs):
    """GPT-2 saved with its Conv1D weights (in, out), loaded into the same model with nn.Linear (out, in) of the
    same names: the same number of elements, so the old cross-layout path read each whole and reshaped it into the
    transposed parameter. Refused, naming the tensor and both shapes, as torch's load_state_dict does."""
    r0, r1 = run_distributed(_shapes_job, 2, str(tmp_path), pairs, timeout=300)
    for case, message in r0.items():
        assert message == r1[case] and message.startswith("CheckpointError: "), (case, message)
        assert "\n" not in message
        assert "size mismatch for transformer.h.0.attn.c_attn.weight" in message, (case, message)
        assert "torch.Size([64, 192]) from checkpoint" in message and "torch.Size([192, 64])" in message, message


# ---- DCP's own load failures -----------------------------------------------------------------------------------

def test_dcp_load_failures_are_fsdpzeros_error(tmp_path, monkeypatch):
    """A size mismatch, and a data file that vanishes after the checks and before DCP reads it: torch raises its
    CheckpointException, a BaseException that `except Exception` misses; fsdpzero raises CheckpointError."""
    ck.save_checkpoint(tmp_path, "t", {"w": {"x": torch.ones(4, 8), "y": torch.ones(3)}})
    with pytest.raises(CheckpointError, match=r"size mismatch for w/y: copying a param with shape torch.Size\(\[3\]\) "
                                              r"from checkpoint, the shape in current model is torch.Size\(\[5\]\)"):
        ck.load_checkpoint(tmp_path, "t", {"w": {"x": torch.zeros(4, 8), "y": torch.zeros(5)}})
    real = ck.read_dcp_metadata

    def vanishing(path, *args, **kwargs):
        md = real(path, *args, **kwargs)
        for f in Path(path).glob("*.distcp"):
            f.unlink()
        return md
    monkeypatch.setattr(ck, "read_dcp_metadata", vanishing)
    with pytest.raises(CheckpointError, match=r"loading checkpoint .*t failed: .*No such file") as raised:
        ck.load_checkpoint(tmp_path, "t", {"w": {"x": torch.zeros(4, 8), "y": torch.zeros(3)}})
    assert isinstance(raised.value, Exception)


# ---- read-only sources -----------------------------------------------------------------------------------------

def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(d.rglob("*"))}


def test_a_checkpoint_on_a_read_only_mount_loads_and_is_left_as_it_was(tmp_path):
    """A load writes nothing into the checkpoint's directory (the save directory's lock and temp dirs are the
    save's): it loads from a read-only mount (a tmpfs remounted read-only where this machine allows mounting, else
    the files made read-only), and the tree is unchanged after it."""
    import shutil
    import subprocess
    ck.save_checkpoint(tmp_path / "src", None, {"w": {"x": torch.arange(12.0)}}, step=3)
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(ro)],
                             capture_output=True).returncode == 0
    try:
        shutil.copytree(tmp_path / "src", ro, dirs_exist_ok=True)
        if not mounted or subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True).returncode:
            for p in [*ro.rglob("*"), ro]:
                p.chmod(0o555 if p.is_dir() else 0o444)
        before = _tree(ro)
        into = {"w": {"x": torch.zeros(12)}}
        path, _ = ck.load_checkpoint(ro, None, into)
        assert path.name == "global_step3" and torch.equal(into["w"]["x"], torch.arange(12.0))
        assert _tree(ro) == before
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], capture_output=True)


def _save_v(save_dir, v: int) -> None:
    ck.save_checkpoint(save_dir, "T", {"w": {"x": torch.full((64, 32), float(v)), "step": v}}, {"v": v},
                       no_dist=True)


@pytest.mark.parametrize("window", ["after_verify", "during_checksums"])
@pytest.mark.parametrize("users_file", [False, True], ids=["renamed_into_place", "moved_into_users_dir"])
def test_a_load_while_another_job_resaves_the_tag_is_refused_as_replaced(tmp_path, monkeypatch, window, users_file):
    """Another job re-saves tag T while a load of T runs: the load's files are read by path after the swap (a new
    directory renamed into place, or the files of a directory of the user's replaced one by one), so its tensors,
    state.json and client_state would come from two saves. It must fail as "replaced", never load a mix, never say
    the checkpoint is damaged (issue 32 F1)."""
    if users_file:
        (tmp_path / "T").mkdir()
        (tmp_path / "T" / "notes.txt").write_text("mine")
    _save_v(tmp_path, 1)
    if window == "after_verify":   # between the checks and DCP's tensor reads
        real = ck.read_dcp_metadata

        def racing(path, *a, **k):
            out = real(path, *a, **k)
            _save_v(tmp_path, 2)
            return out
        monkeypatch.setattr(ck, "read_dcp_metadata", racing)
    else:                          # while verify re-hashes the files the manifest it read lists
        real = ck.checksum_problems

        def racing(path, *a, **k):
            _save_v(tmp_path, 2)
            return real(path, *a, **k)
        monkeypatch.setattr(ck, "checksum_problems", racing)
    into = {"w": {"x": torch.zeros(64, 32), "step": 0}}
    with pytest.raises(CheckpointError, match="was replaced while it was being loaded") as e:
        ck.load_checkpoint(tmp_path, "T", into)
    assert "damaged" not in str(e.value) and "corrupt" not in str(e.value)
    monkeypatch.undo()   # once the other save is done, the tag loads whole: save 2's tensors, state and client
    _, client = ck.load_checkpoint(tmp_path, "T", into)
    assert client == {"v": 2} and into["w"]["step"] == 2 and into["w"]["x"].unique().tolist() == [2.0]
    if users_file:
        assert (tmp_path / "T" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("then", ["data_files_vanish", "tag_resaved"])
def test_fsdpzero_convert_of_a_checkpoint_changing_under_it_is_one_line(tmp_path, monkeypatch, capsys, then):
    """`fsdpzero convert` (dcp_to_safetensors) of one of our checkpoints while another job's keep_last removes its
    data files, or another job re-saves its tag: one line, exit 2, never torch's CheckpointException (a
    BaseException) escaping, never a silent export mixing two saves (issue 32 F6)."""
    from fsdpzero.checkpoint import convert
    from fsdpzero.cli import main

    def save():
        ck.save_checkpoint(tmp_path, "M", {"m": ck.ModelOptimizer(torch.nn.Linear(64, 32))}, no_dist=True)
    save()
    real = convert._sizes_within_data

    def then_change(path, meta, keys):   # after the checks, before the tensors are read
        real(path, meta, keys)
        if then == "data_files_vanish":
            for f in path.glob("*.distcp"):
                f.unlink()
        else:
            save()
    monkeypatch.setattr(convert, "_sizes_within_data", then_change)
    assert main(["convert", str(tmp_path), "--tag", "M", "--to", "safetensors", "--out", str(tmp_path / "o")]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "UserWarning" not in line
           and "return func(" not in line]   # torch's warnings of the in-process re-save, when not captured
    assert len(err) == 1 and err[0].startswith("fsdpzero convert: error: "), err
    if then == "tag_resaved":
        assert "was replaced while it was being loaded" in err[0], err
