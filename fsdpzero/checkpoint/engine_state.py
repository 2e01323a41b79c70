"""The Engine's checkpoints: DeepSpeed's engine.save_checkpoint / load_checkpoint on top of fsdpzero.checkpoint.dcp.

State keys: "train" = {"model", "optim"} (what `fsdpzero convert --from deepspeed --to dcp` writes too), "engine" =
the engine's counters, scheduler and loss scaler. A DeepSpeed save_dir given to load is converted once into
fsdpzero.checkpoint.convert.conversion_dir (beside it where rank 0 may write, else the ckpt_convert_dir cache) and
loaded from there. Any stage loads any other stage's checkpoint (EngineState).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from fsdpzero.checkpoint.agree import (CheckpointError, agree, broadcast_text, check_tag_across_ranks, describe,
                                      resolve_on_rank0)
from fsdpzero.checkpoint.dcp import (MANIFEST, PendingSave, client_state_json,
                                     load_verified, read_saved_json, save_checkpoint, tensor_shapes,
                                     verify_checkpoint, wait_for_pending_save)
from fsdpzero.checkpoint.files import LATEST_UNIVERSAL, check_tag
from fsdpzero.checkpoint.stream import streamed_state
from fsdpzero.checkpoint.trust import read_dcp_metadata
from fsdpzero.dist import agreed_errors, clean_fqn, local_tensor
from fsdpzero.optim.grad_path import MASTER

log = logging.getLogger(__name__)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class EngineState(Stateful):
    """The engine's model + optimizer (through its gradient path) under the key "train", as the converter writes.

    Loading, `saved_masters` says whether the checkpoint's optimizer state holds fp32 "master" entries (stage 1 and
    offload write them; stage 0/2/3 and converted DeepSpeed checkpoints do not: their fp32 model weights are the
    masters). When the checkpoint and the live path disagree, the fp32 weights cross over: a live master is read
    from the saved model weight, or a live fp32 weight from the saved master. Shapes may differ too (stage 1 keeps
    flat per-parameter states): fsdpzero.checkpoint.dcp.load_checkpoint reads those whole and cuts them to the live
    layout. So any stage's checkpoint resumes on any other stage."""

    def __init__(self, engine, with_optimizer: bool = True, saved_masters: bool | None = None, tuning=None):
        self.engine, self.with_optimizer, self.saved_masters = engine, with_optimizer, saved_masters
        self.tuning = tuning if tuning is not None else engine.tuning   # this save's settings (ckpt_stream)
        self._crossed: str | None = None   # "to_masters" / "to_weights": how the last state_dict() moved masters
        self._live_groups: list[dict] = []
        self._swapper = None               # offload_param nvme's ParamSwapper when the shards stream
        self.model_keys: list[str] | None = None
        self.param_shapes: dict[str, tuple] = {}

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        path = self.engine.grad_path   # NVMe states stream through DCP instead of being read into memory here
        stream = path.streams_checkpoints and self.tuning.ckpt_stream   # knob ckpt_stream
        # offload_param nvme: the param shards stream too, so no unit is brought back for the checkpoint (with
        # the optimizer only: a module-only load must refresh the masters through load_state_dict's hooks)
        self._swapper = path.param_swapper if stream and self.with_optimizer else None
        with self._swapper.lazy() if self._swapper is not None else contextlib.nullcontext():
            sd = {"model": get_model_state_dict(self.engine.module)}
            self.model_keys = list(sd["model"])   # before any is moved or dropped below: what a strict load needs
            self.param_shapes = tensor_shapes(sd["model"])   # and what check_shapes compares
            slots = _stream_param_entries(sd["model"], self._swapper) if self._swapper is not None else {}
            if not self.with_optimizer:
                return sd
            sd["optim"] = optim = path.state_dict(streaming=True) if stream else path.state_dict()
        self._live_groups, self._crossed = optim.get("param_groups", []), None
        state = optim.get("state", {})
        live_masters = any(MASTER in entry for entry in state.values())
        if self.saved_masters and slots:   # a load: each shard is written once, from its master
            _drop_mastered(sd["model"], slots, state)
        if self.saved_masters is None or live_masters == self.saved_masters:
            return sd
        if live_masters:     # fill the live masters from the saved fp32 model weights
            for name, entry in state.items():
                sd["model"][clean_fqn(name)] = entry.pop(MASTER)
            self._crossed = "to_masters"
        else:                # fill the live fp32 model weights from the saved masters
            for name, entry in state.items():
                entry[MASTER] = sd["model"].pop(clean_fqn(name))
            moved = {_data_ptr(entry[MASTER]) for entry in state.values()}
            for key in [k for k, v in sd["model"].items() if _data_ptr(v) in moved]:
                del sd["model"][key]   # a tied alias (lm_head of wte) would load the saved 16-bit copy over it
            self._crossed = "to_weights"
        return sd

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from fsdpzero.optim import keeping_impl_flags
        model, strict = sd["model"], self._crossed is None
        if self.with_optimizer:
            optim = sd["optim"]
            if self._crossed == "to_masters":   # copies: loading the weights may refresh masters from them (offload)
                for name, entry in optim["state"].items():
                    entry[MASTER] = model.pop(clean_fqn(name)).detach().clone()
            elif self._crossed == "to_weights":
                for name, entry in optim["state"].items():
                    model[clean_fqn(name)] = entry.pop(MASTER)
            for saved, live in zip(optim.get("param_groups", []), self._live_groups):
                for key in ("params", "param_names"):   # torch groups list "params", stage 1's "param_names"
                    if key in live:
                        saved[key] = live[key]
                    else:
                        saved.pop(key, None)
        if self._swapper is not None:   # the shards were written as DCP read them; no load_state_dict hooks
            with self._swapper.lazy():
                _load_buffers(self.engine.module, {k: v for k, v in model.items() if streamed_state(v) is None})
                with keeping_impl_flags(self.engine.grad_path.optimizer):
                    self.engine.grad_path.load_state_dict(optim)
            return
        masters = self.with_optimizer and bool(optim.get("state")) and all(
            isinstance(entry, dict) and MASTER in entry for entry in optim["state"].values())
        with self.engine.grad_path.keep_masters_on_load() if masters else contextlib.nullcontext():
            set_model_state_dict(self.engine.module, model, options=StateDictOptions(strict=strict))
        if self.with_optimizer:
            with keeping_impl_flags(self.engine.grad_path.optimizer):
                self.engine.grad_path.load_state_dict(optim)


def _stream_param_entries(model_sd: dict, swapper) -> dict:
    """Each swapped param shard's entry becomes a streamed one (read or written by DCP when it gets there).
    Returns key -> the shard's (unit, index) in the swapper."""
    slots = {k: swapper.slot(t) for k, t in model_sd.items() if isinstance(t, torch.Tensor)}
    slots = {k: v for k, v in slots.items() if v is not None}
    for key in slots:
        model_sd[key] = swapper.streamed_shard(model_sd[key])
    return slots


def _drop_mastered(model_sd: dict, slots: dict, optim_state: dict) -> None:
    """Loading a checkpoint that has masters, the shards they stream into (NVMeGradPath._master_loaded, or the
    shard itself when it is its own fp32 master) need not be written from the saved weights too (aliases of a
    tied weight included): the in-memory path's optimizer load overwrites them from the masters as well."""
    mastered = {slots[clean_fqn(name)] for name, entry in optim_state.items()
                if streamed_state(entry.get(MASTER)) is not None and clean_fqn(name) in slots}
    for key in [k for k, slot in slots.items() if slot in mastered]:
        del model_sd[key]


@torch.no_grad()
def _load_buffers(module, entries: dict) -> None:
    """The model entries that are not swapped params (persistent buffers), copied in place; FSDP2's and the
    swapper's load_state_dict hooks would bring every unit into memory."""
    buffers = {clean_fqn(n): b for n, b in module.named_buffers()}
    unknown = sorted(k for k in entries if k not in buffers)
    if unknown:
        raise RuntimeError(f"checkpoint load (offload_param nvme): {unknown[:5]} are neither swapped parameter "
                           f"shards nor buffers of the model; set FSDPZERO_CKPT_STREAM=0 (knob ckpt_stream) to load "
                           f"them the slow way")
    for k, v in entries.items():
        buffers[k].copy_(local_tensor(v))


def _data_ptr(t) -> int:
    return local_tensor(t).data_ptr()


def _has_optimizer_masters(path: Path) -> bool:
    """Offload (and stage-1) checkpoints store each param's fp32 "master" with its optimizer state; a plain FSDP
    checkpoint does not (its sharded fp32 model weights are the masters)."""
    keys = read_dcp_metadata(path).state_dict_metadata   # the allowlisted reader, never pickle.load
    return any("/optim/state/" in k and k.endswith("/" + MASTER) for k in keys)


def save_engine(engine, save_dir, tag=None, client_state=None, save_latest=True, **options) -> Path | PendingSave:
    """engine.save_checkpoint. The plan's checkpoint section: tag_validation (tags compared across ranks, as
    DeepSpeed does), writer.decoupled (async_save: the data is written in the background, the checkpoint completed
    and `latest` moved by the next save, a load, or PendingSave.result()), keep_last; explicit options win."""
    plan = engine.plan.checkpoint
    with agreed_errors():   # one rank's bad tag or client_state: the same error on every rank, collectives in step
        tag = check_tag(f"global_step{engine.global_steps}" if tag is None else tag if isinstance(tag, str)
                        else str(tag))
        client_state_json(client_state)
    check_tag_across_ranks(tag, plan.tag_validation)
    options.setdefault("async_save", plan.async_save)
    if plan.keep_last is not None:
        options.setdefault("keep_last", plan.keep_last)
    options.setdefault("tuning", engine.tuning)   # this engine's settings (or this save's), never the process's
    state = {"train": EngineState(engine, tuning=options["tuning"]), "engine": engine.client_state()}
    return save_checkpoint(save_dir, tag, state, client_state, step=engine.global_steps, save_latest=save_latest,
                           **options)


def _source_stamp(tag_dir: Path) -> dict:
    """What a converted copy was made from: the DeepSpeed files' names, sizes and modification times."""
    return {"source": str(tag_dir.resolve()),   # (a universal checkpoint keeps its files under zero/<param>/)
            "files": {str(p.relative_to(tag_dir)): [p.stat().st_size, p.stat().st_mtime_ns]
                      for p in sorted(tag_dir.rglob("*.pt"))}}


def from_deepspeed(engine, load_dir: Path, tag: str | None) -> tuple[Path, str | None]:
    """A DeepSpeed checkpoint dir: convert it (rank 0) into convert.conversion_dir (the ckpt_convert_dir knob; else
    beside the source, <save_dir>/.fsdpzero-<tag>, where rank 0 may write; else the user cache), then load that.
    The engine knows the trainable parameters in order, which makes stage-0 files exact. The copy is reused only
    if its stamp (convert.SOURCE_STAMP) matches the DeepSpeed files and it is complete; anything else there (stale,
    or not made by us) is rebuilt, in its own temp dir, and published by rename (convert.convert_into). Reused or
    not, it is then loaded like any checkpoint: checksums, allowlisted reader.
    checkpoint.load_universal: with no tag, the universal checkpoint `latest_universal` names (as DeepSpeed);
    a universal checkpoint is recognised by its layout either way (fsdpzero.checkpoint.universal)."""
    if tag is None and engine.plan.checkpoint.load_universal:
        try:
            tag = resolve_on_rank0(load_dir, None, LATEST_UNIVERSAL).name
        except FileNotFoundError:
            raise FileNotFoundError(f"{load_dir / LATEST_UNIVERSAL} does not exist: checkpoint.load_universal loads "
                                    f"the universal checkpoint it names (ds_to_universal writes it); or pass tag=...") \
                from None
    try:
        path = resolve_on_rank0(load_dir, tag)
    except FileNotFoundError:
        return load_dir, tag
    if (path / MANIFEST).exists() or not any(path.glob("*_model_states.pt")):
        return load_dir, tag
    from fsdpzero.checkpoint.convert import KNOB_HINT, conversion_dir, convert_into, deepspeed_to_ours
    error, out = None, ""
    if _rank0():   # rank 0 decides where (beside the source if it may write there) and every rank uses that
        out = str(conversion_dir(path, engine.tuning))
    out = Path(broadcast_text(out))
    if _rank0():
        names = [clean_fqn(n) for n, p in engine.module.named_parameters() if p.requires_grad]
        try:
            convert_into(out, _source_stamp(path), path.name,
                         lambda tmp: deepspeed_to_ours(path, None, tmp, to="dcp", trainable_names=names,
                                                       tuning=engine.tuning))
        except (OSError, CheckpointError) as e:   # could not write there (CheckpointError: the copy's save)
            error = f"converting DeepSpeed checkpoint {path} into {out} failed: {describe(e)}; {KNOB_HINT}"
        except (Exception, CheckpointException) as e:
            error = f"converting DeepSpeed checkpoint {path} into {out} failed: {describe(e)}"
    agree(error)   # also the barrier: the copy exists for every rank after it
    seen = (out / path.name).is_dir()
    agree(None if seen else f"the converted copy {out} of DeepSpeed checkpoint {path} (made by rank 0) is not on "
          f"this rank's filesystem: {KNOB_HINT}")
    return out, path.name


def load_engine(engine, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True,
                load_module_only=False, strict=True) -> tuple[Path | None, dict | None]:
    """DeepSpeed semantics: no `latest` and no tag -> warn, return (None, None). A checkpoint converted from
    DeepSpeed (`fsdpzero convert --from deepspeed`) carries "counters"/"loss_scaler" instead of "engine".
    strict (DeepSpeed's load_module_strict): the checkpoint's model keys must be the model's, else an error that
    lists both sides; strict=False loads the keys both have."""
    wait_for_pending_save()   # it may be about to move `latest`
    load_dir, tag = from_deepspeed(engine, Path(load_dir), tag)
    try:
        path = resolve_on_rank0(load_dir, tag)   # one checkpoint for every rank, whatever `latest` does meanwhile
    except FileNotFoundError as e:
        if _rank0():
            log.warning("%s", e)
        return None, None
    manifest = verify_checkpoint(path)   # before any of it is parsed
    top = dict(read_saved_json(path, "state.json")["__dict__"])
    with_optim = load_optimizer_states and not load_module_only
    state: dict = {"train": EngineState(engine, with_optim, _has_optimizer_masters(path))}
    engine_state: dict = {}
    if not load_module_only:
        for key in ("engine", "counters", "loss_scaler"):
            if key in top:
                state[key] = engine_state.setdefault(key, {})
    path, client = load_verified(path, manifest, state, load_rng=not load_module_only, strict=strict)
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
        if engine.lr_scheduler is not None and load_lr_scheduler_states and c.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(c["lr_scheduler"])   # DeepSpeed's scheduler state, as it saved it
        if engine.loss_scaler is not None and "loss_scaler" in engine_state:
            own = engine.loss_scaler.state_dict()
            engine.loss_scaler.load_state_dict({**own, **{k: v for k, v in engine_state["loss_scaler"].items()
                                                          if k in own}})
    return path, client
