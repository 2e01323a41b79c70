"""DeepSpeed universal checkpoints (`python -m deepspeed.checkpoint.ds_to_universal`), read without DeepSpeed.

Layout: <tag_dir>/mp_rank_00_model_states.pt (module, counters, scheduler, config) and, per parameter,
<tag_dir>/zero/<name>/fp32.pt ({"param": the full fp32 tensor, ...}), exp_avg.pt, exp_avg_sq.pt ({"param": ...}) and
step.pt (a tensor) for trainable ones; <tag_dir>/zero/optimizer_state.pt holds the param groups and the loss scaler.
Every file goes through fsdpzero.checkpoint.deepspeed_reader.load_ds_file (weights_only + DeepSpeed stand-ins).
`training_state` returns what fsdpzero.checkpoint.deepspeed.training_state returns for a ZeRO checkpoint, so the
conversion to our layout (convert.deepspeed_to_ours) and the Engine's direct load serve both. Tensor-parallel
slices (mp_rank > 0, "cat_dim" merges across TP ranks) are not read: data-parallel ZeRO only, as for ZeRO files.
"""
from __future__ import annotations

from pathlib import Path

import torch

from fsdpzero.checkpoint.deepspeed_reader import DS_MODEL_KEYS, UnsafeCheckpointError, checked, load_ds_file

ZERO_DIR = "zero"
COMMON = "optimizer_state.pt"


def is_universal(tag_dir: str | Path) -> bool:
    zero = Path(tag_dir) / ZERO_DIR
    return zero.is_dir() and any(zero.glob("*/fp32.pt"))


def _param(path: Path) -> torch.Tensor:
    entry = load_ds_file(path)
    tensor = entry.get("param") if isinstance(entry, dict) else None
    if not torch.is_tensor(tensor):
        raise ValueError(f"{path}: no 'param' tensor in this universal checkpoint file")
    return tensor


@checked
def training_state(tag_dir: str | Path) -> dict:
    """fp32 weights, Adam states by name, hyperparameters, scaler, counters of a universal checkpoint."""
    tag_dir = Path(tag_dir)
    model_files = sorted(tag_dir.glob("*_model_states.pt"))
    if [f.name for f in model_files] != ["mp_rank_00_model_states.pt"]:
        raise NotImplementedError(f"{tag_dir}: universal checkpoints with {[f.name for f in model_files]} are not "
                                  f"supported; one mp_rank_00_model_states.pt (no tensor/pipeline parallelism) is")
    meta = load_ds_file(model_files[0])
    common = load_ds_file(tag_dir / ZERO_DIR / COMMON) if (tag_dir / ZERO_DIR / COMMON).is_file() else {}
    shapes = {name: tuple(shape) for group in meta.get("param_shapes") or [] for name, shape in group.items()}
    shapes.update({name: tuple(s) for name, s in (meta.get("frozen_param_shapes") or {}).items()})
    weights, adam = {}, {}
    for name in list(shapes) + sorted(p.name for p in (tag_dir / ZERO_DIR).iterdir() if p.is_dir()):
        pdir = tag_dir / ZERO_DIR / name
        if name in weights or not (pdir / "fp32.pt").is_file():
            continue
        if "/" in name or "\\" in name or name.startswith("."):   # names come from the files: stay inside zero/
            raise UnsafeCheckpointError(f"{tag_dir}: parameter name {name!r} is not a directory of {ZERO_DIR}/")
        weights[name] = _param(pdir / "fp32.pt").float()
        if name in shapes and tuple(weights[name].shape) != shapes[name]:
            raise ValueError(f"{pdir / 'fp32.pt'}: shape {tuple(weights[name].shape)}, the model states say "
                             f"{shapes[name]} (a tensor-parallel slice?)")
        if (pdir / "exp_avg.pt").is_file():
            step = load_ds_file(pdir / "step.pt") if (pdir / "step.pt").is_file() else None
            adam[name] = {"step": step.clone().float() if torch.is_tensor(step) else torch.tensor(float(step or 0)),
                          "exp_avg": _param(pdir / "exp_avg.pt").float().view(weights[name].shape),
                          "exp_avg_sq": _param(pdir / "exp_avg_sq.pt").float().view(weights[name].shape)}
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise ValueError(f"{tag_dir / ZERO_DIR}: no fp32.pt for {missing[:4]}: an incomplete universal checkpoint")
    buffers = set(meta.get("buffer_names") or [])
    for k, v in (meta.get("module") or {}).items():   # buffers, as zero_to_fp32 keeps them (float)
        if k in buffers:
            weights[k] = v.float() if v.is_floating_point() else v
    for alias, source in (meta.get("shared_params") or {}).items():
        if source in weights and alias not in weights:
            weights[alias] = weights[source]
    scaler = common.get("loss_scaler")
    scaler = (None if scaler is None or not getattr(scaler, "dynamic", False) and getattr(scaler, "cur_scale", 1.0)
              == 1.0 else {k: v for k, v in vars(scaler).items() if not isinstance(v, torch.dtype)})
    return {
        "stage": int(common.get("zero_stage", 0)), "world_size": int(meta.get("dp_world_size", 1)),
        "tag": tag_dir.name, "weights": weights, "adam": adam,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in common.get("param_groups", [])],
        "loss_scaler": scaler, "lr_scheduler": meta.get("lr_scheduler"),
        "counters": {k: meta.get(k) for k in ("global_steps", "global_samples", "skipped_steps")},
        "data_sampler": meta.get("data_sampler"),
        "client_state": {k: v for k, v in meta.items() if k not in DS_MODEL_KEYS},
        "ds_config": meta.get("ds_config"),
    }
