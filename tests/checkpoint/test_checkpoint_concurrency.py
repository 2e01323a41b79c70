"""What a save does to the directory around it (issue 32): two jobs saving the same tag at once, a tag that names a
directory or file fsdpzero did not write, `keep_last` after the clock steps back, and a full disk while `latest` is
written. Real files, real processes (the two "jobs" are two forked processes, each saving on its own, without a
process group), interleaved deterministically at the save's own fault-injection points (files.crash_point)."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.spawn import ProcessExitedException

from fsdpzero.checkpoint import dcp as ck
from fsdpzero.checkpoint import files
from fsdpzero.checkpoint.agree import CheckpointError
from tests.multirank import run_distributed


def _weights(seed: int) -> dict:
    return {"w": {"x": torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))}}


def _loaded(path: Path, tag: str) -> torch.Tensor:
    into = {"w": {"x": torch.zeros(64, 32)}}
    ck.load_checkpoint(path, tag, into)
    return into["w"]["x"]


def _wait(events: Path, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (events / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"event {name} never came")
        time.sleep(0.01)


def _pause_at(point: str, events: Path, me: str, until: str):
    """A crash_point stand-in: at `point`, announce it (<me>_at_<point>) and wait for `until`."""
    def hook(name: str, crash_at: str | None = None) -> None:
        if name == point:
            (events / f"{me}_at_{point}").touch()
            _wait(events, until)
    return hook


def _job(rank, world, save_dir, events, b_pause):
    """rank 0 = job A, rank 1 = job B, both saving tag "T" into save_dir. A writes its data and stops before
    finishing; B then starts and stops at `b_pause`; A finishes; then B finishes."""
    events = Path(events)
    me = "AB"[rank]
    if rank == 0:
        hook = _pause_at("mid_write", events, "A", "B_at_" + b_pause)
    else:
        _wait(events, "A_at_mid_write")
        hook = _pause_at(b_pause, events, "B", "A_done")
    files.crash_point = ck.crash_point = hook
    try:
        ck.save_checkpoint(save_dir, "T", _weights(10 + rank))
        result = "ok"
    except CheckpointError as e:
        result = f"CheckpointError: {e}"
    except BaseException as e:   # anything else is a failure of the test, reported as such
        result = f"unexpected {type(e).__name__}: {e}"
    if me == "A":
        (events / "A_done").touch()
    return result


@pytest.mark.parametrize("existing", [False, True], ids=["new_tag", "resaved_tag"])
@pytest.mark.parametrize("b_pause", ["before_data", "mid_write"])
def test_two_jobs_saving_one_tag(tmp_path, existing, b_pause):
    """Whatever the interleaving, every success reported is true (the tag holds that job's weights), the loser gets
    a clear error, `latest` names a complete checkpoint, and no temp dir of either job is left behind. On the old
    fixed `.tmp-<tag>` both jobs wrote into one directory: A reported success over B's weights, or committed B's
    half-written directory (no .metadata) over the good checkpoint that was there."""
    save_dir, events = tmp_path / "ck", tmp_path / "events"
    events.mkdir()
    if existing:
        ck.save_checkpoint(save_dir, "T", _weights(1))
    a, b = run_distributed(_job, 2, str(save_dir), str(events), b_pause, init_pg=False, timeout=120)
    assert [a, b].count("ok") == 1, (a, b)   # one commit wins, the other finds the tag changed under it
    winner, loser = (0, b) if a == "ok" else (1, a)
    assert loser.startswith("CheckpointError: ") and "another save" in loser and "nothing saved" in loser, loser
    assert "\n" not in loser
    assert ck.checkpoint_problems(save_dir / "T") == []
    assert (save_dir / "latest").read_text() == "T"
    assert torch.equal(_loaded(save_dir, None), _weights(10 + winner)["w"]["x"])
    assert sorted(p.name for p in save_dir.iterdir() if p.name not in (".fsdpzero.lock",)) == ["T", "latest"]


def test_a_job_killed_mid_save_leaves_a_temp_dir_the_next_save_removes(tmp_path):
    """Unique temp names must not pile up after crashes: a temp dir whose saving process is gone is removed by the
    next save of that tag (one whose owner still runs is left alone: the test above)."""
    save_dir = tmp_path / "ck"
    with pytest.raises((RuntimeError, ProcessExitedException)):   # the process is killed mid-save
        run_distributed(_killed_job, 1, str(save_dir), init_pg=False, timeout=60)
    left = [p.name for p in save_dir.iterdir() if p.name.startswith(".tmp-T")]
    assert len(left) == 1, left
    ck.save_checkpoint(save_dir, "T", _weights(3))
    assert not [p.name for p in save_dir.iterdir() if p.name.startswith(".tmp-")]
    assert torch.equal(_loaded(save_dir, "T"), _weights(3)["w"]["x"])


def test_a_save_of_any_tag_removes_abandoned_temp_dirs_of_every_tag(tmp_path):
    """A save killed mid-write (its temp dir left as the killed job above leaves it, nobody holding its lock), then
    saves of other tags only: the abandoned .tmp-<tag>.<token> and a cut-short keep_last removal's .del-<tag> are
    removed by the next save whatever its tag; a temp dir whose owner still holds its lock is left alone (liveness
    from the lock, not the tag) (issue 32 F9)."""
    save_dir = tmp_path / "ck"
    ck.save_checkpoint(save_dir, "global_step1", _weights(1))
    dead = save_dir / ".tmp-global_step1.0123456789abcdef"
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"x" * 100)
    (save_dir / ".del-global_step0").mkdir()
    (save_dir / ".del-global_step0" / "__0_0.distcp").write_bytes(b"x")
    live = save_dir / ".tmp-global_step9.fedcba9876543210"
    live.mkdir()
    fd = files.hold(live)   # another save in progress
    try:
        ck.save_checkpoint(save_dir, "global_step2", _weights(2))
        assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith(".") and p.name != files.LOCK_FILE) \
            == [live.name]
    finally:
        os.close(fd)
    assert torch.equal(_loaded(save_dir, None), _weights(2)["w"]["x"])


def _killed_job(rank, world, save_dir):
    os.environ["FSDPZERO_CKPT_CRASH_AT"] = "mid_write"
    ck.save_checkpoint(save_dir, "T", _weights(2))


# ---- a tag that names something fsdpzero did not write ------------------------------------------------------------

def _user_files(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_saving_into_a_directory_of_the_users_keeps_their_files(tmp_path):
    """DeepSpeed writes into an existing <save_dir>/<tag>/ and leaves other files alone; so does fsdpzero, on the
    first save and on a re-save of the tag (the old code moved the directory aside and deleted it)."""
    tag_dir = tmp_path / "T"
    (tag_dir / "logs").mkdir(parents=True)
    (tag_dir / "config.json").write_text('{"model_type": "gpt2"}')
    (tag_dir / "tokenizer.json").write_text("{}")
    (tag_dir / "logs" / "train.log").write_text("step 1\n")
    mine = _user_files(tag_dir)
    ck.save_checkpoint(tmp_path, "T", _weights(1))
    assert {k: v for k, v in _user_files(tag_dir).items() if k in mine} == mine
    assert ck.checkpoint_problems(tag_dir) == [] and torch.equal(_loaded(tmp_path, "T"), _weights(1)["w"]["x"])
    ck.save_checkpoint(tmp_path, "T", _weights(2))   # a re-save of a checkpoint that has the user's files in it
    assert {k: v for k, v in _user_files(tag_dir).items() if k in mine} == mine
    assert ck.checkpoint_problems(tag_dir) == [] and torch.equal(_loaded(tmp_path, "T"), _weights(2)["w"]["x"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_a_tag_that_names_a_file_or_holds_a_clashing_file_is_refused_before_writing(tmp_path):
    (tmp_path / "notes").write_text("my notes")
    before = _user_files(tmp_path)
    with pytest.raises(CheckpointError, match=r"notes is a file.*nothing saved"):
        ck.save_checkpoint(tmp_path, "notes", _weights(1))
    assert _user_files(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["notes"]
    (tmp_path / "T").mkdir()
    (tmp_path / "T" / "state.json").write_text("the user's own state.json")
    before = _user_files(tmp_path)
    with pytest.raises(CheckpointError, match=r"T/state.json was not written by fsdpzero"):
        ck.save_checkpoint(tmp_path, "T", _weights(1))
    assert _user_files(tmp_path) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ---- keep_last orders by step ------------------------------------------------------------------------------------

def test_keep_last_orders_by_step_not_by_the_clock(tmp_path, monkeypatch):
    """The clock steps back an hour before every save: the two highest steps are kept, not the two oldest
    timestamps (the old code deleted each new checkpoint)."""
    clock = [time.time_ns()]

    def stepping_back() -> int:
        clock[0] -= 3600 * 10**9
        return clock[0]
    monkeypatch.setattr(time, "time_ns", stepping_back)
    for step in range(1, 6):
        ck.save_checkpoint(tmp_path, None, _weights(step), step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        ["global_step4", "global_step5", "latest"]
    assert torch.equal(_loaded(tmp_path, None), _weights(5)["w"]["x"])


def test_keep_last_that_cannot_remove_an_old_checkpoint_still_reports_the_save(tmp_path, monkeypatch, caplog):
    """Rotation fails after the commit (NFS: a file of the old checkpoint held open by another process, EBUSY):
    the new save is committed and reported so, with a warning naming what was not removed; the half-removed
    checkpoint is never taken as a complete one (issue 32 F2)."""
    import shutil
    ck.save_checkpoint(tmp_path, None, _weights(1), step=1, keep_last=1)
    real = shutil.rmtree

    def busy(p, *a, **k):
        if "global_step1" in Path(p).name and not k.get("ignore_errors"):
            (Path(p) / "state.json").unlink()   # rmtree got part of the way
            raise OSError(errno.EBUSY, "Device or resource busy", str(Path(p) / ".nfs000000000001"))
        return real(p, *a, **k)
    monkeypatch.setattr(files.shutil, "rmtree", busy)
    with caplog.at_level("WARNING", logger="fsdpzero"):
        ck.save_checkpoint(tmp_path, None, _weights(2), step=2, keep_last=1)   # no error: the save went through
    assert "global_step1" in caplog.text and "was not removed" in caplog.text
    assert files.read_latest(tmp_path) == "global_step2" and not ck.checkpoint_problems(tmp_path / "global_step2")
    assert not (tmp_path / "global_step1").exists()   # no half checkpoint under its tag: set aside, hidden
    assert torch.equal(_loaded(tmp_path, None), _weights(2)["w"]["x"])


def test_keep_last_with_an_unreadable_latest_still_saves(tmp_path):
    """`latest` that is not a tag (hand-edited) while save_latest=False: rotation protects what it can read; the
    save is committed and reported so (issue 32 F2)."""
    ck.save_checkpoint(tmp_path, None, _weights(1), step=1)
    (tmp_path / "latest").write_text("../elsewhere")
    ck.save_checkpoint(tmp_path, None, _weights(2), step=2, keep_last=1, save_latest=False)
    assert not ck.checkpoint_problems(tmp_path / "global_step2") and not (tmp_path / "global_step1").exists()
    assert torch.equal(_loaded(tmp_path, "global_step2"), _weights(2)["w"]["x"])


# ---- a full disk while `latest` is written -------------------------------------------------------------------

def test_no_space_for_latest_reports_the_saved_tag_truthfully(tmp_path, monkeypatch):
    """ENOSPC when `latest` is written (reported at its fsync, as ext4 and NFS do): the tag is complete, the error
    says so and that `latest` still names the previous one, and no `.latest.tmp` is left."""
    ck.save_checkpoint(tmp_path, "one", _weights(1))
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("latest.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointError) as raised:
        ck.save_checkpoint(tmp_path, "two", _weights(2))
    monkeypatch.setattr(os, "fsync", real_fsync)
    message = str(raised.value)
    assert "two" in message and "was saved" in message and "not updated" in message and "'one'" in message, message
    assert "nothing saved" not in message and "No space left on device" in message, message
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".tmp-")]
    assert (tmp_path / "latest").read_text() == "one"
    assert ck.checkpoint_problems(tmp_path / "two") == []
    assert torch.equal(_loaded(tmp_path, "two"), _weights(2)["w"]["x"])


def test_a_first_save_cut_short_while_moving_into_the_users_directory_does_not_stick_the_tag(tmp_path, monkeypatch):
    """<tag>/ holds only the user's files and no checkpoint yet; the commit dies after the first file moved in
    (the process killed: here the move raises, and no cleanup of <tag>/ runs). The next save of the tag must
    finish, keeping the user's files; the old code refused every later save (".metadata was not written by
    fsdpzero") (issue 32 F10)."""
    (tmp_path / "T").mkdir()
    (tmp_path / "T" / "config.json").write_text("{}")
    real_replace, moved = os.replace, []

    def replace(src, dst, *args, **kwargs):
        if Path(dst).parent == tmp_path / "T" and \
                not Path(src).name.startswith("."):
            moved.append(Path(dst).name)
            if len(moved) == 2:
                raise KeyboardInterrupt("killed")   # not an OSError: nothing tidies T up
        return real_replace(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(BaseException):
        ck.save_checkpoint(tmp_path, "T", _weights(1))
    monkeypatch.setattr(os, "replace", real_replace)
    assert moved[0] in os.listdir(tmp_path / "T") and not (tmp_path / "T" / files.MANIFEST).exists()
    ck.save_checkpoint(tmp_path, "T", _weights(2))
    assert torch.equal(_loaded(tmp_path, "T"), _weights(2)["w"]["x"])
    assert (tmp_path / "T" / "config.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path / "T")) == sorted([*files.read_manifest(tmp_path / "T")["files"],
                                                          files.MANIFEST, "config.json"])


def _killed_while_moving_in(rank, world, save_dir):
    """Re-save tag T, whose directory holds the user's files, and die as the new manifest is moved in (the last
    step of the commit, after every data file has replaced the previous checkpoint's)."""
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst) == Path(save_dir) / "T" / files.MANIFEST:
            os._exit(17)
        return real_replace(src, dst, *args, **kwargs)
    os.replace = replace
    ck.save_checkpoint(save_dir, "T", _weights(2))


def test_a_save_killed_while_moving_into_the_users_directory_leaves_the_previous_checkpoint(tmp_path):
    """Moving files into a directory of the user's is not one rename: until the new manifest is in, the previous
    checkpoint is kept whole in .old-T (hard links) and a load uses it; the next save of T finishes the job."""
    (tmp_path / "T").mkdir()
    (tmp_path / "T" / "config.json").write_text("{}")
    ck.save_checkpoint(tmp_path, "T", _weights(1))
    with pytest.raises((RuntimeError, ProcessExitedException)):
        run_distributed(_killed_while_moving_in, 1, str(tmp_path), init_pg=False, timeout=60)
    assert not (tmp_path / "T" / files.MANIFEST).exists()   # the kill came where it was meant to
    assert torch.equal(_loaded(tmp_path, None), _weights(1)["w"]["x"])
    ck.save_checkpoint(tmp_path, "T", _weights(3))
    assert torch.equal(_loaded(tmp_path, None), _weights(3)["w"]["x"])
    assert (tmp_path / "T" / "config.json").read_text() == "{}" and ck.checkpoint_problems(tmp_path / "T") == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def _two_rank_save(rank, world, save_dir):
    ck.save_checkpoint(save_dir, "T", _weights(4))


def test_a_resave_on_fewer_ranks_into_the_users_directory_removes_only_its_own_old_files(tmp_path):
    """Saved on 2 ranks into a directory of the user's, then re-saved on 1: rank 1's data and RNG files are the
    previous checkpoint's (its manifest lists them) and go; the user's files stay."""
    (tmp_path / "T").mkdir()
    (tmp_path / "T" / "README.md").write_text("mine")
    run_distributed(_two_rank_save, 2, str(tmp_path), timeout=60)
    assert {"__1_0.distcp", "rng_1.safetensors"} <= set(os.listdir(tmp_path / "T"))
    ck.save_checkpoint(tmp_path, "T", _weights(5))
    left = set(os.listdir(tmp_path / "T"))
    assert "__1_0.distcp" not in left and "rng_1.safetensors" not in left and "README.md" in left
    assert left == set(files.read_manifest(tmp_path / "T")["files"]) | {files.MANIFEST, "README.md"}
    assert torch.equal(_loaded(tmp_path, "T"), _weights(5)["w"]["x"])


# ---- converting one DeepSpeed checkpoint from several jobs at once (engine.load_checkpoint's conversion) ----------

_DS_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "deepspeed_ckpts"


class _LoadingEngine:
    """What fsdpzero.checkpoint.engine_state.from_deepspeed asks of an engine (no process group: each job one
    process, as three single-GPU sweep jobs are)."""

    def __init__(self):
        import types

        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(5)
        self.module = GPT2LMHeadModel(GPT2Config.from_pretrained(_DS_ASSETS))
        self.module.transformer.wpe.weight.requires_grad_(False)
        self.plan = types.SimpleNamespace(checkpoint=types.SimpleNamespace(load_universal=False))
        from fsdpzero.tuning import resolve
        self.tuning = resolve()   # as wrap builds an engine's settings, once (the ckpt_convert_dir knob)


def _converting_job(ds, start, results, i):
    from fsdpzero.checkpoint import convert
    from fsdpzero.checkpoint.engine_state import from_deepspeed
    real = convert.deepspeed_to_ours

    def slow(*a, **k):   # each job's conversion overlaps the others'
        time.sleep(0.3)
        out = real(*a, **k)
        time.sleep(0.3)
        return out
    convert.deepspeed_to_ours = slow
    engine = _LoadingEngine()
    start.wait()
    try:
        out, tag = from_deepspeed(engine, Path(ds), None)
        ck.verify_checkpoint(out / tag, distributed=False)
        results.put((i, f"ok {out}"))
    except BaseException as e:
        results.put((i, f"{type(e).__name__}: {e}"))


def test_jobs_converting_one_deepspeed_checkpoint_at_once_all_load_it(tmp_path, monkeypatch):
    """Three jobs load one DeepSpeed checkpoint at once (a sweep): each converts into its own temp dir and the
    first to finish publishes by rename under the root's lock; none deletes or writes into another's copy. With the
    old code each rmtree'd the shared copy and converted into it (FileNotFoundError, or a commit refused). A
    writable source gets the copy beside it, as multi-node runs need (issue 32 F7)."""
    import multiprocessing
    import shutil
    ds = tmp_path / "ds"
    shutil.copytree(_DS_ASSETS / "z2_fp32", ds)
    monkeypatch.delenv("FSDPZERO_CKPT_CONVERT_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(3), ctx.Queue()
    jobs = [ctx.Process(target=_converting_job, args=(str(ds), start, results, i)) for i in range(3)]
    for j in jobs:
        j.start()
    got = dict(results.get(timeout=240) for _ in jobs)
    for j in jobs:
        j.join(timeout=60)
    assert got == {i: f"ok {ds / '.fsdpzero-global_step3'}" for i in range(3)}, got
    assert sorted(p.name for p in ds.iterdir() if p.name.startswith(".")) == \
        [".fsdpzero-convert.lock", ".fsdpzero-global_step3"]   # no temp dir left behind


def test_an_unwritable_conversion_cache_names_the_knob(tmp_path, monkeypatch):
    """A read-only DeepSpeed source and a cache root that cannot be made: the error names the ckpt_convert_dir knob
    (FSDPZERO_CKPT_CONVERT_DIR) as the fix (issue 32 F7)."""
    import shutil

    from fsdpzero.checkpoint.engine_state import from_deepspeed
    ds = tmp_path / "ds"
    shutil.copytree(_DS_ASSETS / "z2_fp32", ds)
    for p in [*ds.rglob("*"), ds]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    (tmp_path / "xdg").write_text("a file, not a directory")
    monkeypatch.delenv("FSDPZERO_CKPT_CONVERT_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        with pytest.raises(CheckpointError, match="FSDPZERO_CKPT_CONVERT_DIR \\(knob ckpt_convert_dir\\)"):
            from_deepspeed(_LoadingEngine(), ds, None)
        assert not [p for p in ds.iterdir() if p.name.startswith(".")]   # nothing beside the read-only source
    finally:
        for p in [*ds.rglob("*"), ds]:
            p.chmod(0o755 if p.is_dir() else 0o644)


def test_a_wait_on_another_jobs_lock_is_said_with_its_holder(tmp_path, monkeypatch, caplog):
    """A save that waits on the directory's lock says so (after LOCK_REPORT_S), naming the holder from the lock
    file, and goes on once the holder lets go; the holder's pid is written when a lock is taken."""
    import fcntl
    import logging
    import os
    import threading
    import time
    from fsdpzero.checkpoint import files
    monkeypatch.setattr(files, "LOCK_REPORT_S", 0.2)
    with files.locked(tmp_path):
        pass
    assert (tmp_path / files.LOCK_FILE).read_text() == f"pid {os.getpid()} on {__import__('socket').gethostname()}"
    holder = os.open(tmp_path / files.LOCK_FILE, os.O_RDWR)     # another open file description: another "job"
    fcntl.flock(holder, fcntl.LOCK_EX)
    os.ftruncate(holder, 0)
    os.pwrite(holder, b"pid 4242 on elsewhere", 0)
    got, lock = [], files.locked(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fsdpzero"):
        t = threading.Thread(target=lambda: got.append(lock.__enter__() or "held"))
        t.start()
        time.sleep(0.6)
        assert not got and t.is_alive()                                # still waiting: the lock is held
        fcntl.flock(holder, fcntl.LOCK_UN)
        t.join(10)
    os.close(holder)
    assert got and not t.is_alive()
    lock.__exit__(None, None, None)
    said = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert len(said) == 1 and "held by another job (pid 4242 on elsewhere)" in said[0], said
