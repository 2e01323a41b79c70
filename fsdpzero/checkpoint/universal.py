"""DeepSpeed universal checkpoints (`python -m deepspeed.checkpoint.ds_to_universal`), read and written without
DeepSpeed.

Layout (DeepSpeed 0.19.8, data-parallel ZeRO): <tag_dir>/mp_rank_00_model_states.pt (module, counters, scheduler,
param_shapes, config) and, per parameter, <tag_dir>/zero/<name>/fp32.pt ({"param": the full fp32 tensor, "cat_dim":
...}) plus one file per optimizer state, exp_avg.pt, exp_avg_sq.pt (or momentum_buffer.pt, ...: {"param": ...}) and
step.pt (a tensor), for trainable ones; <tag_dir>/zero/optimizer_state.pt holds the param groups, the loss scaler and
ds_version. <save_dir>/latest_universal names the tag (DeepSpeed's `checkpoint.load_universal` reads it). From a
ZeRO-3 checkpoint ds_to_universal writes zero_pp_rank_N_mp_rank_00_model_states.pt instead, bare flat tensors and no
step.pt (the step is in optimizer_state.pt's optimizer_state_dict), which DeepSpeed's ZeRO-3 load also expects.

Reading: every file goes through fsdpzero.checkpoint.deepspeed_reader.load_ds_file (weights_only + DeepSpeed
stand-ins) and is checked as DeepSpeed's loader would use it (an fp32 tensor of the shape the model states give, each
state of the weight's size, a step that is a number), one line naming the file otherwise. `training_state` returns
what fsdpzero.checkpoint.deepspeed.training_state returns for a ZeRO checkpoint, so the conversion to our layout
(convert.deepspeed_to_ours) and the Engine's direct load serve both. A universal checkpoint of a DeepSpeed AutoTP
run has one mp_rank_NN_model_states.pt per tensor-parallel rank (slice shapes) and zero/ tensors that ds_to_universal
merged whole by the layout in universal_checkpoint_info: each whole tensor must have the model states' shape
(replicated) or all ranks' slices' elements; it then loads as any whole tensor (resharded onto fsdpzero's own mesh).

Writing (`write_universal`): a training state (ours, read by convert.ours_training_state, or a DeepSpeed ZeRO one)
becomes the files DeepSpeed's engine.load_checkpoint reads with `checkpoint.load_universal: true`: mp_rank_00 model
states (and their ZeRO-3 name), zero/optimizer_state.pt (no `clip_grad`, so DeepSpeed keeps its config's clipping;
the ZeRO-3 step and groups too), zero/<name>/<state>.pt.
An fp16 run's dynamic loss scaler is kept as numbers under `fsdpzero_loss_scaler`, which fsdpzero reads back;
DeepSpeed replaces its scaler only with an instance of its own class, which needs its config's values (window,
minimum, hysteresis) that our checkpoints do not hold, so DeepSpeed starts its scaler afresh from its config. A state
saved before the optimizer's first step (fsdpzero's "unstepped" mark: zeroed states) keeps its mark as
`fsdpzero_unstepped` in optimizer_state.pt, which DeepSpeed ignores and this reader turns back into the mark: a
resumed SGD with dampening then starts its momentum from the first gradient, as the uninterrupted run does (zeros
would be exact for AdamW only).
"""
from __future__ import annotations

import collections
import math
import os
import re
import secrets
import shutil
from pathlib import Path

import torch

from fsdpzero.checkpoint.deepspeed_reader import (DS_MODEL_KEYS, MalformedCheckpointError, UnsafeCheckpointError,
                                                  checked, load_ds_file)

ZERO_DIR = "zero"
COMMON = "optimizer_state.pt"
FP32 = "fp32"
STEP = "step"
UNSTEPPED_KEY = "fsdpzero_unstepped"   # in zero/optimizer_state.pt: the states were saved before the first step
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"   # where DeepSpeed's ZeRO-3 universal load looks
OWN_LOSS_SCALER = "fsdpzero_loss_scaler"   # in zero/optimizer_state.pt: an fp16 run's dynamic scaler, as numbers
DS_FORMAT_VERSION = "0.19.8"           # the DeepSpeed version whose universal format is written (its ds_version)
# torch optimizer flags that say how a step is computed, not what it computes: the loading side keeps its own
IMPL_FLAGS = ("foreach", "fused", "capturable", "differentiable")
_STATE_FILE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.pt")


def is_universal(tag_dir: str | Path) -> bool:
    zero = Path(tag_dir) / ZERO_DIR
    return zero.is_dir() and any(zero.glob(f"*/{FP32}.pt"))


def _safe_name(name: str, where) -> str:
    if not name or "/" in name or "\\" in name or name.startswith(".") or "\x00" in name:
        raise UnsafeCheckpointError(f"{where}: parameter name {name!r} is not a directory of {ZERO_DIR}/")
    return name


def _slice_shape(meta: dict, name: str, default: tuple) -> tuple:
    """A parameter's shape in one tensor-parallel rank's model states (its slice)."""
    for group in meta.get("param_shapes") or []:
        if isinstance(group, dict) and name in group:
            shape = group[name]
            break
    else:
        shape = (meta.get("frozen_param_shapes") or {}).get(name, default)
    if not isinstance(shape, (list, tuple, torch.Size)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise MalformedCheckpointError(f"shape of {name!r} is {shape!r:.60}; a list of sizes")
    return tuple(shape)


def _param(path: Path) -> torch.Tensor:
    """The tensor of a zero/<name>/<state>.pt: {"param": tensor, ...}, or (ZeRO-3's ds_to_universal) the bare
    flat tensor."""
    entry = load_ds_file(path)
    tensor = entry.get("param") if isinstance(entry, dict) else entry
    if not torch.is_tensor(tensor) or not tensor.is_floating_point():
        raise MalformedCheckpointError(f"{path}: no floating 'param' tensor in this universal checkpoint file")
    return tensor


def _step(path: Path):
    step = load_ds_file(path)
    if torch.is_tensor(step) and step.numel() == 1:
        return step.detach().clone().float().reshape(())
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        return torch.tensor(float(step))
    raise MalformedCheckpointError(f"{path}: the step is {type(step).__name__}, not a number")


def _common_step(common: dict, path: Path):
    """The step a ZeRO-3 universal checkpoint keeps once, in optimizer_state.pt's optimizer_state_dict (None if
    absent)."""
    inner = common.get("optimizer_state_dict")
    state = inner.get("state") if isinstance(inner, dict) else None
    first = state.get(0) if isinstance(state, dict) else None
    step = first.get(STEP) if isinstance(first, dict) else None
    if step is None:
        return None
    if torch.is_tensor(step) and step.numel() == 1:
        return step.detach().clone().float().reshape(())
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        return torch.tensor(float(step))
    raise MalformedCheckpointError(f"{path}: optimizer_state_dict's step is {type(step).__name__}, not a number")


@checked
def training_state(tag_dir: str | Path) -> dict:
    """fp32 weights, optimizer states by name, hyperparameters, scaler, counters of a universal checkpoint."""
    tag_dir = Path(tag_dir)
    found = sorted(tag_dir.glob("*_model_states.pt"))
    mp = [f for f in found if re.fullmatch(r"mp_rank_\d+_model_states\.pt", f.name)]
    zero3 = [f for f in found if re.fullmatch(r"zero_pp_rank_\d+_mp_rank_00_model_states\.pt", f.name)]
    if mp and len(mp) + len(zero3) == len(found):   # mp_rank_NN (and ours: a copy for DeepSpeed's ZeRO-3 load)
        model_files = mp
    elif zero3 and len(zero3) == len(found) and (tag_dir / ZERO3_MODEL_STATES).is_file():
        model_files = [tag_dir / ZERO3_MODEL_STATES]   # DeepSpeed's ZeRO-3 universal: rank 0's model states
    else:
        model_files = []
    if not model_files or (model_files == mp and [f.name for f in mp] != [f"mp_rank_{i:02d}_model_states.pt"
                                                                         for i in range(len(mp))]):
        raise NotImplementedError(f"{tag_dir}: universal checkpoints with {[f.name for f in found]} are not "
                                  f"supported; mp_rank_00_model_states.pt, and one more per tensor-parallel rank "
                                  f"(no pipeline stages, no expert files), are")
    metas = [load_ds_file(f) for f in model_files]
    for f, m in zip(model_files, metas):
        if not isinstance(m, dict):
            raise MalformedCheckpointError(f"{f}: not a dict of model states")
    meta = metas[0]
    if len(metas) > 1 and not isinstance(meta.get("universal_checkpoint_info"), dict):
        # DeepSpeed merges tensor-parallel slices only by the layout its AutoTP records there
        raise NotImplementedError(f"{tag_dir}: {len(metas)} tensor-parallel model-state files without DeepSpeed's "
                                  f"universal_checkpoint_info; not a ds_to_universal output of an AutoTP run")
    common = load_ds_file(tag_dir / ZERO_DIR / COMMON) if (tag_dir / ZERO_DIR / COMMON).is_file() else {}
    if not isinstance(common, dict):
        raise MalformedCheckpointError(f"{tag_dir / ZERO_DIR / COMMON}: not a dict of optimizer state")
    groups = meta.get("param_shapes") or []
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise MalformedCheckpointError(f"{model_files[0]}: `param_shapes` is not a list of {{name: shape}}")
    shapes = {}
    for name, shape in [item for g in groups for item in g.items()] + list(
            (meta.get("frozen_param_shapes") or {}).items()):
        if not isinstance(shape, (list, tuple, torch.Size)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise MalformedCheckpointError(f"{model_files[0]}: shape of {name!r} is {shape!r:.60}; a list of sizes")
        shapes[name] = tuple(shape)
    # AutoTP: each mp_rank file gives that rank's slice shapes; the zero/ tensors are the merged, whole ones
    slice_numel = {name: sum(math.prod(_slice_shape(m, name, shape)) for m in metas) for name, shape in shapes.items()}
    trainable = [name for g in groups for name in g]
    common_step = _common_step(common, tag_dir / ZERO_DIR / COMMON)   # ZeRO-3's: one step, no step.pt
    weights, states = {}, {}
    zero = tag_dir / ZERO_DIR
    for name in list(shapes) + sorted(p.name for p in zero.iterdir() if p.is_dir()):
        pdir = zero / _safe_name(name, tag_dir)   # names come from the files: stay inside zero/
        if name in weights or not (pdir / f"{FP32}.pt").is_file():
            continue
        weights[name] = _param(pdir / f"{FP32}.pt").float()
        if name in shapes and weights[name].dim() == 1 and weights[name].numel() == math.prod(shapes[name]):
            weights[name] = weights[name].reshape(shapes[name])   # ZeRO-3's flat fp32
        # whole: the model states' shape (one file, or a tensor-parallel-replicated one), or all ranks' slices
        if name in shapes and tuple(weights[name].shape) != shapes[name] and (
                len(metas) == 1 or weights[name].numel() != slice_numel[name]):
            raise MalformedCheckpointError(f"{pdir / 'fp32.pt'}: shape {tuple(weights[name].shape)}, the model states "
                                           f"say {shapes[name]}" + (" (a tensor-parallel slice?)" if len(metas) == 1
                                                                    else f" on each of {len(metas)} tensor-parallel "
                                                                    f"ranks"))
        entry = {}
        for f in sorted(pdir.iterdir()):
            key = f.name[:-3]
            if f.name in (f"{FP32}.pt", f"{STEP}.pt") or not f.name.endswith(".pt"):
                continue
            if not _STATE_FILE.fullmatch(f.name) or not f.is_file():
                raise UnsafeCheckpointError(f"{f}: not an optimizer state file name DeepSpeed writes")
            value = _param(f)
            if value.numel() != weights[name].numel():
                raise MalformedCheckpointError(f"{f}: {value.numel()} elements, the weight has "
                                               f"{weights[name].numel()} (a tensor-parallel slice?)")
            entry[key] = value.float().reshape(weights[name].shape)
        if entry:
            entry[STEP] = _step(pdir / f"{STEP}.pt") if (pdir / f"{STEP}.pt").is_file() else common_step
            if entry[STEP] is None and {"exp_avg", "exp_avg_sq"} <= set(entry):
                raise MalformedCheckpointError(f"{pdir}: Adam moments without step.pt")
            if entry[STEP] is None:
                del entry[STEP]
            states[name] = entry
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise MalformedCheckpointError(f"{zero}: no fp32.pt for {missing[:4]}: an incomplete universal checkpoint")
    buffers = set(meta.get("buffer_names") or [])
    for k, v in (meta.get("module") or {}).items():   # buffers, as zero_to_fp32 keeps them (float)
        if k in buffers and torch.is_tensor(v):
            weights[k] = v.float() if v.is_floating_point() else v
    for alias, source in (meta.get("shared_params") or {}).items():
        if source in weights and alias not in weights:
            weights[alias] = weights[source]
    scaler = common.get("loss_scaler")
    scaler = (None if scaler is None or not getattr(scaler, "dynamic", False) and getattr(scaler, "cur_scale", 1.0)
              == 1.0 else {k: v for k, v in vars(scaler).items() if not isinstance(v, torch.dtype)})
    if scaler is None and isinstance(common.get(OWN_LOSS_SCALER), dict):
        scaler = dict(common[OWN_LOSS_SCALER])
    param_groups = common.get("param_groups", [])
    if not isinstance(param_groups, list) or not all(isinstance(g, dict) for g in param_groups):
        raise MalformedCheckpointError(f"{zero / COMMON}: `param_groups` is not a list of dicts")
    return {
        "stage": int(common.get("zero_stage", 0)), "world_size": int(meta.get("dp_world_size", 1)) * len(metas),
        "tag": tag_dir.name, "weights": weights, "trainable": trainable,
        "adam": {n: s for n, s in states.items() if {"exp_avg", "exp_avg_sq", STEP} <= set(s)},
        "other_states": {n: s for n, s in states.items() if not {"exp_avg", "exp_avg_sq", STEP} <= set(s)},
        "unstepped": common.get(UNSTEPPED_KEY) is True,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in param_groups],
        "loss_scaler": scaler, "lr_scheduler": meta.get("lr_scheduler"),
        "counters": {k: meta.get(k) for k in ("global_steps", "global_samples", "skipped_steps")},
        "data_sampler": meta.get("data_sampler"),
        "client_state": {k: v for k, v in meta.items() if k not in DS_MODEL_KEYS},
        "ds_config": meta.get("ds_config"),
    }


# ---- writing ----------------------------------------------------------------------------------------------------

def _save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_universal(st: dict, save_dir: str | Path, tag: str) -> Path:
    """Write training state `st` as DeepSpeed universal checkpoint <save_dir>/<tag>/ and point
    <save_dir>/latest_universal at it. The tag directory appears whole or not at all (written into a temp dir beside
    it, fsynced, renamed); an existing <save_dir>/<tag> is refused, never overwritten.

    st: {"weights": {name: tensor} (fp32 masters of trainable and frozen parameters, buffers), "trainable": [names
    in optimizer order], "states": {name: {state key: tensor of the weight's size, "step": number}}, "unstepped":
    bool, "param_groups": [one dict of hyperparameters], "counters": {global_steps, global_samples, skipped_steps},
    "lr_scheduler": DeepSpeed scheduler state or None, "loss_scaler": dict or None, "world_size": int,
    "buffers": [names of buffers among weights], "shared": {alias: source} (None or absent: a non-trainable weight
    bit-identical to a trainable one of the same shape is taken as its tied alias, as DeepSpeed's shared_params)}."""
    from fsdpzero.checkpoint.files import LATEST_UNIVERSAL, check_tag, fsync_path, write_atomic
    save_dir, tag = Path(save_dir), check_tag(tag)
    weights, trainable = st["weights"], list(st["trainable"])
    if len(st["param_groups"]) != 1:
        raise NotImplementedError(f"{len(st['param_groups'])} optimizer param groups; the universal writer supports "
                                  f"one (as the DeepSpeed-to-DCP conversion does)")
    missing = [n for n in trainable if n not in weights]
    if missing:
        raise ValueError(f"no weight for trainable parameter(s) {missing[:4]}")
    out = save_dir / tag
    if out.exists() or out.is_symlink():
        raise FileExistsError(f"{out} exists; pass another --out (a universal checkpoint is never written over "
                              f"another)")
    save_dir.mkdir(parents=True, exist_ok=True)
    tmp = save_dir / f".tmp-{tag}.{secrets.token_hex(8)}"
    try:
        (tmp / ZERO_DIR).mkdir(parents=True)
        buffers = list(st.get("buffers") or [])
        shared = st.get("shared")
        if shared is None:   # a tied weight (lm_head of wte) is in the state twice, once without optimizer state
            shared = {n: t for n in weights if n not in trainable and n not in buffers for t in trainable
                      if weights[t].shape == weights[n].shape and torch.equal(weights[t], weights[n])}
        frozen = [n for n in weights if n not in trainable and n not in buffers and n not in shared]
        for name in trainable + frozen:
            pdir = tmp / ZERO_DIR / _safe_name(name, "write_universal")
            pdir.mkdir()
            w = weights[name].detach().float().contiguous()
            _save({"param": w, "cat_dim": 0}, pdir / f"{FP32}.pt")
            for key, value in (st["states"].get(name) or {}).items():
                if key == STEP:
                    _save(value.detach().float().reshape(()).clone() if torch.is_tensor(value)
                          else torch.tensor(float(value)), pdir / f"{STEP}.pt")
                elif torch.is_tensor(value):
                    if value.numel() != w.numel() or not _STATE_FILE.fullmatch(f"{key}.pt"):
                        raise ValueError(f"optimizer state {key!r} of {name!r}: {value.numel()} elements for a "
                                         f"weight of {w.numel()}; only per-element states are written")
                    _save({"param": value.detach().float().reshape(w.shape).contiguous(), "cat_dim": 0},
                          pdir / f"{key}.pt")
        group = {k: v for k, v in st["param_groups"][0].items() if k != "params" and k not in IMPL_FLAGS}
        group["params"] = [0]
        world = int(st.get("world_size") or 1)
        steps = [v for n in trainable for k, v in (st["states"].get(n) or {}).items() if k == STEP]
        step = (steps[0].detach().float().reshape(()).clone() if steps and torch.is_tensor(steps[0])
                else torch.tensor(float(steps[0] if steps else 0)))
        common = {"dynamic_loss_scale": bool(st.get("loss_scaler") and st["loss_scaler"].get("dynamic", True)),
                  "overflow": False, "ds_version": DS_FORMAT_VERSION, "partition_count": [world],
                  "param_groups": [group],
                  # what DeepSpeed's ZeRO-3 universal load reads instead: the step and the hyperparameters
                  "optimizer_state_dict": {"state": {0: {STEP: step}}, "param_groups": [group]}}
        if st.get("loss_scaler"):   # see the module doc: DeepSpeed starts its own scaler from its config
            common[OWN_LOSS_SCALER] = {k: v for k, v in st["loss_scaler"].items()
                                       if isinstance(v, (int, float, bool, type(None)))}
        if st.get("unstepped"):
            common[UNSTEPPED_KEY] = True
        _save(common, tmp / ZERO_DIR / COMMON)
        counters = st.get("counters") or {}
        module = collections.OrderedDict((k, v.detach().contiguous()) for k, v in weights.items()
                                         if k not in shared)
        meta = {
            "module": module, "buffer_names": buffers, "optimizer": None,
            "param_shapes": [collections.OrderedDict((n, torch.Size(weights[n].shape)) for n in trainable)],
            "frozen_param_shapes": collections.OrderedDict((n, torch.Size(weights[n].shape)) for n in frozen),
            "shared_params": shared, "frozen_param_fragments": collections.OrderedDict(),
            "lr_scheduler": st.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
            "skipped_steps": int(counters.get("skipped_steps") or 0),
            "global_steps": int(counters.get("global_steps") or 0),
            "global_samples": int(counters.get("global_samples") or 0),
            "dp_world_size": world, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": st.get("ds_config"), "ds_version": DS_FORMAT_VERSION,
        }
        _save(meta, tmp / "mp_rank_00_model_states.pt")
        # DeepSpeed's ZeRO-3 universal load reads its model states from this name (ds_to_universal copies them so)
        shutil.copyfile(tmp / "mp_rank_00_model_states.pt", tmp / ZERO3_MODEL_STATES)
        for d in [tmp / ZERO_DIR, *(p for p in (tmp / ZERO_DIR).iterdir() if p.is_dir())]:
            fsync_path(d)
        os.rename(tmp, out)
        fsync_path(save_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(save_dir / LATEST_UNIVERSAL, tag)
    return out
