"""Consolidated weights for `transformers`: model.safetensors, or shards + model.safetensors.index.json above a size.

`save_16bit_model` is DeepSpeed's engine.save_16bit_model / stage3_gather_16bit_weights_on_model_save: it gathers
the sharded model on rank 0 (get_model_state_dict(full_state_dict=True, cpu_offload=True)), casts floating tensors
to the requested dtype, and writes files that `AutoModelForCausalLM.from_pretrained(dir)` loads (plus config.json
when the model carries a transformers config). Files are written under a temporary name and renamed.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """5_000_000_000, "5GB", "500MiB" -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size={size!r}: use bytes or a string such as '5GB' or '500MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in order: a new shard when the next tensor would overflow the current one."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def write_sharded(out_dir: str | Path, names_sizes: list[tuple[str, int]], load: Callable[[list[str]], dict], *,
                  max_shard_size: int | str = "5GB") -> list[Path]:
    """Write tensors shard by shard; `load(names) -> {name: tensor}` is called once per shard (bounded memory)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(names_sizes, parse_size(max_shard_size))
    files = ([WEIGHTS_NAME] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for stale in list(out_dir.glob("model-*-of-*.safetensors")) + [out_dir / WEIGHTS_NAME, out_dir / INDEX_NAME]:
        if stale.name not in files:
            stale.unlink(missing_ok=True)  # a previous export with another shard count
    weight_map = {}
    for fname, names in zip(files, shards):
        tensors = {k: v.contiguous() for k, v in load(names).items()}
        tmp = out_dir / f".{fname}.tmp"
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, out_dir / fname)
        weight_map.update({k: fname for k in names})
    if len(files) > 1:
        total = sum(n for _, n in names_sizes)
        tmp = out_dir / f".{INDEX_NAME}.tmp"
        tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        os.replace(tmp, out_dir / INDEX_NAME)
    return [out_dir / f for f in files]


def drop_tied_duplicates(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses aliased tensors; transformers re-ties them on load, so keep the first name only."""
    seen, out = set(), {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else None
        if key is not None and key in seen:
            continue
        seen.add(key)
        out[k] = v
    return out


def save_state_dict(state: dict[str, torch.Tensor], out_dir: str | Path, *, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB") -> list[Path]:
    """A full (unsharded) state dict -> safetensors files in out_dir."""
    state = drop_tied_duplicates(state)
    cast = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in state.items()}
    sizes = [(k, v.numel() * v.element_size()) for k, v in cast.items()]
    return write_sharded(out_dir, sizes, lambda names: {k: cast[k] for k in names}, max_shard_size=max_shard_size)


def save_16bit_model(model: torch.nn.Module, save_dir: str | Path, *, dtype: torch.dtype | None = torch.bfloat16,
                     max_shard_size: int | str = "5GB") -> Path | None:
    """Gather the (sharded) model and write it for from_pretrained; collective. Returns save_dir on rank 0."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        first: dict[int, str] = {}  # the gathered copies of tied params are distinct tensors: drop by model aliasing
        for name, p in model.named_parameters(remove_duplicate=False):
            if first.setdefault(id(p), name) != name:
                full.pop(name, None)
        save_state_dict(full, save_dir, dtype=dtype, max_shard_size=max_shard_size)
        config = getattr(model, "config", None)
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(save_dir)
        generation = getattr(model, "generation_config", None)
        if hasattr(generation, "save_pretrained"):
            generation.save_pretrained(save_dir)
    if dist.is_initialized():
        dist.barrier()
    return Path(save_dir) if rank == 0 else None

