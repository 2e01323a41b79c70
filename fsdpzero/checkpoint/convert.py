"""Checkpoint conversion from the files alone, no process group: our DCP checkpoint -> consolidated safetensors
(`dcp_to_safetensors`), a DeepSpeed checkpoint -> our layout (`deepspeed_to_ours`). `fsdpzero convert`
(fsdpzero.cli.convert) is the command line over these.

Our checkpoints are read tensor by tensor through DCP's reader (dcp.load(no_dist=True) into one shard's worth of
empty tensors at a time), so memory stays near one output shard; they are checked first as a training load checks
them (complete, checksums, DCP's index through the allowlisted reader of fsdpzero.checkpoint.trust). A DeepSpeed
checkpoint becomes our layout: state "train" = {"model": fp32 weights, "optim": AdamW state by parameter name},
plus counters and the loss scaler, so an engine (or ModelOptimizer + AdamW) resumes where DeepSpeed stopped.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def model_keys(metadata) -> dict[str, str]:
    """DCP keys of model weights in one of our checkpoints -> parameter FQN (state/<name>/model/<fqn>)."""
    out = {}
    for key in metadata.state_dict_metadata:
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "state" and parts[2] == "model":
            out[key] = parts[3]
    return out


def _sizes_within_data(path: Path, meta, keys) -> None:
    """The weights the index declares fit in the data files it names (DCP stores tensors uncompressed): buffers are
    allocated from these sizes before DCP reads a byte, so a tiny planted index must not claim gigabytes."""
    import math
    files = {info.relative_path for info in (meta.storage_data or {}).values()}
    data = sum((path / name).stat().st_size for name in files if (path / name).is_file())
    total = 0
    for key in keys:
        entry = meta.state_dict_metadata[key]
        nbytes = math.prod(entry.size) * entry.properties.dtype.itemsize
        total += nbytes
        if total > data:
            raise ValueError(f"{path}: index entry {key!r} declares shape {tuple(entry.size)} "
                             f"({entry.properties.dtype}), more bytes than the checkpoint's data files hold ({data}); "
                             f"the index is corrupt or was planted")


def dcp_to_safetensors(ckpt_dir: str | Path, tag: str | None = None, out: str | Path | None = None, *,
                       dtype=None, max_shard_size: int | str = "5GB") -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint import CheckpointException

    from fsdpzero.checkpoint.agree import describe
    from fsdpzero.checkpoint.dcp import CheckpointError, replaced, resolve_tag, verify_checkpoint
    from fsdpzero.checkpoint.export import write_sharded
    from fsdpzero.checkpoint.trust import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata, tensor_entries
    try:   # the same checks as a training load: tag, completeness, checksums, the allowlisted index reader
        path = (Path(ckpt_dir) if (Path(ckpt_dir) / ".metadata").is_file() and tag is None
                else resolve_tag(ckpt_dir, tag))
        verified = verify_checkpoint(path, distributed=False)
        meta = read_dcp_metadata(path)
        keys = model_keys(meta)
        tensor_entries(meta, path, keys)
    except CheckpointError as e:   # damaged: a ValueError, which the CLI reports in one line (exit 2)
        raise ValueError(str(e)) from None
    if not keys:
        raise ValueError(f"{path}: no model weights (state/<name>/model/<fqn>) in this checkpoint")
    _sizes_within_data(path, meta, keys)
    by_fqn = {fqn: key for key, fqn in keys.items()}

    def out_dtype(md):
        return dtype if dtype is not None and md.properties.dtype.is_floating_point else md.properties.dtype

    specs = [(fqn, out_dtype(meta.state_dict_metadata[key]), tuple(meta.state_dict_metadata[key].size))
             for key, fqn in keys.items()]

    def load(names):   # one dcp.load per output file: a file's tensors are in memory at once
        buf = {by_fqn[n]: torch.empty(meta.state_dict_metadata[by_fqn[n]].size,
                                      dtype=meta.state_dict_metadata[by_fqn[n]].properties.dtype) for n in names}
        try:
            dcp.load(buf, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                     no_dist=True)
        except (Exception, CheckpointException) as e:   # DCP's CheckpointException is a BaseException
            inner = e.failures[min(e.failures)] if isinstance(getattr(e, "failures", None), dict) and e.failures \
                else e
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, ValueError):   # the allowlisted reader's refusal, as itself
                raise inner from None
            raise ValueError(replaced(path, verified) or f"reading checkpoint {path} failed: {describe(e)}") \
                from None
        return [buf[by_fqn[n]].to(out_dtype(meta.state_dict_metadata[by_fqn[n]])) for n in names]

    out = Path(out) if out else path.parent / f"{path.name}-safetensors"
    write_sharded(out, specs, load, max_shard_size=max_shard_size)
    problem = replaced(path, verified)   # every tensor read must come from the checkpoint that was verified
    if problem:
        raise ValueError(f"{problem}; {out} is not a consistent export")
    return out


SOURCE_STAMP = "source.json"   # in a converted copy of a DeepSpeed checkpoint: what it was converted from
CONVERT_LOCK = ".fsdpzero-convert.lock"   # conversions into one directory publish one at a time
CONVERTED_PREFIX = ".fsdpzero-"           # <save_dir>/.fsdpzero-<tag>: a copy beside the source
_CONVERT_TMP = ".tmp-convert-"            # <root>/.tmp-convert-<copy>.<token>: a conversion in progress
KNOB_HINT = ("set FSDPZERO_CKPT_CONVERT_DIR (knob ckpt_convert_dir) to a writable directory, one every node sees "
             "when several nodes load")


def _user_cache(source: Path, tuning) -> Path:
    root = tuning.ckpt_convert_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "fsdpzero" / "deepspeed"
    return Path(root) / f"{source.name}-{hashlib.sha256(str(source).encode()).hexdigest()[:16]}"


def _writable(directory: Path) -> bool:
    """Writable by this process and meant to be: a read-only mount fails access(2); a directory whose write bits are
    all off is read-only by intent even for root, who access(2) would let write."""
    try:
        return os.access(directory, os.W_OK) and bool(directory.stat().st_mode & 0o222)
    except OSError:
        return False


def conversion_dir(tag_dir: str | Path, tuning=None) -> Path:
    """Where engine.load_checkpoint keeps a DeepSpeed tag directory converted to our layout, as this process sees
    it (rank 0 decides and broadcasts: fsdpzero.checkpoint.engine_state.from_deepspeed): the ckpt_convert_dir knob's
    <dir>/<tag>-<hash of the source's resolved path>/ when set; else beside the source, <save_dir>/.fsdpzero-<tag>/,
    when this process may write there (shared storage: every node sees it); else, a read-only source,
    <$XDG_CACHE_HOME or ~/.cache>/fsdpzero/deepspeed/<tag>-<hash>/ (node-local unless the home is shared). Whether a
    copy there may be reused is decided by its stamp, and it is loaded like any checkpoint of ours.
    tuning: the engine's settings (Engine.tuning); called without them: the process defaults."""
    from fsdpzero.tuning import or_defaults
    tuning = or_defaults(tuning)
    source = Path(tag_dir).resolve()
    if not tuning.ckpt_convert_dir and _writable(source.parent):
        return source.parent / f"{CONVERTED_PREFIX}{source.name}"
    return _user_cache(source, tuning)


def converted_is_fresh(out: Path, stamp: dict, tag: str) -> bool:
    """A copy at `out` made from exactly the source files `stamp` describes, and complete."""
    from fsdpzero.checkpoint.files import checkpoint_problems
    try:
        return json.loads((out / SOURCE_STAMP).read_text()) == stamp and not checkpoint_problems(out / tag)
    except (OSError, ValueError):
        return False


def convert_into(out: Path, stamp: dict, tag: str, build) -> None:
    """Rank 0: make the converted copy `out` unless a fresh one is there. build(tmp) writes the copy into this
    conversion's own temp dir beside `out`; it is published by rename under the root's lock (CONVERT_LOCK), so jobs
    converting one checkpoint at once never write into or delete each other's copy: the first to finish publishes,
    the others find it fresh and drop theirs. A stale copy is renamed aside before it is removed; the temp dirs of
    killed conversions (nobody holds their lock) are removed by the next conversion there."""
    import re
    import secrets
    import shutil

    from fsdpzero.checkpoint.files import hold, locked, write_atomic
    if converted_is_fresh(out, stamp, tag):
        return
    root = out.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_CONVERT_TMP}{out.name}.{secrets.token_hex(8)}"
    abandoned = re.compile(re.escape(_CONVERT_TMP) + r".+\.[0-9a-f]{16}")
    with locked(root, CONVERT_LOCK):
        for p in root.iterdir():
            if abandoned.fullmatch(p.name) and p.is_dir() and not p.is_symlink() and (fd := hold(p)) is not None:
                shutil.rmtree(p, ignore_errors=True)
                os.close(fd)
        tmp.mkdir()
        held = hold(tmp)
    try:
        build(tmp)
        write_atomic(tmp / SOURCE_STAMP, json.dumps(stamp))
        with locked(root, CONVERT_LOCK):
            if converted_is_fresh(out, stamp, tag):   # another job published it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
                return
            if out.exists() or out.is_symlink():       # stale or not ours: aside by rename, then removed
                aside = root / f"{_CONVERT_TMP}{out.name}.{secrets.token_hex(8)}"
                os.rename(out, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if held is not None:
            os.close(held)


def _json_plain(value) -> bool:
    """A dict of numbers, strings, lists, dicts (what state.json can carry)."""
    if not isinstance(value, dict):
        return False
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def deepspeed_to_ours(ds_dir: str | Path, tag: str | None = None, out: str | Path | None = None, *, to: str = "dcp",
                      dtype=None, max_shard_size: int | str = "5GB", trainable_names: list[str] | None = None,
                      tuning=None) -> Path:
    from fsdpzero.checkpoint import deepspeed as ds_checkpoint
    st = ds_checkpoint.training_state(ds_dir, tag, trainable_names)
    tag = st["tag"]
    if to in ("safetensors", "fp32"):
        from fsdpzero.checkpoint.export import save_state_dict
        out = Path(out) if out else Path(ds_dir) / f"{tag}-safetensors"
        save_state_dict(st["weights"], out, dtype=dtype, max_shard_size=max_shard_size)
        return out
    import torch

    from fsdpzero.checkpoint import dcp as ck
    model, seen = {}, set()
    for k, v in st["weights"].items():  # tied params arrive aliased; DCP wants one tensor per key
        v = v.float() if v.is_floating_point() else v
        model[k] = v.clone() if id(v) in seen else v.contiguous()
        seen.add(id(v))
    optimizer_states = {**st.get("other_states", {}), **st["adam"]}   # a universal file may hold SGD's, Adagrad's
    names = list(optimizer_states)
    if len(st["param_groups"]) != 1:
        raise NotImplementedError(f"{ds_dir}: {len(st['param_groups'])} DeepSpeed param groups; only one is supported")
    group = dict(st["param_groups"][0], params=names)
    optim = {"state": {n: {k: (v.contiguous() if torch.is_tensor(v) else v) for k, v in s.items()}
                       for n, s in optimizer_states.items()}, "param_groups": [group]}
    if st.get("unstepped"):   # saved before the first step (universal.UNSTEPPED_KEY): the load leaves it fresh
        from fsdpzero.optim.grad_path import UNSTEPPED
        optim[UNSTEPPED] = True
    state = {"train": {"model": model, "optim": optim},
             "counters": {**{k: v for k, v in st["counters"].items() if v is not None},
                          "source": f"deepspeed:{Path(ds_dir).resolve()}:{tag}"}}
    if _json_plain(st["lr_scheduler"]):   # DeepSpeed's schedulers keep numbers ({"last_batch_iteration": n})
        state["counters"]["lr_scheduler"] = st["lr_scheduler"]
    if st["loss_scaler"]:
        state["loss_scaler"] = st["loss_scaler"]
    out = Path(out) if out else Path(ds_dir) / "fsdpzero"
    # DeepSpeed's client_state may hold anything; keep what JSON can carry
    client = {k: v for k, v in st["client_state"].items() if isinstance(v, (int, float, str, bool, type(None)))}
    ck.save_checkpoint(out, tag, state, client, save_rng=False, no_dist=True,   # this process writes it all
                       tuning=tuning)
    return out


# ---- universal checkpoints (DeepSpeed's ds_to_universal format; fsdpzero.checkpoint.universal) -----------------

def _saved_tree(obj, tensors: dict):
    """state.json's nested form (fsdpzero.checkpoint.dcp writes __dict__ / __tensor__ / __tuple__ nodes) with the
    tensors put back."""
    if isinstance(obj, list):
        return [_saved_tree(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_saved_tree(v, tensors) for v in obj["__tuple__"])
        return {k: _saved_tree(v, tensors) for k, v in obj["__dict__"]}
    return obj


def ours_training_state(ckpt_dir: str | Path, tag: str | None = None) -> dict:
    """One of our (engine) checkpoints, read whole without a process group, as fsdpzero.checkpoint.universal's
    writer takes it: fp32 weights (stage 1 / offload masters where saved), per-parameter optimizer states in the
    weight's shape, the param group, counters, scheduler, loss scaler, and the "unstepped" mark. Checked as a training
    load checks it (complete, checksums, the allowlisted index reader); holds the whole state in memory."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    from fsdpzero.checkpoint.agree import describe
    from fsdpzero.checkpoint.dcp import (CheckpointError, read_saved_json, replaced, resolve_tag,
                                         verify_checkpoint)
    from fsdpzero.checkpoint.trust import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata, tensor_entries
    from fsdpzero.optim.grad_path import MASTER, UNSTEPPED
    try:
        path = (Path(ckpt_dir) if (Path(ckpt_dir) / ".metadata").is_file() and tag is None
                else resolve_tag(ckpt_dir, tag))
        verified = verify_checkpoint(path, distributed=False)
        meta = read_dcp_metadata(path)
        keys = [k for k in meta.state_dict_metadata if k.startswith("state/train/")]
        tensor_entries(meta, path, keys)
        saved = read_saved_json(path, "state.json")
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    _sizes_within_data(path, meta, keys)
    buf = {k: torch.empty(meta.state_dict_metadata[k].size, dtype=meta.state_dict_metadata[k].properties.dtype)
           for k in keys}
    try:
        dcp.load(buf, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                 no_dist=True)
    except (Exception, CheckpointException) as e:   # DCP's CheckpointException is a BaseException
        inner = e.failures[min(e.failures)] if isinstance(getattr(e, "failures", None), dict) and e.failures else e
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, ValueError):
            raise inner from None
        raise ValueError(replaced(path, verified) or f"reading checkpoint {path} failed: {describe(e)}") from None
    problem = replaced(path, verified)
    if problem:
        raise ValueError(problem)
    try:
        top = _saved_tree(saved, buf)
        train = top["train"]
        model, optim = train["model"], train.get("optim")
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: state.json is not an engine checkpoint's ({describe(e)}): no train/model") \
            from None
    if not isinstance(optim, dict) or not optim.get("param_groups"):
        raise ValueError(f"{path}: no optimizer state in this checkpoint; a universal checkpoint needs one (use "
                         f"--to safetensors for the weights alone)")
    groups = optim["param_groups"]
    names = {n for g in groups for n in (g.get("params") or g.get("param_names") or [])}
    states = optim.get("state") or {}
    weights, out_states = {}, {}
    for name, value in model.items():
        if not torch.is_tensor(value):
            continue
        master = (states.get(name) or {}).get(MASTER)
        weights[name] = (master.reshape(value.shape) if torch.is_tensor(master) else value).float()
    for name in names:
        if name not in weights:
            raise ValueError(f"{path}: optimizer parameter {name!r} has no model weight")
        entry = {}
        for key, value in (states.get(name) or {}).items():
            if key == MASTER:
                continue
            entry[key] = value.reshape(weights[name].shape) if torch.is_tensor(value) and key != "step" else value
        out_states[name] = entry
    engine = top.get("engine") or top.get("counters") or {}
    return {"weights": weights, "trainable": [n for n in model if n in names], "states": out_states,
            "unstepped": bool(optim.get(UNSTEPPED)), "param_groups": [{k: v for k, v in g.items()
                                                                      if k not in ("params", "param_names")}
                                                                     for g in groups],
            "counters": {k: engine.get(k) for k in ("global_steps", "global_samples", "skipped_steps")},
            "lr_scheduler": engine.get("lr_scheduler"), "loss_scaler": engine.get("loss_scaler"),
            "world_size": int(verified.get("world_size") or 1), "buffers": [], "tag": path.name}


def to_universal(src: str | Path, tag: str | None = None, out: str | Path | None = None, *,
                 source: str = "fsdpzero") -> Path:
    """`fsdpzero convert SRC --to universal`: our checkpoint (or a DeepSpeed ZeRO one, source="deepspeed": what
    DeepSpeed's ds_to_universal does, without DeepSpeed) -> DeepSpeed universal checkpoint <out>/<tag>/ plus
    <out>/latest_universal. out defaults to the source's save dir (beside the source tag, as ds_to_universal's
    usual --output_folder), the tag to <source tag>_universal."""
    from fsdpzero.checkpoint import universal
    if source == "deepspeed":
        from fsdpzero.checkpoint import deepspeed as ds_checkpoint
        from fsdpzero.checkpoint.deepspeed_reader import resolve_tag_dir
        tag_dir = resolve_tag_dir(src, tag)
        st = ds_checkpoint.training_state(tag_dir)
        st = dict(st, trainable=st.get("trainable") or list(st["adam"]),
                  states={**st.get("other_states", {}), **st["adam"]}, buffers=[])
        save_dir = tag_dir.parent
    else:
        st = ours_training_state(src, tag)
        save_dir = (Path(src) if (Path(src) / st["tag"]).is_dir() else Path(src).parent)
    out = Path(out) if out else save_dir
    return universal.write_universal(st, out, f"{st['tag']}_universal")
