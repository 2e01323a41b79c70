"""What a checkpoint directory can make fsdpzero do (issue 22): nothing runs from a planted DCP index on any load path,
a flipped bit fails the load, tags and `latest` stay inside the save dir, a checkpoint of another model is an error.

The planted `.metadata` is a pickle whose __reduce__ calls os.system to write a marker file; the attacker also
rewrites the manifest (sizes, checksums) so the completeness checks pass: only the allowlisted reader stands in the
way. Every path must leave no marker and raise one line naming the file.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  imported before forking the ranks

from fsdpzero.checkpoint import dcp as ck
from fsdpzero.checkpoint.agree import CheckpointError
from fsdpzero.checkpoint.stream import streamed
from fsdpzero.checkpoint.trust import UnsafeCheckpointError, read_dcp_metadata
from tests.multirank import run_distributed

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "deepspeed_ckpts"


class _Evil:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _fix_manifest(tag_dir: Path) -> None:
    """What an attacker who can write the directory does: the manifest made to match the planted files."""
    m = json.loads((tag_dir / ck.MANIFEST).read_text())
    for name in m["files"]:
        data = (tag_dir / name).read_bytes()
        m["files"][name] = len(data)
        m.setdefault("checksums", {})[name] = f"crc32:{zlib.crc32(data):08x}"
    (tag_dir / ck.MANIFEST).write_text(json.dumps(m))


def _plant(tag_dir: Path, marker: Path) -> None:
    (tag_dir / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    _fix_manifest(tag_dir)


def _one_line(e: BaseException, *needles: str) -> None:
    text = str(e)
    assert "\n" not in text, text
    for n in needles:
        assert n in text, (n, text)


def _small_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": {"a": torch.randn(64, 32, generator=g), "b": torch.randn(100, generator=g)}}


# ---- 1. the DCP index is read through the allowlisted unpickler on every load path ------------------------------

def test_allowlisted_reader_reads_a_real_index_and_refuses_a_planted_one(tmp_path):
    ck.save_checkpoint(tmp_path, "t", _small_state(), save_rng=False)
    md = read_dcp_metadata(tmp_path / "t")
    assert sorted(md.state_dict_metadata) == ["state/w/a", "state/w/b"]
    marker = tmp_path / "pwned"
    _plant(tmp_path / "t", marker)
    with pytest.raises(UnsafeCheckpointError) as e:
        ck.load_checkpoint(tmp_path, None, _small_state(1))
    _one_line(e.value, str(tmp_path / "t" / ".metadata"), "refused to unpickle", "system")
    # torch's own reader would have run it: the plant is live (the reason for all this)
    import torch.distributed.checkpoint as dcp
    assert not marker.exists()
    with contextlib.suppress(Exception):   # it then fails on what os.system returned; the code has run
        dcp.FileSystemReader(str(tmp_path / "t")).read_metadata()
    assert marker.exists()


def test_streamed_load_uses_the_allowlisted_reader(tmp_path):
    """The NVMe path's streamed entries (StreamingLoadPlanner) load through the same reader."""
    held = {"x": torch.arange(6, dtype=torch.float32)}

    def entry():
        return streamed(torch.empty(6), (6,), torch.float32, read=lambda: held["x"].clone(),
                        write=lambda t: held.__setitem__("x", t.clone()))
    ck.save_checkpoint(tmp_path, "s", {"opt": {"m": entry()}}, save_rng=False)
    held["x"] = torch.zeros(6)
    ck.load_checkpoint(tmp_path, "s", {"opt": {"m": entry()}})
    assert torch.equal(held["x"], torch.arange(6, dtype=torch.float32))   # the streamed load works...
    marker = tmp_path / "pwned"
    _plant(tmp_path / "s", marker)
    with pytest.raises(UnsafeCheckpointError) as e:                        # ...and refuses a planted index
        ck.load_checkpoint(tmp_path, "s", {"opt": {"m": entry()}})
    _one_line(e.value, ".metadata", "refused to unpickle")
    assert not marker.exists()


def test_a_tensor_entry_marked_as_pickled_bytes_is_refused(tmp_path):
    """A valid index (allowlisted classes only) that marks a tensor as a bytes entry would make DCP unpickle the data
    file with weights_only=False; that entry is refused before any data is read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    ck.save_checkpoint(tmp_path, "t", _small_state(), save_rng=False)
    tag_dir, marker = tmp_path / "t", tmp_path / "pwned"
    md = read_dcp_metadata(tag_dir)
    md.state_dict_metadata["state/w/a"] = BytesStorageMetadata()
    for index, info in md.storage_data.items():
        if index.fqn == "state/w/a":
            data = pickle.dumps(_Evil(marker))
            path = tag_dir / info.relative_path
            blob = path.read_bytes()
            path.write_bytes(blob[:info.offset] + data + blob[info.offset + len(data):])
            info.length = len(data)
    (tag_dir / ".metadata").write_bytes(pickle.dumps(md))
    _fix_manifest(tag_dir)
    with pytest.raises(UnsafeCheckpointError) as e:
        ck.load_checkpoint(tmp_path, "t", _small_state(1))
    _one_line(e.value, "state/w/a", "not a tensor")
    assert not marker.exists()


def test_fsdpzero_convert_refuses_a_planted_index(tmp_path, capsys):
    from fsdpzero.cli import main as cli
    ck.save_checkpoint(tmp_path / "run", None, {"train": {"model": {"w": torch.ones(3)}}}, step=1, save_rng=False)
    assert cli(["convert", str(tmp_path / "run"), "--to", "safetensors", "--out", str(tmp_path / "ok")]) == 0
    marker = tmp_path / "pwned"
    _plant(tmp_path / "run" / "global_step1", marker)
    for to in ("safetensors", "fp32"):
        capsys.readouterr()
        assert cli(["convert", str(tmp_path / "run"), "--to", to, "--out", str(tmp_path / to)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "refused to unpickle" in err[0] and ".metadata" in err[0], err
    assert not marker.exists()


def _engine_paths_job(rank, world, root):
    """One rank, every Engine load path against planted files; returns what each raised."""
    from fsdpzero.api import wrap
    from tests.engine_cases import batches, build_model, engine_losses, make_plan
    root = Path(root)
    marker = root / "pwned"
    plan = make_plan(stage=2, world=1, micro=2)
    engine = wrap(build_model("gpt2"), plan)
    engine_losses(engine, batches(1, 1, 2), rank, world)
    engine.save_checkpoint(root / "run")                      # global_step1
    out = {}
    try:
        engine.save_checkpoint(root / "run", tag="latest")
    except ValueError as e:
        out["save_latest"] = str(e)
    engine.save_checkpoint(root / "run", tag="global_step2")  # the dir still works after the refused tag
    out["after"] = (root / "run" / "latest").read_text()
    _plant(root / "run" / "global_step2", marker)
    for name, kwargs in (("load", {}), ("weights_only", {"load_module_only": True}),
                         ("no_optimizer", {"load_optimizer_states": False})):
        try:
            wrap(build_model("gpt2", seed=3), plan).load_checkpoint(root / "run", **kwargs)
            out[name] = "loaded"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    # `latest` pointing at another directory (holding the planted checkpoint)
    shutil.copytree(root / "run", root / "other")
    (root / "run" / "latest").write_text("../other/global_step2")
    for name, latest in (("latest_outside", "../other/global_step2"), ("latest_absolute",
                                                                       str(root / "other" / "global_step2"))):
        (root / "run" / "latest").write_text(latest)
        try:
            wrap(build_model("gpt2", seed=3), plan).load_checkpoint(root / "run")
            out[name] = "loaded"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    # a DeepSpeed checkpoint with a planted conversion cache: without our stamp it is rebuilt, not trusted
    from transformers import GPT2Config, GPT2LMHeadModel
    ds = root / "ds"
    shutil.copytree(ASSETS / "z2_fp32", ds)
    from fsdpzero.checkpoint.convert import conversion_dir
    cache = conversion_dir(ds / "global_step3")   # the ckpt_convert_dir knob (set by the test)
    cache.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(root / "run", cache)
    shutil.rmtree(cache / "global_step1")
    (cache / "global_step2").rename(cache / "global_step3")
    (cache / "latest").write_text("global_step3")

    def ds_engine():
        torch.manual_seed(5)
        model = GPT2LMHeadModel(GPT2Config.from_pretrained(ASSETS))
        model.transformer.wpe.weight.requires_grad_(False)
        return wrap(model, json.loads((ASSETS / "record.json").read_text())["variants"]["z2_fp32"]["config"])
    path, _ = ds_engine().load_checkpoint(ds)
    out["ds_cache_rebuilt"] = str(path)
    # a cache planted with a forged stamp is loaded like any checkpoint: the index is refused, nothing runs
    _plant(cache / "global_step3", marker)
    try:
        ds_engine().load_checkpoint(ds)
        out["ds_cache_forged"] = "loaded"
    except Exception as e:
        out["ds_cache_forged"] = f"{type(e).__name__}: {e}"
    out["marker"] = marker.exists()
    return out


@pytest.mark.slow
def test_no_engine_load_path_runs_a_planted_index(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPZERO_CKPT_CONVERT_DIR", str(tmp_path / "convert-cache"))
    out = run_distributed(_engine_paths_job, 1, str(tmp_path), timeout=240)[0]
    assert not out["marker"] and not (tmp_path / "pwned").exists()
    assert "reserved name" in out["save_latest"] and out["after"] == "global_step2"
    for name in ("load", "weights_only", "no_optimizer", "ds_cache_forged"):
        assert out[name].startswith("UnsafeCheckpointError: ") and "refused to unpickle" in out[name], out[name]
        assert "\n" not in out[name]
    for name in ("latest_outside", "latest_absolute"):
        assert out[name].startswith("ValueError: ") and "path separator" in out[name], out[name]
    assert out["ds_cache_rebuilt"].endswith("global_step3")


# ---- 2. checksums -------------------------------------------------------------------------------------------

def _flip_exponent(tag_dir: Path, values: torch.Tensor) -> Path:
    """Set the top exponent bit of one float32 of `values` where it sits in a .distcp file (same size)."""
    needle = values.contiguous().numpy().tobytes()[:64]
    for f in sorted(tag_dir.glob("*.distcp")):
        blob = bytearray(f.read_bytes())
        at = blob.find(needle)
        if at >= 0:
            blob[at + 3] ^= 0x40   # little-endian float32: byte 3 holds the sign and the top exponent bits
            f.write_bytes(bytes(blob))
            return f
    raise AssertionError("tensor bytes not found")


def test_flipped_exponent_bits_fail_the_load_naming_the_file(tmp_path):
    saved = _small_state()
    ck.save_checkpoint(tmp_path, "t", saved, save_rng=False)
    manifest = json.loads((tmp_path / "t" / ck.MANIFEST).read_text())
    assert set(manifest["checksums"]) == set(manifest["files"])   # every file, data and JSON alike
    before = {f.name: f.stat().st_size for f in (tmp_path / "t").iterdir()}
    bad = _flip_exponent(tmp_path / "t", saved["w"]["a"])
    assert {f.name: f.stat().st_size for f in (tmp_path / "t").iterdir()} == before   # sizes still match
    with pytest.raises(CheckpointError) as e:
        ck.load_checkpoint(tmp_path, "t", _small_state(1))
    _one_line(e.value, str(bad), "checksum")
    # a checkpoint from before checksums (no "checksums" key) still loads; nothing then catches the flip
    del manifest["checksums"]
    (tmp_path / "t" / ck.MANIFEST).write_text(json.dumps(manifest))
    into = _small_state(1)
    ck.load_checkpoint(tmp_path, "t", into)
    a = into["w"]["a"]
    assert not bool(torch.isfinite(a).all() and a.abs().max() < 1e30)   # a value blown up to inf/NaN/1e38
    assert torch.equal(into["w"]["b"], saved["w"]["b"])


# ---- 3. tags and `latest` ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["latest", " step1", "step1 ", "step1\n", "a\tb", "../x", "a/b", "/abs/x", ".tmp-x",
                                 ".fsdpzero-global_step1", "", ".", "..", ck.MANIFEST])
def test_bad_tags_are_refused_before_anything_is_written(tmp_path, tag):
    with pytest.raises(ValueError, match="plain directory name"):
        ck.save_checkpoint(tmp_path / "run", tag, _small_state(), save_rng=False)
    assert not (tmp_path / "run").exists()


def test_latest_is_checked_like_a_tag(tmp_path):
    ck.save_checkpoint(tmp_path / "other", "global_step2", _small_state(2), save_rng=False)
    ck.save_checkpoint(tmp_path / "run", "global_step1", _small_state(1), save_rng=False)
    for bad in ("../other/global_step2", str(tmp_path / "other" / "global_step2"), " global_step1", "..",
                "global_step1\n\n"):
        (tmp_path / "run" / "latest").write_text(bad)
        with pytest.raises(ValueError, match=r"the tag in .*latest"):
            ck.load_checkpoint(tmp_path / "run", None, _small_state(3))
    (tmp_path / "run" / "latest").write_text("global_step1\n")   # a hand-written file's newline is fine
    into = _small_state(3)
    path, _ = ck.load_checkpoint(tmp_path / "run", None, into)
    assert path == tmp_path / "run" / "global_step1" and torch.equal(into["w"]["a"], _small_state(1)["w"]["a"])


# ---- 4. strict loads ---------------------------------------------------------------------------------------

def _mlp(layers: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_a_checkpoint_of_another_model_is_an_error_unless_partial(tmp_path):
    four, opt4 = _mlp(4, 0)
    ck.save_checkpoint(tmp_path, "four", {"train": ck.ModelOptimizer(four, opt4)}, save_rng=False)
    two, opt2 = _mlp(2, 1)
    with pytest.raises(CheckpointError) as e:
        ck.load_checkpoint(tmp_path, "four", {"train": ck.ModelOptimizer(two, opt2)})
    _one_line(e.value, "does not match the model", "4 key(s) in it are not in the model", "2.weight", "strict=False")
    ck.save_checkpoint(tmp_path, "two", {"train": ck.ModelOptimizer(two, opt2)}, save_rng=False)
    with pytest.raises(CheckpointError, match=r"4 key\(s\) of the model are not in it \(2\.weight"):
        ck.load_checkpoint(tmp_path, "two", {"train": ck.ModelOptimizer(*_mlp(4, 2))})
    ck.load_checkpoint(tmp_path, "four", {"train": ck.ModelOptimizer(two, opt2)}, strict=False)
    assert all(torch.equal(two[i].weight, four[i].weight) for i in range(2))


# ---- found by review: class-level BUILD, symlinked tag directories, the `.old-<tag>` copy through the engine -----

def test_a_planted_index_cannot_set_attributes_on_an_allowlisted_class(tmp_path):
    """BUILD on a class object (not an instance) would rewrite that class for the whole process, e.g.
    pathlib.PosixPath.is_file, which the checkpoint checks themselves rely on."""
    def g(mod, name):
        return b"c" + mod.encode() + b"\n" + name.encode() + b"\n"
    payload = (b"\x80\x02" + g("pathlib", "PosixPath") + b"N}X" + (7).to_bytes(4, "little") + b"is_file"
               + g("torch.distributed.checkpoint.metadata", "StorageMeta") + b"s\x86b0"
               + g("torch.distributed.checkpoint.metadata", "Metadata") + b"}\x85R.")
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(UnsafeCheckpointError, match="refused to set state on") as info:
        read_dcp_metadata(tmp_path)
    _one_line(info.value, ".metadata")
    assert Path("/nonexistent").is_file() is False


def test_a_tag_directory_that_is_a_symlink_is_refused(tmp_path):
    ck.save_checkpoint(tmp_path / "outside", "global_step2", _small_state(2), save_rng=False)
    ck.save_checkpoint(tmp_path / "run", "global_step1", _small_state(1), save_rng=False)
    (tmp_path / "run" / "global_step9").symlink_to(tmp_path / "outside" / "global_step2")
    (tmp_path / "run" / "latest").write_text("global_step9")
    for tag in (None, "global_step9"):
        with pytest.raises(ValueError, match="is a symbolic link"):
            ck.load_checkpoint(tmp_path / "run", tag, _small_state(3))


def _engine_loads_the_old_copy(rank, world, save_dir):
    import fsdpzero
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = fsdpzero.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(save_dir, tag="t1")
    want = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}
    os.rename(Path(save_dir) / "t1", Path(save_dir) / ".old-t1")   # a crash between a re-save's two renames
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    path, _ = engine.load_checkpoint(save_dir)
    got = {k: v.full_tensor() for k, v in engine.module.state_dict().items()}
    return path.name, all(torch.equal(want[k], got[k]) for k in want)


def test_engine_load_falls_back_to_the_copy_a_crashed_resave_left(tmp_path):
    [(name, same)] = run_distributed(_engine_loads_the_old_copy, 1, str(tmp_path / "ck"), timeout=120)
    assert name == ".old-t1" and same


# ---- issue 32 item 5: state-setting on shared objects, unbounded construction -----------------------------------

def _index_with(tmp_path: Path, ops: bytes) -> Path:
    """A real `.metadata` (written by a save) with `ops` run just before its STOP, the Metadata staying on top of the
    stack: the file still reads as a valid index. The save's FRAME is dropped so the new opcodes stand outside it."""
    ck.save_checkpoint(tmp_path, "t", _small_state(), save_rng=False)
    path = tmp_path / "t" / ".metadata"
    data = path.read_bytes()
    assert data[2:3] == pickle.FRAME and data.endswith(pickle.STOP)
    path.write_bytes(data[:2] + data[11:-1] + ops + pickle.STOP)
    return tmp_path / "t"


def _glob(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _unicode(text: str) -> bytes:
    return pickle.BINUNICODE + len(text).to_bytes(4, "little") + text.encode()


def test_a_planted_index_cannot_set_state_on_an_enum_singleton(tmp_path):
    """Ten opcodes added to a real index: REDUCE fetches the shared member
    _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT (an enum lookup), BUILD sets its _value_. Allowed, that poisoned the
    process: every later DCP save wrote contiguous tensors under another encoding. Refused before BUILD runs; the
    enum is unchanged and a later save and load in this process round-trip."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    saved = dict(member.__dict__)
    ops = (_glob("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING") + pickle.BININT1 + b"\x00"
           + pickle.TUPLE1 + pickle.REDUCE + pickle.EMPTY_DICT + _unicode("_value_") + pickle.BININT1 + b"\x02"
           + pickle.SETITEM + pickle.BUILD + pickle.POP)
    tag = _index_with(tmp_path / "a", ops)
    try:
        with pytest.raises(UnsafeCheckpointError, match="refused to set state on") as info:
            read_dcp_metadata(tag)
        _one_line(info.value, str(tag / ".metadata"))
        assert member.value == 0 and member.__dict__ == saved
        # no process poisoning: a later save and load are exact
        ck.save_checkpoint(tmp_path / "b", "t", _small_state(3), save_rng=False)
        back = _small_state(4)
        ck.load_checkpoint(tmp_path / "b", "t", back)
        assert all(torch.equal(back["w"][k], _small_state(3)["w"][k]) for k in ("a", "b"))
        md = read_dcp_metadata(tmp_path / "b" / "t")
        assert md.state_dict_metadata["state/w/a"].properties.memory_format == torch.contiguous_format
    finally:   # on code that let it through, do not leave the rest of the test run poisoned
        member.__dict__.clear()
        member.__dict__.update(saved)


def test_a_tiny_index_cannot_make_large_objects(tmp_path):
    """`str(bytes(N))` in a 44-byte file: builtins reachable from the index made ~1 GB for N = 2**28. DCP's metadata
    never names a builtin (protocol 4 has opcodes for its containers); the first one is refused, before any call."""
    n = 1 << 24   # 16 MiB (and a 64 MiB str) on code that allowed it: small enough for a test machine
    payload = (b"\x80\x02" + _glob("builtins", "str") + _glob("builtins", "bytes") + pickle.BININT
               + n.to_bytes(4, "little") + pickle.TUPLE1 + pickle.REDUCE + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    assert len(payload) <= 44
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(UnsafeCheckpointError, match="refused to unpickle builtins.str") as info:
        read_dcp_metadata(tmp_path)
    _one_line(info.value, ".metadata")


@pytest.mark.parametrize("ops,refused", [
    # a DCP dataclass called with arbitrary arguments instead of NEWOBJ + BUILD
    (_glob("torch.distributed.checkpoint.metadata", "StorageMeta") + pickle.MARK + pickle.NONE + pickle.TUPLE
     + pickle.REDUCE + pickle.POP, "refused to call"),
    # protocol-0 INST runs the class's constructor directly, bypassing REDUCE's check
    (pickle.MARK + pickle.INST + b"torch.distributed.checkpoint.metadata\nStorageMeta\n" + pickle.POP, "INST"),
    # NEWOBJ of something that is not a DCP metadata class
    (_glob("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.POP, "NEWOBJ"),
    # BUILD on a torch.Size (made by REDUCE, not a metadata instance)
    (_glob("torch", "Size") + pickle.EMPTY_TUPLE + pickle.TUPLE1 + pickle.REDUCE + pickle.EMPTY_DICT + pickle.BUILD
     + pickle.POP, "refused to set state on"),
], ids=["reduce-dataclass", "inst", "newobj-other", "build-size"])
def test_only_what_dcp_metadata_contains_is_built(tmp_path, ops, refused):
    tag = _index_with(tmp_path, ops)
    with pytest.raises(UnsafeCheckpointError, match=refused) as info:
        read_dcp_metadata(tag)
    _one_line(info.value, ".metadata")


def test_convert_does_not_allocate_what_a_tiny_index_claims(tmp_path):
    """An index that says a 3-element weight is (65536, 32768) fp32 (8 GiB): `fsdpzero convert` allocated the whole
    claimed tensor before DCP read the data file. Sizes are now bounded by the data files the index names: one
    error line naming the key. Run in a child whose address space is capped at +512 MiB."""
    import subprocess
    import sys
    from torch.distributed.checkpoint.metadata import Metadata
    ck.save_checkpoint(tmp_path / "run", None, {"train": {"model": {"w": torch.ones(3)}}}, step=1, save_rng=False)
    tag = tmp_path / "run" / "global_step1"
    md = read_dcp_metadata(tag)
    assert isinstance(md, Metadata)
    md.state_dict_metadata["state/train/model/w"].size = torch.Size([65536, 32768])
    (tag / ".metadata").write_bytes(pickle.dumps(md, protocol=4))   # the test's own object: plain pickle
    _fix_manifest(tag)
    code = (f"import resource, sys\n"
            f"import torch\n"
            f"from fsdpzero.cli import main as cli\n"
            f"vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize:')][0].split()[1]) << 10\n"
            f"resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))\n"
            f"sys.exit(cli(['convert', {str(tmp_path / 'run')!r}, '--to', 'safetensors', '--out', "
            f"{str(tmp_path / 'out')!r}]))\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           cwd=str(Path(__file__).resolve().parents[2]), env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [l for l in child.stderr.splitlines() if l.startswith("fsdpzero convert")]
    assert child.returncode == 2 and len(lines) == 1, child.stderr[-2000:]
    assert "state/train/model/w" in lines[0] and "(65536, 32768)" in lines[0], lines
    assert "can't allocate" not in lines[0], lines


def test_a_length_opcode_cannot_make_the_reader_allocate(tmp_path):
    """A 20-byte index whose BINUNICODE8 claims 3 GiB: read through the file object, the unpickler's read(n) asked
    for the 3 GiB before finding 3 bytes (MemoryError under a cap). The index is read whole (it is the file's
    size) and unpickled from memory, where a read returns only what is there. Child capped at +1 GiB."""
    import subprocess
    import sys
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + pickle.BINUNICODE8 + (3 << 30).to_bytes(8, "little") + b"abc"
                                         + pickle.STOP)
    code = ("import resource\n"
            "import torch\n"
            "from fsdpzero.checkpoint.trust import read_dcp_metadata\n"
            "vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize:')][0].split()[1]) << 10\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))\n"
            f"try:\n    read_dcp_metadata({str(tmp_path)!r})\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           cwd=str(Path(__file__).resolve().parents[2]), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdout.startswith("UnsafeCheckpointError") and ".metadata" in child.stdout, child
    assert "MemoryError" not in child.stdout, child.stdout


# ---- issue 32 item 5, round 2: opcodes the index never needs, entries DCP would act on ------------------------------

def test_a_bytearray8_cannot_make_the_reader_allocate(tmp_path):
    """12 bytes: PROTO 5, BYTEARRAY8 claiming 768 MiB, STOP. Python's pure unpickler allocates a BYTEARRAY8's claimed
    length before reading it (peak RSS +512 MiB for a 512 MiB claim). The opcodes are walked first, lengths checked
    against what remains, and BYTEARRAY8 (never in a DCP index) refused: no allocation. Child capped at +512 MiB."""
    import subprocess
    import sys
    (tmp_path / ".metadata").write_bytes(b"\x80\x05" + pickle.BYTEARRAY8 + (768 << 20).to_bytes(8, "little")
                                         + pickle.STOP)
    assert (tmp_path / ".metadata").stat().st_size == 12
    code = ("import resource\n"
            "import torch\n"
            "from fsdpzero.checkpoint.trust import read_dcp_metadata\n"
            "vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize:')][0].split()[1]) << 10\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))\n"
            f"try:\n    read_dcp_metadata({str(tmp_path)!r})\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           cwd=str(Path(__file__).resolve().parents[2]), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdout.startswith("UnsafeCheckpointError") and ".metadata" in child.stdout, child
    assert "MemoryError" not in child.stdout and "bytearray8" in child.stdout, child.stdout


@pytest.mark.parametrize("ops,refused", [
    (pickle.BYTEARRAY8 + (3).to_bytes(8, "little") + b"abc" + pickle.POP, "refused opcode BYTEARRAY8"),
    (pickle.NEXT_BUFFER + pickle.POP, "refused opcode NEXT_BUFFER"),
    (pickle.EMPTY_LIST + pickle.READONLY_BUFFER + pickle.POP, "refused opcode READONLY_BUFFER"),
    (pickle.EMPTY_TUPLE + pickle.BINPERSID + pickle.POP, "refused opcode BINPERSID"),
    (pickle.EXT1 + b"\x01" + pickle.POP, "refused opcode EXT1"),
    # a length past the end of the file, found by the walk before the unpickler acts on it
    (pickle.BINBYTES8 + (1 << 40).to_bytes(8, "little") + b"x", "expected 1099511627776 bytes"),
], ids=["bytearray8", "next-buffer", "readonly-buffer", "persid", "ext", "length-past-end"])
def test_opcodes_a_dcp_index_never_holds_are_refused_before_unpickling(tmp_path, ops, refused):
    tag = _index_with(tmp_path, ops)
    with pytest.raises(UnsafeCheckpointError, match=refused) as info:
        read_dcp_metadata(tag)
    _one_line(info.value, str(tag / ".metadata"), "nothing from it was run")


def _rewrite_index(tag: Path, change) -> None:
    """The index as the test's own objects, changed and written back with plain pickle (allowed opcodes only), the
    manifest refreshed: what an attacker who can write the directory makes."""
    md = read_dcp_metadata(tag)
    change(md)
    (tag / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    _fix_manifest(tag)


def test_a_chunk_listed_many_times_is_refused_before_dcp_reads_it(tmp_path):
    """The same chunk listed K times costs 2 bytes of index per copy and made DCP read the 1 MiB tensor K times (a
    3.3 KB index took 12 s to load); it is refused naming the entry, before any data is read."""
    state = {"w": {"x": torch.randn(1024, 256)}}
    ck.save_checkpoint(tmp_path, "t", state, save_rng=False)

    def repeat(md):
        entry = md.state_dict_metadata["state/w/x"]
        entry.chunks = entry.chunks * 64
    _rewrite_index(tmp_path / "t", repeat)
    assert (tmp_path / "t" / ".metadata").stat().st_size < 4096
    into = {"w": {"x": torch.zeros(1024, 256)}}
    with pytest.raises(UnsafeCheckpointError, match="listed more than once") as info:
        ck.load_checkpoint(tmp_path, "t", into)
    _one_line(info.value, str(tmp_path / "t" / ".metadata"), "'state/w/x'")
    assert not into["w"]["x"].any()


def _chunk(offsets, sizes):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def _set(attr, value, key="state/w/a"):
    def change(md):
        obj = md.state_dict_metadata[key]
        for name in attr.split(".")[:-1]:
            obj = getattr(obj, name)
        setattr(obj, attr.split(".")[-1], value)
    return change


def _chunks(*boxes, stored=True):
    """state/w/a (64, 32) listed as these (offsets, sizes) chunks, each with a storage entry (the one the save
    wrote) unless stored=False."""
    def change(md):
        from torch.distributed.checkpoint.metadata import MetadataIndex
        [info] = [i for k, i in md.storage_data.items() if k.fqn == "state/w/a"]
        md.state_dict_metadata["state/w/a"].chunks = [_chunk(o, n) for o, n in boxes]
        if stored:
            md.storage_data.update({MetadataIndex("state/w/a", torch.Size(o)): info for o, _ in boxes})
    return change


def _storage(field, value):
    def change(md):
        for index, info in md.storage_data.items():
            if index.fqn == "state/w/a":
                setattr(info, field, value)
    return change


@pytest.mark.parametrize("change,problem", [
    (_set("size", ("a",)), "size ('a',) is not a torch.Size"),
    (_set("size", torch.Size([64, -32])), "is not a torch.Size of non-negative integers"),
    (_set("properties.dtype", "float32"), "do not name a dtype"),
    (_chunks(((0, 0), (64, 33))), "is not inside the tensor's size (64, 32)"),
    (_chunks(((0, 0), (32, 32))), "its chunks hold 1024 elements, the tensor (64, 32) has 2048"),
    (_chunks(((0, 0), (64, 32)), ((0, 0), (64, 32))), "listed more than once"),
    (_chunks(((0, 0), (40, 32)), ((24, 0), (24, 32))), "its chunks at offsets (0, 0) and (24, 0) overlap"),
    (_chunks(((0, 0), (64, 20)), ((0, 10), (32, 22)), ((32, 20), (32, 12))),
     "its chunks at offsets (0, 0) and (0, 10) overlap"),
    (_chunks(((0, 0), (32, 32)), ((32, 0), (32, 32)), stored=False), "no storage entry for its chunk at offsets"),
    (_storage("length", 1 << 40), "past the end of the file"),
    (_storage("offset", -1), "are not non-negative integers"),
], ids=["size-str", "size-negative", "dtype", "out-of-bounds", "hole", "duplicate", "overlap-grid",
        "overlap-irregular", "no-storage", "length-past-end", "negative-offset"])
def test_an_index_entry_dcp_cannot_use_is_one_error_naming_it(tmp_path, change, problem):
    ck.save_checkpoint(tmp_path, "t", _small_state(), save_rng=False)
    _rewrite_index(tmp_path / "t", change)
    with pytest.raises(UnsafeCheckpointError) as info:
        read_dcp_metadata(tmp_path / "t")
    assert problem in str(info.value), str(info.value)
    _one_line(info.value, str(tmp_path / "t" / ".metadata"), "entry 'state/w/a'")


def test_convert_of_an_index_with_a_bad_size_is_one_line(tmp_path, capsys):
    """BUILD setting an entry's size to ("a",) (allowed opcodes only) gave a TypeError traceback in convert."""
    from fsdpzero.cli import main as cli
    ck.save_checkpoint(tmp_path / "run", None, {"train": {"model": {"w": torch.ones(3)}}}, step=1, save_rng=False)
    _rewrite_index(tmp_path / "run" / "global_step1", _set("size", ("a",), key="state/train/model/w"))
    capsys.readouterr()
    assert cli(["convert", str(tmp_path / "run"), "--to", "safetensors", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'state/train/model/w'" in err[0] and "('a',)" in err[0], err
