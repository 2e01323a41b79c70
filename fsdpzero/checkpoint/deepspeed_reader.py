"""Read a DeepSpeed ZeRO 0-3 checkpoint directory without DeepSpeed, safely: the files, unpickled, as they are.

DeepSpeed's files are pickles that name a few DeepSpeed classes (loss scaler, ZeRO stage enum, fragment address).
They are loaded with torch's `weights_only` unpickler, which only rebuilds tensors, containers and allowlisted
globals; the DeepSpeed names are mapped to inert stand-ins below. Any other global is refused with an
`UnsafeCheckpointError` that names it, before anything from the file runs. read_checkpoint() also refuses the
layouts fsdpzero does not convert (MoE, pipeline, tensor parallel); fsdpzero.checkpoint.deepspeed turns what it returns
into fp32 weights and Adam states.
"""
from __future__ import annotations

import argparse
import pickle
import re
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


def load_ds_file(path: str | Path) -> dict:
    """torch.load a DeepSpeed file with weights_only=True plus the DeepSpeed stand-ins; refuse anything else."""
    safe = [(obj, name) for name, obj in ALLOWED_GLOBALS.items()]
    try:
        with torch.serialization.safe_globals(safe):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"global ([\w.]+)", str(e))
        name = found.group(1) if found else "an object"
        raise UnsafeCheckpointError(
            f"{path}: refused to unpickle {name}: it is not one of the classes a DeepSpeed checkpoint needs "
            f"({', '.join(sorted(ALLOWED_GLOBALS))}, tensors, containers). The file may be tampered with or from an "
            f"unsupported DeepSpeed feature; nothing from it was executed.") from None


def _is_zip(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


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
    if not optim_files:
        if model_states[0].get("optimizer") is None:
            raise ValueError(f"{tag_dir}: no *_optim_states.pt and no `optimizer` in the model states: saved without "
                             f"optimizer state, so only the `module` weights could be used")
        return DeepSpeedCheckpoint(tag_dir, 0, int(model_states[0].get("dp_world_size", 1)), model_states, [])
    optim_states = [load_ds_file(f)["optimizer_state_dict"] for f in optim_files]
    first = optim_states[0]
    if "zero_stage" not in first:
        raise NotImplementedError(f"{optim_files[0]}: no `zero_stage` (a bf16 stage-0 BF16_Optimizer checkpoint of "
                                  f"DeepSpeed <= 0.17.5); not supported")
    stage = int(first["zero_stage"])
    partitions = first["partition_count"]
    world = max(partitions) if isinstance(partitions, list) else int(partitions)
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
