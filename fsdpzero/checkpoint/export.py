"""Consolidated weights for `transformers`: model.safetensors, or shards + model.safetensors.index.json above a size.

`save_16bit_model` is DeepSpeed's engine.save_16bit_model / stage3_gather_16bit_weights_on_model_save: it writes
files that `AutoModelForCausalLM.from_pretrained(dir)` loads (plus config.json when the model carries a transformers
config), floating tensors cast to the requested dtype. Unlike DeepSpeed, which gathers the whole model into one
state dict on rank 0, it streams: one parameter at a time is all-gathered, cast and appended to its safetensors file
(the header is known up front), so rank 0 holds one full tensor, not the model. With `offload_param: nvme` each
local shard is read from the swap file (ParamSwapper.read_shard): no unit is brought back into memory.
Files are written under a temporary name and renamed.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
Spec = tuple[str, torch.dtype, tuple[int, ...]]   # name, dtype, shape of one tensor in a file


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


def _nbytes(spec: Spec) -> int:
    return math.prod(spec[2]) * spec[1].itemsize


def check_export_args(filename: str, max_shard_size: int | str) -> int:
    """Bad export arguments, refused on every rank before any gather (a rank-0-only error would hang the others)."""
    if not filename.endswith(".safetensors"):
        raise ValueError(f"filename={filename!r}: fsdpzero writes safetensors (DeepSpeed's default "
                         f"pytorch_model.bin is a pickle); use a name ending in .safetensors")
    return parse_size(max_shard_size)


def write_safetensors(path: str | Path, specs: list[Spec], tensors: Iterable[torch.Tensor]) -> None:
    """A safetensors file written one tensor at a time, in specs order: the header (names, dtypes, shapes, offsets)
    follows from the specs, so only the tensor being written is in memory."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in specs:
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors code")
        nbytes = _nbytes((name, dtype, shape))
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)   # the data starts 8-byte aligned, as safetensors' own writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for (name, dtype, shape), t in zip(specs, tensors, strict=True):
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)}, the header says {dtype} {tuple(shape)}")
            if t.numel():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def write_sharded(out_dir: str | Path, specs: list[Spec], load: Callable[[list[str]], Iterable[torch.Tensor]], *,
                  max_shard_size: int | str = "5GB", filename: str = WEIGHTS_NAME) -> list[Path]:
    """Write tensors file by file; `load(names)` is called once per file and yields its tensors in names' order
    (each is written as it comes, so a generator keeps one tensor in memory)."""
    max_bytes = check_export_args(filename, max_shard_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_name = {spec[0]: spec for spec in specs}
    shards = plan_shards([(spec[0], _nbytes(spec)) for spec in specs], max_bytes)
    files = ([filename] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for stale in list(out_dir.glob("model-*-of-*.safetensors")) + [out_dir / filename, out_dir / INDEX_NAME]:
        if stale.name not in files:
            stale.unlink(missing_ok=True)  # a previous export with another shard count
    weight_map = {}
    for fname, names in zip(files, shards):
        tmp = out_dir / f".{fname}.tmp"
        write_safetensors(tmp, [by_name[n] for n in names], load(names))
        os.replace(tmp, out_dir / fname)
        weight_map.update({k: fname for k in names})
    if len(files) > 1:
        total = sum(_nbytes(spec) for spec in specs)
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
                    max_shard_size: int | str = "5GB", filename: str = WEIGHTS_NAME) -> list[Path]:
    """A full (unsharded) state dict -> safetensors files in out_dir."""
    state = drop_tied_duplicates(state)
    specs = [(k, _out_dtype(v.dtype, dtype), tuple(v.shape)) for k, v in state.items()]
    return write_sharded(out_dir, specs, lambda names: (_cast(state[k], dtype) for k in names),
                         max_shard_size=max_shard_size, filename=filename)


def _out_dtype(have: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    return want if want is not None and have.is_floating_point else have


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(_out_dtype(t.dtype, dtype))


def full_tensor(t: torch.Tensor, swapper=None) -> torch.Tensor:
    """The whole tensor of a parameter or model state-dict entry (collective for a DTensor; every rank gets it).
    A CPU-offloaded shard is moved to the accelerator for the NCCL gather; a shard swapped to NVMe (offload_param
    nvme: `swapper` is the ParamSwapper) is read from its swap file."""
    if not isinstance(t, DTensor):
        return t
    slot = swapper.slot(t) if swapper is not None else None
    local = swapper.read_shard(*slot) if slot is not None else t.to_local()
    if t.device_mesh.device_type != "cpu":   # NCCL gathers device tensors: a CPU-offloaded shard moves for it
        local = local.to(torch.device(t.device_mesh.device_type, torch.cuda.current_device()))
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride()).full_tensor()


def save_16bit_model(model: torch.nn.Module, save_dir: str | Path, *, dtype: torch.dtype | None = torch.bfloat16,
                     max_shard_size: int | str = "5GB", filename: str = WEIGHTS_NAME,
                     exclude_frozen_parameters: bool = False, param_swapper=None) -> Path | None:
    """Gather the (sharded) model and write it for from_pretrained; collective. Returns save_dir on rank 0.
    param_swapper: offload_param nvme's fsdpzero.offload.param_swapper.ParamSwapper, whose shards are read from disk."""
    check_export_args(filename, max_shard_size)

    def lazy():   # inside, the state-dict hooks leave the swapped units on disk
        return param_swapper.lazy() if param_swapper is not None else contextlib.nullcontext()

    with lazy():
        sharded = get_model_state_dict(model)
    first: dict[int, str] = {}  # tied params appear under each name: keep the first, transformers re-ties on load
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name or (exclude_frozen_parameters and not p.requires_grad):
            sharded.pop(name, None)
    specs = [(k, _out_dtype(v.dtype, dtype), tuple(v.shape)) for k, v in sharded.items()]
    rank = dist.get_rank() if dist.is_initialized() else 0

    def gathered(names):   # every rank joins each gather, in the same order; rank 0 writes as they come
        with lazy():
            for k in names:
                full = full_tensor(sharded[k], param_swapper)
                yield _cast(full, dtype).cpu() if rank == 0 else None   # only rank 0 casts and copies

    if rank == 0:
        write_sharded(save_dir, specs, gathered, max_shard_size=max_shard_size, filename=filename)
        config = getattr(model, "config", None)
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(save_dir)
        generation = getattr(model, "generation_config", None)
        if hasattr(generation, "save_pretrained"):
            generation.save_pretrained(save_dir)
    else:
        for _ in gathered(list(sharded)):
            pass
    if dist.is_initialized():
        dist.barrier()
    return Path(save_dir) if rank == 0 else None
