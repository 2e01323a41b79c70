"""The Engine's checkpoints: DeepSpeed's engine.save_checkpoint / load_checkpoint on top of fsdpzero.checkpoint.

State keys: "train" = {"model", "optim"} (what `fsdpzero convert --from deepspeed --to dcp` writes too), "engine" =
the engine's counters, scheduler and loss scaler. A DeepSpeed save_dir given to load is converted once into
<dir>/.fsdpzero-<tag>/ and loaded from there.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from fsdpzero.checkpoint import MANIFEST, PendingSave, checkpoint_problems, load_checkpoint, resolve_tag, save_checkpoint

log = logging.getLogger(__name__)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class EngineState(Stateful):
    """The engine's model + optimizer (through its gradient path) under the key "train", as the converter writes."""

    def __init__(self, engine, with_optimizer: bool = True, saved_masters: bool = True):
        self.engine, self.with_optimizer = engine, with_optimizer
        self.saved_masters = saved_masters   # False: a checkpoint without optimizer "master" entries is loading

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        sd = {"model": get_model_state_dict(self.engine.module)}
        if self.with_optimizer:
            sd["optim"] = self.engine.grad_path.state_dict()
            if not self.saved_masters:   # FSDP paths keep fp32 masters as the model weights: those load as "model"
                for entry in sd["optim"].get("state", {}).values():
                    entry.pop("master", None)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(self.engine.module, sd["model"])
        if self.with_optimizer:
            self.engine.grad_path.load_state_dict(sd["optim"])


def _has_optimizer_masters(path: Path) -> bool:
    """Offload (and stage-1) checkpoints store each param's fp32 "master" with its optimizer state; a plain FSDP
    checkpoint does not (its sharded fp32 model weights are the masters)."""
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any("/optim/state/" in k and k.endswith("/master") for k in keys)


def _check_stage1_layout(engine, path: Path) -> None:
    """Stage 1 keeps its optimizer state as flat per-parameter shards (ops/stage1_state.py); DCP cannot reshape the
    full-shape state that stage 0/2/3, offload or a converted DeepSpeed checkpoint holds. Say so before loading."""
    if type(engine.grad_path).__name__ != "Stage1GradPath":
        return
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    full = [k for k, v in md.items() if "/optim/state/" in k and k.endswith("/exp_avg") and len(v.size) > 1]
    if full:
        raise ValueError(f"{path}: its optimizer state is laid out per full parameter (e.g. {full[0]}), written by a "
                         "stage 0/2/3 or offload engine or converted from DeepSpeed; a stage-1 engine cannot load it. "
                         "Resume with zero_optimization.stage 2 (the same math), or load_optimizer_states=False.")


def save_engine(engine, save_dir, tag=None, client_state=None, save_latest=True, **options) -> Path | PendingSave:
    state = {"train": EngineState(engine), "engine": engine.client_state()}
    return save_checkpoint(save_dir, tag, state, client_state, step=engine.global_steps, save_latest=save_latest,
                           **options)


def _clean_fqn(name: str) -> str:
    """Parameter name as the unwrapped model has it (activation-checkpoint and torch.compile wrappers removed)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _from_deepspeed(engine, load_dir: Path, tag: str | None) -> tuple[Path, str | None]:
    """A DeepSpeed checkpoint dir: convert it once (rank 0) into <load_dir>/.fsdpzero-<tag>/, then load that.
    The engine knows the trainable parameters in order, which makes stage-0 files exact."""
    try:
        path = resolve_tag(load_dir, tag)
    except FileNotFoundError:
        return load_dir, tag
    if (path / MANIFEST).exists() or not any(path.glob("*_model_states.pt")):
        return load_dir, tag
    out = load_dir / f".fsdpzero-{path.name}"
    if _rank0() and checkpoint_problems(out / path.name):
        from fsdpzero.convert import deepspeed_to_ours
        names = [_clean_fqn(n) for n, p in engine.module.named_parameters() if p.requires_grad]
        deepspeed_to_ours(path, None, out, to="dcp", trainable_names=names)
    if dist.is_initialized():
        dist.barrier()
    return out, path.name


def load_engine(engine, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True,
                load_module_only=False) -> tuple[Path | None, dict | None]:
    """DeepSpeed semantics: no `latest` and no tag -> warn, return (None, None). A checkpoint converted from
    DeepSpeed (`fsdpzero convert --from deepspeed`) carries "counters"/"loss_scaler" instead of "engine"."""
    load_dir, tag = _from_deepspeed(engine, Path(load_dir), tag)
    try:
        path = resolve_tag(load_dir, tag)
    except FileNotFoundError as e:
        if _rank0():
            log.warning("%s", e)
        return None, None
    top = dict(json.loads((path / "state.json").read_text())["__dict__"]) if (path / "state.json").is_file() else {}
    with_optim = load_optimizer_states and not load_module_only
    if with_optim:
        _check_stage1_layout(engine, path)
    state: dict = {"train": EngineState(engine, with_optim, _has_optimizer_masters(path))}
    engine_state: dict = {}
    if not load_module_only:
        for key in ("engine", "counters", "loss_scaler"):
            if key in top:
                state[key] = engine_state.setdefault(key, {})
    path, client = load_checkpoint(load_dir, path.name, state, load_rng=not load_module_only)
    if "engine" in engine_state:
        saved = engine_state["engine"]
        if not load_lr_scheduler_states:
            saved = {**saved, "lr_scheduler": None}
        engine.load_client_state(saved)
    elif "counters" in engine_state:
        c = engine_state["counters"]
        engine.global_steps, engine.global_samples = c.get("global_steps", 0), c.get("global_samples", 0)
        engine.skipped_steps = c.get("skipped_steps", 0)
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
        if engine.loss_scaler is not None and "loss_scaler" in engine_state:
            own = engine.loss_scaler.state_dict()
            engine.loss_scaler.load_state_dict({**own, **{k: v for k, v in engine_state["loss_scaler"].items()
                                                          if k in own}})
    return path, client
