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


def conversion_dir(tag_dir: str | Path, tuning=None) -> Path:
    """Where engine.load_checkpoint keeps a DeepSpeed tag directory converted to our layout:
    <ckpt_convert_dir>/<tag>-<hash of the source's resolved path>/. Never beside the source: DeepSpeed loads in
    place and writes nothing there, and the source may be on a read-only mount. The same path on every rank (the
    knob comes from the environment all ranks share). Whether a copy there may be reused is decided by its stamp
    (fsdpzero.checkpoint.engine_state.from_deepspeed), and it is loaded like any checkpoint of ours.
    tuning: the engine's settings (Engine.tuning_now()); by default the environment now."""
    from fsdpzero.tuning import resolve
    root = (tuning if tuning is not None else resolve()).ckpt_convert_dir or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fsdpzero" / "deepspeed"
    source = Path(tag_dir).resolve()
    return Path(root) / f"{source.name}-{hashlib.sha256(str(source).encode()).hexdigest()[:16]}"


def deepspeed_to_ours(ds_dir: str | Path, tag: str | None = None, out: str | Path | None = None, *, to: str = "dcp",
                      dtype=None, max_shard_size: int | str = "5GB", trainable_names: list[str] | None = None) -> Path:
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
    names = list(st["adam"])
    if len(st["param_groups"]) != 1:
        raise NotImplementedError(f"{ds_dir}: {len(st['param_groups'])} DeepSpeed param groups; only one is supported")
    group = dict(st["param_groups"][0], params=names)
    optim = {"state": {n: {k: (v.contiguous() if torch.is_tensor(v) else v) for k, v in s.items()}
                       for n, s in st["adam"].items()}, "param_groups": [group]}
    state = {"train": {"model": model, "optim": optim},
             "counters": {**{k: v for k, v in st["counters"].items() if v is not None},
                          "source": f"deepspeed:{Path(ds_dir).resolve()}:{tag}"}}
    if st["loss_scaler"]:
        state["loss_scaler"] = st["loss_scaler"]
    out = Path(out) if out else Path(ds_dir) / "fsdpzero"
    # DeepSpeed's client_state may hold anything; keep what JSON can carry
    client = {k: v for k, v in st["client_state"].items() if isinstance(v, (int, float, str, bool, type(None)))}
    ck.save_checkpoint(out, tag, state, client, save_rng=False, no_dist=True)  # this process writes it all
    return out
