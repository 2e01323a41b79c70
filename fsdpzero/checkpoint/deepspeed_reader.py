"""Read a DeepSpeed ZeRO 0-3 checkpoint directory without DeepSpeed, safely: the files, unpickled, as they are.

DeepSpeed's files are pickles that name a few DeepSpeed classes (loss scaler, ZeRO stage enum, fragment address).
They are loaded with torch's `weights_only` unpickler, which only rebuilds tensors, containers and allowlisted
globals; the DeepSpeed names are mapped to inert stand-ins below. Any other global is refused with an
`UnsafeCheckpointError` that names it, before anything from the file runs. read_checkpoint() also refuses the
layouts fsdpzero does not convert (MoE, pipeline, tensor parallel); fsdpzero.checkpoint.deepspeed turns what it returns
into fp32 weights and Adam states.

Nothing in a file makes the reader hold more than the file's real size (`load_ds_file`): the file must be torch's
zip format with stored (uncompressed) entries no larger together than the file, and every tensor in it a
non-overlapping view whose bytes, over the file's distinct views, fit in the file (a stride-0 tensor of 1.5e9
elements in a 45 KB file is refused, not materialised). Files are read into memory, never mmap-ed: a file that
shrinks while it is converted cannot SIGBUS the process. A file whose structure is not what DeepSpeed writes (a
missing key, a value of the wrong type) is a `MalformedCheckpointError`, one line naming the file or directory and
the key, at every public entry point (`checked`), never a KeyError / TypeError traceback.
"""
from __future__ import annotations

import argparse
import contextvars
import functools
import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdpzero.checkpoint.files import check_tag, read_latest
# one error type for every refused file, DCP index or DeepSpeed pickle
from fsdpzero.checkpoint.trust import UnsafeCheckpointError


class LossScalerState:
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.(Dynamic)LossScaler: keeps the attributes, runs nothing."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


class ZeroStage(int):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (an int enum): ZeroStage(2) == 2."""


class FragmentAddress:
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address (numel, start)."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _path_as_str(*parts: str) -> str:
    return "/".join(parts)


# global name in the pickle -> what is built instead. Torch's weights_only unpickler already allows tensors,
# storages, dtypes, torch.Size and OrderedDict.
ALLOWED_GLOBALS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "argparse.Namespace": argparse.Namespace,
    "pathlib.PosixPath": _path_as_str,
    "pathlib.WindowsPath": _path_as_str,
}


class MalformedCheckpointError(ValueError):
    """A DeepSpeed checkpoint file whose structure is not what DeepSpeed writes: one line naming the file (or
    directory) and the key."""


def load_ds_file(path: str | Path) -> dict:
    """torch.load a DeepSpeed file with weights_only=True plus the DeepSpeed stand-ins; refuse anything else,
    and anything that would make it hold more than the file's size (see the module doc)."""
    safe = [(obj, name) for name, obj in ALLOWED_GLOBALS.items()]
    with open(path, "rb") as f:   # one open file: what is checked is what is loaded
        size = os.fstat(f.fileno()).st_size
        _check_zip(f, path, size)
        f.seek(0)
        try:
            with torch.serialization.safe_globals(safe):
                obj = torch.load(f, map_location="cpu", weights_only=True, mmap=False)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"global ([\w.]+)", str(e))
            name = found.group(1) if found else "an object"
            raise UnsafeCheckpointError(
                f"{path}: refused to unpickle {name}: it is not one of the classes a DeepSpeed checkpoint needs "
                f"({', '.join(sorted(ALLOWED_GLOBALS))}, tensors, containers). The file may be tampered with or from "
                f"an unsupported DeepSpeed feature; nothing from it was executed.") from None
        except (RuntimeError, EOFError, ValueError, OSError, KeyError, TypeError, AttributeError, IndexError,
                OverflowError, MemoryError) as e:   # torch's reader on a damaged or shrinking file
            raise MalformedCheckpointError(f"{path}: not a readable torch checkpoint file ({_what(e)})") from None
    _check_tensors(obj, path, size)
    return obj


def _check_zip(f, path, size: int) -> None:
    """torch.save's zip format with stored entries whose sizes add up to at most the file (no zip bomb, no entries
    sharing bytes). The legacy non-zip format is refused: its reader allocates the sizes the pickle states."""
    try:
        infos = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        raise MalformedCheckpointError(f"{path}: not a torch zip checkpoint file ({_what(e)}); DeepSpeed writes "
                                       f"torch.save's zip format") from None
    compressed = [i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED]
    if compressed:
        raise UnsafeCheckpointError(f"{path}: entry {compressed[0]} is compressed; torch.save stores entries "
                                    f"uncompressed, so the file was not written by torch (a zip bomb?)")
    if sum(i.file_size for i in infos) > size:
        raise UnsafeCheckpointError(f"{path}: its zip entries add up to {sum(i.file_size for i in infos)} bytes, "
                                    f"more than the file's {size}: entries share bytes; not written by torch")


def _tensors(obj, seen: set, path, depth: int = 0):
    """Every tensor in what the weights_only unpickler built (containers and the stand-ins' attributes)."""
    if id(obj) in seen:
        return
    if depth > 64:   # DeepSpeed's files nest a few levels; nothing may hide below the walk
        raise MalformedCheckpointError(f"{path}: containers nested more than 64 deep; DeepSpeed never writes that")
    seen.add(id(obj))
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen, path, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _tensors(v, seen, path, depth + 1)
    elif isinstance(obj, (LossScalerState, FragmentAddress, argparse.Namespace)):
        yield from _tensors(vars(obj), seen, path, depth + 1)


def _non_overlapping(t: torch.Tensor) -> bool:
    extent = 1
    for stride, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride < extent:
            return False
        extent = stride * (n - 1) + extent
    return True


def _check_tensors(obj, path, size: int) -> None:
    """Plain strided CPU tensors, no view overlapping itself, the distinct views' bytes within the file's size:
    whatever the conversion copies is then bounded by the file."""
    views = {}
    for t in _tensors(obj, set(), path):
        if t.layout != torch.strided or t.is_nested or t.device.type != "cpu" or t.is_quantized:
            raise UnsafeCheckpointError(f"{path}: a {t.layout} {t.device.type} tensor; DeepSpeed checkpoints hold "
                                        f"plain dense CPU tensors")
        if not _non_overlapping(t):
            raise UnsafeCheckpointError(f"{path}: a tensor of shape {tuple(t.shape)} with strides {t.stride()} "
                                        f"overlaps itself (a stride-0 view of {t.untyped_storage().nbytes()} bytes "
                                        f"claiming {t.numel() * t.element_size()}); DeepSpeed never writes one")
        views[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)] = \
            t.numel() * t.element_size()
    if sum(views.values()) > size:
        raise UnsafeCheckpointError(f"{path}: its tensors hold {sum(views.values())} bytes, more than the file's "
                                    f"{size} (views repeating the same data); DeepSpeed never writes that")


def _what(e: BaseException) -> str:
    if isinstance(e, KeyError):
        return f"missing key {e.args[0]!r}" if e.args else "a missing key"
    text = " ".join(str(e).split())
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_inside = contextvars.ContextVar("fsdpzero_ds_reading", default=False)


def checked(fn):
    """A public reader entry point: a file whose structure is not DeepSpeed's raises MalformedCheckpointError (one
    line naming the checkpoint and the problem), never a KeyError / TypeError / AttributeError traceback. Only the
    outermost call translates; an allocation failure (this machine, not the file) is left as it is."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _inside.get():
            return fn(*args, **kwargs)
        token = _inside.set(True)
        first = args[0] if args else None
        where = str(getattr(first, "tag_dir", first)) if first is not None else "DeepSpeed checkpoint"
        try:
            return fn(*args, **kwargs)
        except (UnsafeCheckpointError, NotImplementedError, OSError):
            raise
        except MalformedCheckpointError as e:
            if os.sep in str(e).split(": ")[0]:   # names its file already
                raise
            raise MalformedCheckpointError(f"{where}: {e}") from None
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, StopIteration, ZeroDivisionError,
                OverflowError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and "alloc" in str(e).lower() and "storage" not in str(e).lower():
                raise
            if isinstance(e, ValueError) and where in str(e):
                raise MalformedCheckpointError(" ".join(str(e).split())) from None
            raise MalformedCheckpointError(f"{where}: not a DeepSpeed checkpoint fsdpzero can read: {_what(e)}") \
                from None
        finally:
            _inside.reset(token)
    return wrapper


def _need(value, kind, file, key: str, what: str):
    """value if isinstance(value, kind), else a MalformedCheckpointError naming the file and the key."""
    if not isinstance(value, kind) or isinstance(value, bool):
        raise MalformedCheckpointError(f"{file}: `{key}` is {_describe(value)}; DeepSpeed writes {what} there")
    return value


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"a {type(value).__name__} ({text[:60]}{'...' if len(text) > 60 else ''})"


def _key(d: dict, key: str, file):
    if key not in d:
        raise MalformedCheckpointError(f"{file}: no `{key}`; not a complete DeepSpeed checkpoint file")
    return d[key]


def _shape(value, file, key: str) -> tuple[int, ...]:
    if torch.is_tensor(value) or not isinstance(value, (list, tuple, torch.Size)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value):
        raise MalformedCheckpointError(f"{file}: shape of {key!r} is {_describe(value)}; a list of sizes >= 0")
    return tuple(value)


def _check_model_states(ms, file, need_shapes: bool) -> None:
    _need(ms, dict, file, "(the whole file)", "a dict")
    if "module" in ms and ms["module"] is not None:
        module = _need(ms["module"], dict, file, "module", "a state dict")
        for name, v in module.items():
            _need(v, torch.Tensor, file, f"module.{name}", "a tensor")
    if need_shapes:
        groups = _need(_key(ms, "param_shapes", file), list, file, "param_shapes", "a list of {name: shape}")
        for g in groups:
            for name, shape in _need(g, dict, file, "param_shapes", "a list of {name: shape}").items():
                _shape(shape, file, name)
    for name, shape in (_need(ms.get("frozen_param_shapes") or {}, dict, file, "frozen_param_shapes",
                              "{name: shape}")).items():
        _shape(shape, file, name)


def _check_optim_state(os_, file, stage: int) -> None:
    flat_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flats = _need(_key(os_, flat_key, file), list, file, flat_key, "a list of flat fp32 tensors")
    for t in flats:
        _need(t, torch.Tensor, file, flat_key, "a list of flat fp32 tensors")
        if t.dim() != 1 or not t.is_floating_point():
            raise MalformedCheckpointError(f"{file}: `{flat_key}` holds {_describe(t)}; DeepSpeed writes flat "
                                           f"(1-D) fp32 tensors there")
    inner_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    inner = _need(_key(os_, inner_key, file), dict, file, inner_key, "a torch optimizer state dict")
    _need(_key(inner, "state", file), dict, file, f"{inner_key}.state", "a dict of per-group Adam states")
    _need(_key(inner, "param_groups", file), list, file, f"{inner_key}.param_groups", "a list of dicts")


def resolve_tag_dir(ds_dir: str | Path, tag: str | None = None) -> Path:
    """<ds_dir>/<tag>, tag read from <ds_dir>/latest when None; a tag dir itself is accepted too."""
    ds_dir = Path(ds_dir)
    if tag is None and list(ds_dir.glob("*_model_states.pt")):
        return ds_dir
    if tag is None:
        latest = ds_dir / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"{ds_dir}: no `latest` file and no *_model_states.pt; pass the tag "
                                    f"(one of: {sorted(p.name for p in ds_dir.iterdir() if p.is_dir())})")
        tag = read_latest(ds_dir)
    tag_dir = ds_dir / check_tag(tag)   # a plain name inside ds_dir, from `latest` or the caller
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"{tag_dir}: checkpoint tag directory does not exist")
    return tag_dir


def _natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


@dataclass
class DeepSpeedCheckpoint:
    tag_dir: Path
    stage: int
    world_size: int
    model_states: list[dict]   # one per *_model_states.pt (stage 3: one per rank; else one)
    optim_states: list[dict]   # the inner `optimizer_state_dict` of each rank's *_optim_states.pt (ZeRO only)

    @property
    def meta(self) -> dict:
        return self.model_states[0]


@checked
def read_checkpoint(ds_dir: str | Path, tag: str | None = None) -> DeepSpeedCheckpoint:
    tag_dir = resolve_tag_dir(ds_dir, tag)
    model_files = sorted(tag_dir.glob("*_model_states.pt"), key=_natural_key)
    if not model_files:
        raise FileNotFoundError(f"{tag_dir}: no *_model_states.pt files: not a DeepSpeed checkpoint")
    for f in list(model_files) + list(tag_dir.glob("*_optim_states.pt")):
        if f.name.startswith(("expert_", "layer_", "expp_rank_")) or re.search(r"mp_rank_(?!00_)\d+", f.name):
            raise NotImplementedError(f"{f}: MoE expert, pipeline-layer and tensor-parallel (mp_rank > 0) "
                                      f"checkpoints are not supported; plain data-parallel ZeRO only")
    model_states = [load_ds_file(f) for f in model_files]
    optim_files = sorted(tag_dir.glob("*_optim_states.pt"), key=_natural_key)
    for f, ms in zip(model_files, model_states):
        _check_model_states(ms, f, need_shapes=bool(optim_files) and f == model_files[0])
    if not optim_files:
        if model_states[0].get("optimizer") is None:
            raise ValueError(f"{tag_dir}: no *_optim_states.pt and no `optimizer` in the model states: saved without "
                             f"optimizer state, so only the `module` weights could be used")
        return DeepSpeedCheckpoint(tag_dir, 0, int(model_states[0].get("dp_world_size", 1)), model_states, [])
    optim_states = []
    for f in optim_files:
        outer = _need(load_ds_file(f), dict, f, "(the whole file)", "a dict")
        optim_states.append(_need(_key(outer, "optimizer_state_dict", f), dict, f, "optimizer_state_dict",
                                  "a dict"))
    first = optim_states[0]
    if "zero_stage" not in first:
        raise NotImplementedError(f"{optim_files[0]}: no `zero_stage` (a bf16 stage-0 BF16_Optimizer checkpoint of "
                                  f"DeepSpeed <= 0.17.5); not supported")
    stage = int(_need(first["zero_stage"], int, optim_files[0], "zero_stage", "1, 2 or 3"))
    if stage not in (1, 2, 3):
        raise MalformedCheckpointError(f"{optim_files[0]}: `zero_stage` is {stage}; ZeRO optimizer files have 1, 2 "
                                       f"or 3")
    partitions = _need(_key(first, "partition_count", optim_files[0]), (int, list), optim_files[0],
                       "partition_count", "the number of ranks (or a list of it per group)")
    counts = partitions if isinstance(partitions, list) else [partitions]
    if not counts or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
        raise MalformedCheckpointError(f"{optim_files[0]}: `partition_count` is {_describe(partitions)}; DeepSpeed "
                                       f"writes the number of ranks (>= 1) there")
    world = max(counts)
    for f, os_ in zip(optim_files, optim_states):
        _check_optim_state(os_, f, stage)
    if world != len(optim_files):
        raise ValueError(f"{tag_dir}: partition_count says {world} ranks but there are {len(optim_files)} "
                         f"*_optim_states.pt files; the checkpoint is incomplete or mixed with another")
    if stage == 3 and len(model_files) != world:
        raise ValueError(f"{tag_dir}: stage 3 needs {world} *_model_states.pt files, found {len(model_files)}")
    return DeepSpeedCheckpoint(tag_dir, stage, world, model_states, optim_states)


# DeepSpeed bookkeeping keys of *_model_states.pt; anything else at top level is the user's client_state.
DS_MODEL_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                 "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                 "ds_version", "checkpoint_parallel_dimensions"}
