"""Convert a DeepSpeed ZeRO 0-3 checkpoint to fp32 weights (what `zero_to_fp32` gives), Adam states and the rest
of a training state, without DeepSpeed. The files are read by fsdpzero.checkpoint.deepspeed_reader (allowlisted
unpickler).

Layout facts (shared/spec/ds_config_map.md §4): stage <= 2 keeps one flat fp32 partition per param group and rank,
params laid out in `param_shapes` order (each followed by its alignment padding); stage 3 keeps per rank the
ceil(numel / W) elements of every param at one running offset over the rank's flat sub-groups. Adam moments use
exactly the same flat layout as the fp32 masters, so one unflatten serves weights and moments.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

# the reader's public names are imported from here too (convert, tests, docs/checkpoint.md)
from fsdpzero.checkpoint.deepspeed_reader import (ALLOWED_GLOBALS, DS_MODEL_KEYS, DeepSpeedCheckpoint,
                                                  MalformedCheckpointError, UnsafeCheckpointError, checked,
                                                  load_ds_file, read_checkpoint, resolve_tag_dir)

__all__ = ["ALLOWED_GLOBALS", "DeepSpeedCheckpoint", "MalformedCheckpointError", "UnsafeCheckpointError",
           "load_ds_file", "read_checkpoint",
           "resolve_tag_dir", "fp32_state_dict", "adam_states", "param_groups", "loss_scaler_state", "training_state"]


def _unflatten_zero2(per_rank: list[list[torch.Tensor]], param_shapes: list[dict], paddings, world: int) -> dict:
    """Stage <= 2: per group, the ranks' partitions concatenated hold the params back to back (plus paddings)."""
    out = {}
    for g, shapes in enumerate(param_shapes):
        flat = torch.cat([rank_groups[g] for rank_groups in per_rank])
        pads = paddings[g] if paddings is not None else [0] * len(shapes)
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads):
            numel = math.prod(shape)
            _fits(name, shape, offset, numel, flat.numel())
            out[name] = flat.narrow(0, offset, numel).view(shape)
            offset += numel + pad
        align = 2 * world  # groups are padded to a multiple of 2 * world size
        if math.ceil(offset / align) * align != math.ceil(flat.numel() / align) * align:
            raise ValueError(f"group {g}: params use {offset} elements, the partitions hold {flat.numel()}")
    return out


def _unflatten_zero3(per_rank: list[list[torch.Tensor]], param_shapes: list[dict], world: int) -> dict:
    """Stage 3: each param holds ceil(numel / W) elements per rank at the same offset in every rank's groups."""
    rank_flat = [torch.cat(groups) if len(groups) > 1 else groups[0] for groups in per_rank]
    out, offset = {}, 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            _fits(name, shape, offset, part, min(flat.numel() for flat in rank_flat))
            pieces = [flat.narrow(0, offset, part) for flat in rank_flat]
            out[name] = torch.cat(pieces).narrow(0, 0, numel).view(shape)
            offset += part
    if offset != rank_flat[0].numel():
        raise ValueError(f"stage 3: params use {offset} elements per rank, the flat groups hold {rank_flat[0].numel()}")
    return out


def _fits(name: str, shape, offset: int, numel: int, available: int) -> None:
    if offset + numel > available:
        raise MalformedCheckpointError(f"parameter {name!r} of shape {tuple(shape)} needs {numel} elements at offset "
                                       f"{offset}, the flat partition holds {available}")


def _unflatten(ckpt: DeepSpeedCheckpoint, per_rank: list[list[torch.Tensor]]) -> dict:
    shapes = ckpt.meta["param_shapes"]
    if ckpt.stage == 3:
        return _unflatten_zero3(per_rank, shapes, ckpt.world_size)
    paddings = ckpt.optim_states[0].get("param_alignment_paddings")
    return _unflatten_zero2(per_rank, shapes, paddings, ckpt.world_size)


def _flat_key(stage: int) -> str:
    return "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"


def _frozen_params(ckpt: DeepSpeedCheckpoint) -> dict:
    shapes = ckpt.meta.get("frozen_param_shapes") or {}
    out = {}
    for name, shape in shapes.items():
        if ckpt.stage == 3:  # per-rank fragments, concatenated and trimmed
            flat = torch.cat([ms["frozen_param_fragments"][name].reshape(-1) for ms in ckpt.model_states])
            out[name] = flat.narrow(0, 0, math.prod(shape)).view(shape)
        else:                # stored whole
            out[name] = ckpt.meta["frozen_param_fragments"][name]
    return out


@checked
def fp32_state_dict(ckpt: DeepSpeedCheckpoint | str | Path, tag: str | None = None, *,
                    include_module_params: bool = False, trainable_names: list[str] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The consolidated weights, equal to DeepSpeed's zero_to_fp32 (same keys, dtypes and bits) for ZeRO 1-3.

    Like zero_to_fp32: buffers cast to float, frozen params in their saved 16-bit dtype, tied params aliased.
    include_module_params also adds params found only in `module` (stage 1 does not record frozen params).
    Stage 0 (which zero_to_fp32 rejects): `module`, with the fp32 masters of a 16-bit run put in.
    """
    if not isinstance(ckpt, DeepSpeedCheckpoint):
        ckpt = read_checkpoint(ckpt, tag)
    meta = ckpt.meta
    if ckpt.stage == 0:
        return _stage0_weights(ckpt, trainable_names)
    out = {k: (v.float() if v.is_floating_point() else v)
           for k, v in meta["module"].items() if k in set(meta.get("buffer_names") or [])}
    out.update(_frozen_params(ckpt))
    out.update(_unflatten(ckpt, [os_[_flat_key(ckpt.stage)] for os_ in ckpt.optim_states]))
    for alias, source in (meta.get("shared_params") or {}).items():
        if source in out:
            out[alias] = out[source]
    if include_module_params:
        for k, v in meta["module"].items():
            out.setdefault(k, v)
    return out


# ---- stage 0: the whole model on every rank, a torch optimizer indexed by position ------------------------------
# fp32: `optimizer` is the torch optimizer's state_dict. fp16/bf16: an FP16 optimizer wrapper whose
# `optimizer_state_dict` is the torch one, with the fp32 masters per param (`fp32_groups`, unfused) or one flat
# tensor per group (`fp32_groups_flat`, fused). Parameter names are not stored: the i-th optimizer param is the i-th
# trainable parameter of the model. Without the model, they are matched to `module`'s tensors in order (tied
# aliases skipped, frozen params skipped where the shapes tell them apart); pass trainable_names to be exact.

def _stage0_parts(ckpt: DeepSpeedCheckpoint) -> tuple[dict, dict | None]:
    opt = ckpt.meta["optimizer"]
    return (opt["optimizer_state_dict"], opt) if "optimizer_state_dict" in opt else (opt, None)


def _module_params(ckpt: DeepSpeedCheckpoint) -> list[tuple[str, torch.Tensor]]:
    """`module` entries that are parameters, tied aliases dropped (they share storage in the file)."""
    buffers, seen, out = set(ckpt.meta.get("buffer_names") or []), set(), []
    for k, v in ckpt.meta["module"].items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        if k in buffers or key in seen:
            continue
        seen.add(key)
        out.append((k, v))
    return out


def _stage0_names(ckpt: DeepSpeedCheckpoint, shapes: list[torch.Size], trainable: list[str] | None) -> list[str]:
    if trainable is not None:
        if len(trainable) != len(shapes):
            raise ValueError(f"{ckpt.tag_dir}: {len(shapes)} optimizer params but {len(trainable)} trainable_names")
        return list(trainable)
    candidates, names, ci = _module_params(ckpt), [], 0
    for i, shape in enumerate(shapes):
        while ci < len(candidates) and candidates[ci][1].shape != shape:
            ci += 1  # a frozen param: no optimizer entry
        if ci == len(candidates):
            raise ValueError(f"{ckpt.tag_dir}: cannot match stage-0 optimizer param {i} {tuple(shape)} to a "
                             f"parameter of `module`; pass trainable_names (the trainable parameter names in order)")
        names.append(candidates[ci][0])
        ci += 1
    return names


def _stage0_masters(ckpt: DeepSpeedCheckpoint, trainable: list[str] | None) -> dict[str, torch.Tensor]:
    """name -> fp32 master (16-bit runs) or the fp32 weight itself (fp32 runs)."""
    torch_sd, wrapper = _stage0_parts(ckpt)
    if wrapper is None:
        names = _stage0_names(ckpt, [torch_sd["state"][i]["exp_avg"].shape for i in sorted(torch_sd["state"])],
                              trainable)
        module = dict(ckpt.meta["module"])
        return {n: module[n] for n in names}
    if "fp32_groups" in wrapper:
        masters = [t for group in wrapper["fp32_groups"] for t in group]
        names = _stage0_names(ckpt, [t.shape for t in masters], trainable)
        return dict(zip(names, masters))
    flats = wrapper["fp32_groups_flat"]  # fused: params of each group back to back
    params = _module_params(ckpt)
    if trainable is None and sum(f.numel() for f in flats) != sum(v.numel() for _, v in params):
        raise ValueError(f"{ckpt.tag_dir}: a fused stage-0 checkpoint with frozen params: pass trainable_names")
    shapes = {k: v.shape for k, v in params}
    names = list(trainable) if trainable is not None else [k for k, _ in params]
    out, it = {}, iter(names)
    for flat in flats:
        offset = 0
        while offset < flat.numel():
            name = next(it)
            numel = math.prod(shapes[name])
            out[name] = flat.narrow(0, offset, numel).view(shapes[name])
            offset += numel
    return out


def _stage0_weights(ckpt: DeepSpeedCheckpoint, trainable: list[str] | None = None) -> dict:
    module = ckpt.meta["module"]
    out = {k: (v.float() if v.is_floating_point() else v) if k in set(ckpt.meta.get("buffer_names") or []) else v
           for k, v in module.items()}
    masters = _stage0_masters(ckpt, trainable)
    for k, v in module.items():  # tied aliases follow their source
        for name, master in masters.items():
            if k != name and v.untyped_storage().data_ptr() == module[name].untyped_storage().data_ptr():
                out[k] = master
    out.update(masters)
    return out


def _stage0_adam(ckpt: DeepSpeedCheckpoint, trainable: list[str] | None) -> dict[str, dict]:
    torch_sd, wrapper = _stage0_parts(ckpt)
    masters = _stage0_masters(ckpt, trainable)
    state = torch_sd["state"]
    if wrapper is not None and "fp32_groups_flat" in wrapper:  # one flat state per group: split like the masters
        out, names = {}, iter(masters)
        for g in sorted(state):
            offset = 0
            while offset < state[g]["exp_avg"].numel():
                name = next(names)
                numel = masters[name].numel()
                out[name] = {"step": state[g]["step"].clone(),
                             **{k: state[g][k].narrow(0, offset, numel).view(masters[name].shape)
                                for k in ("exp_avg", "exp_avg_sq")}}
                offset += numel
        return out
    return {name: dict(state[idx]) for name, idx in zip(masters, sorted(state))}


@checked
def adam_states(ckpt: DeepSpeedCheckpoint, trainable_names: list[str] | None = None) -> dict[str, dict]:
    """Per trainable parameter: {"step", "exp_avg", "exp_avg_sq"} (fp32, full shape), as torch.optim.Adam(W) keeps."""
    if ckpt.stage == 0:
        return _stage0_adam(ckpt, trainable_names)
    if ckpt.stage == 3:
        inner = [os_["optimizer_state_dict"]["state"] for os_ in ckpt.optim_states]
    else:
        inner = [os_["base_optimizer_state"]["state"] for os_ in ckpt.optim_states]
    flat_fp32 = [os_[_flat_key(ckpt.stage)] for os_ in ckpt.optim_states]
    moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        # a moment is as long as its fp32 partition (trim any trailing padding the optimizer kept)
        per_rank = [[st[g][key].narrow(0, 0, flat_fp32[r][g].numel()) for g in sorted(st)]
                    for r, st in enumerate(inner)]
        moments[key] = _unflatten(ckpt, per_rank)
    step = inner[0][min(inner[0])]["step"]
    return {name: {"step": step.clone() if torch.is_tensor(step) else torch.tensor(float(step)),
                   "exp_avg": moments["exp_avg"][name], "exp_avg_sq": moments["exp_avg_sq"][name]}
            for name in moments["exp_avg"]}


@checked
def param_groups(ckpt: DeepSpeedCheckpoint) -> list[dict]:
    """Optimizer hyperparameters per DeepSpeed param group (lr, betas, eps, weight_decay, ...), without `params`."""
    if ckpt.stage == 0:
        groups = _stage0_parts(ckpt)[0]["param_groups"]
    elif ckpt.stage == 3:
        groups = ckpt.optim_states[0]["optimizer_state_dict"]["param_groups"]
    else:
        groups = ckpt.optim_states[0]["base_optimizer_state"]["param_groups"]
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


@checked
def loss_scaler_state(ckpt: DeepSpeedCheckpoint) -> dict | None:
    """fp16 dynamic loss scaler attributes (cur_scale, cur_iter, last_overflow_iter, ...) or None."""
    if ckpt.stage == 0:  # the FP16 wrapper keeps the scaler's fields itself
        wrapper = _stage0_parts(ckpt)[1] or {}
        if not wrapper.get("dynamic_loss_scale") and wrapper.get("cur_scale", 1.0) == 1.0:
            return None
        keys = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")
        return {"dynamic": bool(wrapper.get("dynamic_loss_scale")), **{k: wrapper[k] for k in keys if k in wrapper}}
    scaler = ckpt.optim_states[0].get("loss_scaler")
    if scaler is None or not getattr(scaler, "dynamic", False) and getattr(scaler, "cur_scale", 1.0) == 1.0:
        return None
    return {k: v for k, v in vars(scaler).items() if not isinstance(v, torch.dtype)}




@checked
def training_state(ds_dir: str | Path, tag: str | None = None, trainable_names: list[str] | None = None) -> dict:
    """Everything needed to resume: fp32 weights, Adam states by name, hyperparameters, scaler, counters. A universal
    checkpoint (ds_to_universal's output) is read by fsdpzero.checkpoint.universal into the same shape."""
    from fsdpzero.checkpoint import universal
    tag_dir = resolve_tag_dir(ds_dir, tag)
    if universal.is_universal(tag_dir):
        return _checked_state(tag_dir, universal.training_state(tag_dir))
    ckpt = read_checkpoint(tag_dir)
    meta = ckpt.meta
    return _checked_state(tag_dir, {
        "stage": ckpt.stage, "world_size": ckpt.world_size, "tag": ckpt.tag_dir.name,
        "weights": fp32_state_dict(ckpt, include_module_params=True, trainable_names=trainable_names),
        "adam": adam_states(ckpt, trainable_names),
        "param_groups": param_groups(ckpt),
        "loss_scaler": loss_scaler_state(ckpt),
        "lr_scheduler": meta.get("lr_scheduler"),
        "counters": {k: meta.get(k) for k in ("global_steps", "global_samples", "skipped_steps")},
        "data_sampler": meta.get("data_sampler"),
        "client_state": {k: v for k, v in meta.items() if k not in DS_MODEL_KEYS},
        "ds_config": meta.get("ds_config"),
    })


def _checked_state(where, st: dict) -> dict:
    """What the converters take from a training state has the types they use: tensors by name, Adam states of
    tensors, param groups as dicts (else one line naming the entry, not an AttributeError later)."""
    for name, v in st["weights"].items():
        if not torch.is_tensor(v):
            raise MalformedCheckpointError(f"{where}: weight {name!r} is a {type(v).__name__}, not a tensor")
    for name, s in st["adam"].items():
        if not isinstance(s, dict) or not all(torch.is_tensor(s.get(k)) for k in ("exp_avg", "exp_avg_sq")):
            raise MalformedCheckpointError(f"{where}: the Adam state of {name!r} has no exp_avg/exp_avg_sq tensors")
        if not torch.is_tensor(s.get("step")) and not isinstance(s.get("step"), (int, float)):
            raise MalformedCheckpointError(f"{where}: the Adam state of {name!r} has no step")
    if not isinstance(st["param_groups"], list) or not all(isinstance(g, dict) for g in st["param_groups"]):
        raise MalformedCheckpointError(f"{where}: the optimizer's param_groups are not a list of dicts")
    for g in st["param_groups"]:   # what the resumed optimizer computes with: numbers, not whatever the file holds
        for key in ("lr", "eps", "weight_decay"):
            if key in g and not _number(g[key]):
                raise MalformedCheckpointError(f"{where}: param group {key} is {g[key]!r:.60}, not a number")
        if "betas" in g and not (isinstance(g["betas"], (list, tuple)) and len(g["betas"]) == 2
                                 and all(_number(b) for b in g["betas"])):
            raise MalformedCheckpointError(f"{where}: param group betas is {g['betas']!r:.60}, not two numbers")
    for name, s in st["adam"].items():
        if not _number(s["step"]):
            raise MalformedCheckpointError(f"{where}: the Adam step of {name!r} is {s['step']!r:.60}, not a number")
    for key, v in st["counters"].items():
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63):
            raise MalformedCheckpointError(f"{where}: `{key}` is {v!r:.60}, not a step count")
    for key, v in (st["loss_scaler"] or {}).items():
        if not _number(v) and not isinstance(v, (bool, type(None))):
            raise MalformedCheckpointError(f"{where}: the loss scaler's {key} is {v!r:.60}, not a number")
    return st


def _number(v) -> bool:
    """A finite int/float or a one-element tensor of one (what optimizers and scalers keep)."""
    if torch.is_tensor(v):
        return v.numel() == 1 and bool(torch.isfinite(v.float()).all())
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
