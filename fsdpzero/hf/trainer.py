"""Hugging Face integration: sharded `from_pretrained`, the `Trainer` path, and ZeRO-3-style inference.

- `from_pretrained(path, ds_config)`: DeepSpeed's `zero.Init` + `from_pretrained`, on FSDP2. The model is built on
  the meta device, sharded by `fsdpzero.wrap` per the config, and each rank then reads *only its own rows* of each
  tensor from the safetensors files (`safe_open(...).get_slice`), so no rank ever holds the whole model: peak host
  memory per rank is ~1/N of the checkpoint plus one tensor slice. Non-persistent buffers (rotary `inv_freq`), which
  no checkpoint holds and `to_empty` leaves as garbage, are rebuilt by the engine's `materialize`.
- `TrainingArguments(..., deepspeed="ds.json")` + `Trainer(...)` from this module: a DeepSpeed user's Trainer
  script, with the import changed, runs through fsdpzero (DeepSpeed need not be installed). "auto" values are
  resolved from the TrainingArguments the way transformers' DeepSpeed integration does. How: transformers >= 5.2x
  supports models "sharded at load time" (FSDP2 DTensors, no DDP wrap, accumulation through
  `set_requires_gradient_sync`); we shard with the engine, mark the model so, and let the Trainer drive the
  engine's gradient path (clip, step, zero) through a thin optimizer. The accelerate FSDP plugin was not used:
  accelerate only enables it on accelerators and silently falls back to DDP on CPU (checked with accelerate 1.15).
- `generate(engine_or_model, ...)`: evaluation and generation with stage-3-sharded parameters; with several ranks
  `synced_gpus=True` keeps every rank stepping the forward (and its all-gathers) until all have finished.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

from fsdpzero.dist import clean_fqn
from fsdpzero.hf.lora import is_peft_model, save_adapters, save_merged_model
from fsdpzero.hf.zero3 import checkpoint_keys, local_box

# -- sharded loading -----------------------------------------------------------------------------------------------


@torch.no_grad()
def load_sharded_safetensors(model: nn.Module, path: str | Path) -> None:
    """Fill a sharded (or plain) model in place from a Hugging Face safetensors checkpoint, each rank reading only
    the rows it holds. Every parameter and persistent buffer must be found (tied weights count once)."""
    from safetensors import safe_open
    path = Path(path)
    where = checkpoint_keys(path)
    tensors = dict(model.named_parameters())
    persistent = set(model.state_dict().keys())
    tensors.update({n: b for n, b in model.named_buffers() if n in persistent})
    missing, keyed = [], {}
    for name, t in tensors.items():
        key = clean_fqn(name)
        if key not in where:
            missing.append(key)
            continue
        keyed[key] = t
    _check_shapes(path, where, keyed)
    for key, t in keyed.items():
        local, box = local_box(t)
        if local.numel() == 0:
            continue
        # one open per tensor: safetensors memory-maps the file and touched pages count as this process's memory
        # until it is closed, so a long-lived handle would grow toward the whole file
        with safe_open(str(where[key]), framework="pt", device="cpu") as f:
            piece = f.get_slice(key)[box] if local.dim() else f.get_tensor(key)
        local.copy_(piece.to(dtype=local.dtype))
    if missing:
        raise KeyError(f"{path}: {len(missing)} tensor(s) of the model are not in the checkpoint, e.g. "
                       f"{missing[:3]} (is it the same architecture and config?)")


def _check_shapes(path: Path, where: dict[str, Path], tensors: dict[str, torch.Tensor]) -> None:
    """Every checkpoint tensor has the model's (full, unsharded) shape, compared as torch's load_state_dict and
    transformers do, before anything is copied: a rank reads only its rows, so a larger checkpoint tensor would be
    cut to the model's rows and a 1-row one broadcast. Same files, same answer on every rank."""
    from safetensors import safe_open
    by_file: dict[Path, list[str]] = {}
    for key in tensors:
        by_file.setdefault(where[key], []).append(key)
    wrong = []
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in keys:
                saved, live = tuple(f.get_slice(key).get_shape()), tuple(tensors[key].shape)
                if saved != live:
                    wrong.append((key, saved, live))
    if wrong:
        key, saved, live = wrong[0]
        hint = (" (the transpose: a Conv1D (in, out) weight for a Linear (out, in), or the reverse?)"
                if len(live) == 2 and saved == live[::-1] else "")
        more = f"; and {len(wrong) - 1} more tensor(s)" if len(wrong) > 1 else ""
        raise ValueError(f"{path}: size mismatch for {key}: the checkpoint has shape {saved}, the model "
                         f"{live}{hint}{more}; is it the same architecture and config?")


def from_pretrained(path: str | Path, ds_config: Any, *, model_class: Any = None,
                    attn_implementation: str | None = None, **wrap_kwargs: Any):
    """A sharded, trainable Engine for a local Hugging Face checkpoint: meta-device build, shard per ds_config,
    then each rank loads only its shard. Returns the Engine (its `.module` is the sharded transformers model)."""
    import fsdpzero
    path = Path(path)
    config = transformers.AutoConfig.from_pretrained(str(path))
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    model_class = model_class or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        # an Auto class builds through from_config, a model class (MixtralForCausalLM) through _from_config
        model = (model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config)(config)
    wrap_kwargs.setdefault("hidden_size", getattr(config, "hidden_size", None))
    # transformers' conversion mapping (Mixtral's per-expert tensors fused, legacy renames), taken before sharding:
    # fully_shard's FSDP<Model> class reads to transformers as custom code, with no mapping
    from fsdpzero.hf.zero3 import conversion_mapping, load_converted_safetensors
    transforms = conversion_mapping(model)
    engine = fsdpzero.wrap(model, ds_config, **wrap_kwargs)
    load_converted_safetensors(engine.module, path, transforms)
    return engine


# -- ZeRO inference ----------------------------------------------------------------------------------------------

@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """`model.generate` for a sharded model (an Engine or its module) with every rank kept in step: a rank whose
    sequences finished early keeps running forwards (and their all-gathers) until all ranks are done."""
    module = getattr(model, "module", model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        kwargs.setdefault("synced_gpus", True)
    was_training = module.training
    module.eval()
    try:
        return module.generate(input_ids=input_ids, **kwargs)
    finally:
        module.train(was_training)


# -- Trainer path ---------------------------------------------------------------------------------------------------

class TrainingArguments(transformers.TrainingArguments):
    """`transformers.TrainingArguments` whose `deepspeed=` (a path or dict) is run by fsdpzero instead of DeepSpeed."""

    @property
    def place_model_on_device(self) -> bool:
        return False     # the engine places the shards (transformers' documented override point for integrations)

    @property
    def n_gpu(self) -> int:
        # one process drives one device, as under DeepSpeed: a plain `python train.py` on a multi-GPU host must not
        # get the Trainer's DataParallel, which needs every parameter on cuda:0 (offloaded shards are on the CPU)
        n = super().n_gpu
        return min(n, 1) if getattr(self, "fsdpzero_config", None) is not None else n

    def __post_init__(self):
        self.fsdpzero_config = self.deepspeed
        self.deepspeed = None            # keep transformers from importing and configuring DeepSpeed
        if self.fsdpzero_config is not None:
            from fsdpzero.dist import join_before_accelerate
            join_before_accelerate(float(self.ddp_timeout))
        super().__post_init__()


def trainer_context(args: transformers.TrainingArguments, model: nn.Module, train_dataset=None,
                    tp_size: int = 1, sp_size: int = 1) -> dict:
    """The values HF's DeepSpeed integration fills "auto" from (names as in TrainingArguments). tp_size: the
    config's tensor_parallel.autotp_size; a tp group reads one data replica's batches (the step count below).
    sp_size: sequence_parallel_size; the batch triad counts world / sp (accelerate sets train_batch_size so for
    DeepSpeed's ALST), and the Ulysses adapter hands each rank sp micro-batches per batch of its loader."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    ctx = {k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                         "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
                                         "adam_epsilon", "max_grad_norm", "warmup_steps", "bf16", "fp16")}
    # a size that does not divide the world: the plan names sequence_parallel_size (world // sp could fill 0)
    ctx["world_size"] = world // sp_size if world % sp_size == 0 else world
    ctx["hidden_size"] = getattr(getattr(model, "config", None), "hidden_size", None)
    if args.max_steps and args.max_steps > 0:
        ctx["max_steps"] = ctx["num_training_steps"] = args.max_steps
    elif train_dataset is not None and hasattr(train_dataset, "__len__"):
        # as the Trainer counts them: batches per rank, optimizer steps per epoch (a partial window counts), then
        # ceil(epochs x steps per epoch), so fractional num_train_epochs gives the schedule the Trainer runs
        per_rank = args.per_device_train_batch_size * max(1, world // tp_size)
        n = len(train_dataset)
        batches = (n // per_rank if args.dataloader_drop_last else math.ceil(n / per_rank)) * sp_size
        per_epoch = max(batches // args.gradient_accumulation_steps
                        + int(batches % args.gradient_accumulation_steps > 0), 1)
        ctx["num_training_steps"] = math.ceil(args.num_train_epochs * per_epoch)
    return ctx


class _EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer calls `optimizer`: step/zero_grad go to the engine's gradient path (which may keep its
    optimizer states sharded, on the CPU, or on NVMe); param_groups and state are the real optimizer's."""

    def __init__(self, engine):              # no super().__init__: this object owns no parameters of its own
        self.engine = engine
        self.inner = engine.optimizer
        self.defaults = self.inner.defaults
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self.scheduler = None                # stepped here, as DeepSpeed's engine.step does (_StepsWithOptimizer)

    param_groups = property(lambda self: self.inner.param_groups)
    state = property(lambda self: self.inner.state)

    def step(self, closure=None):
        self.engine.grad_path.step()
        if self.scheduler is not None:
            self.scheduler.step()
        engine = self.engine            # the engine's counters follow the Trainer's optimizer steps
        engine.global_steps += 1
        engine.global_samples += engine.train_batch_size()
        engine.micro_steps += engine.gradient_accumulation_steps()

    def zero_grad(self, set_to_none: bool = True):
        self.engine.grad_path.zero_grad()

    def state_dict(self):
        """The hyperparameters only. The optimizer state lives in the gradient path (sharded, on the CPU or on
        NVMe) and is saved by the engine's checkpoint (Trainer._save_optimizer_and_scheduler). accelerate's prepare
        round-trips this dict to move it to the device; a round trip of the real state would read an NVMe run's
        whole state back from disk and re-initialise its swap files."""
        return {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                              for g in self.inner.param_groups]}

    def load_state_dict(self, state_dict):
        for group, saved in zip(self.inner.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


class _StepsWithOptimizer:
    """A scheduler as transformers + DeepSpeed run it whenever the config has an optimizer or scheduler section:
    DeepSpeed's engine.step steps it, so the Trainer, which reads the rate right after optimizer.step(), logs the
    rate after the update, and its own lr_scheduler.step() is a no-op (transformers' DeepSpeedSchedulerWrapper)."""

    def __init__(self, inner):
        self.inner = inner

    def step(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


def trainers_optimizer(model: nn.Module, args: transformers.TrainingArguments):
    """What `Trainer.create_optimizer` builds (args.optim's class and arguments; weight decay on all but biases and
    norm weights), as a function of the engine's trainable tensors, which come in model order."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))   # uses only the model
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)

    def build(params):
        params = list(params)
        if len(params) != len(names):
            raise ValueError(f"expected {len(names)} trainable tensors, got {len(params)}")
        groups = [{"params": [p for n, p in zip(names, params) if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in zip(names, params) if n not in decay], "weight_decay": 0.0}]
        return cls([g for g in groups if g["params"]], **kwargs)

    build.__name__ = f"Trainer optim={args.optim}"
    return build


def _log_choice(raw: dict, client_optimizer, client_scheduler, args) -> None:
    """The startup report says where the optimizer and the scheduler come from (rank 0: the logger's level)."""
    opt = ("the config's \"optimizer\" section" if "optimizer" in raw else
           f"optimizers[0] ({type(client_optimizer).__name__})" if client_optimizer is not None else
           f"the Trainer's (optim={args.optim}, no weight decay on biases and norm weights)")
    sched = ("the config's \"scheduler\" section" if "scheduler" in raw else
             f"optimizers[1] ({type(client_scheduler).__name__})" if client_scheduler is not None else
             f"the Trainer's (lr_scheduler_type={args.lr_scheduler_type})")
    logging.getLogger("fsdpzero").info("Trainer: optimizer from %s; scheduler from %s", opt, sched)


def _autotp_size(raw: dict) -> int:
    size = (raw.get("tensor_parallel") or {}).get("autotp_size", 1) if isinstance(raw, dict) else 1
    return size if isinstance(size, int) and size > 1 else 1


def sequence_parallel_size(raw: dict, args: transformers.TrainingArguments):
    """Ulysses under the Trainer: the size from the DeepSpeed config's `sequence_parallel_size` or from
    `TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N))` (how transformers +
    accelerate users ask for DeepSpeed's ALST; its mpu then gives DeepSpeed the size). Both given must agree; the
    config gets the size (wrap builds the groups from it). Returns (size, the ParallelismConfig the accelerator will
    hold: the user's, or one made here; None for size 1)."""
    pc = getattr(args, "parallelism_config", None)
    asked = (getattr(pc, "sp_size", None) or 1) if pc is not None else 1
    key = raw.get("sequence_parallel_size")
    size = key if isinstance(key, int) and key > 1 else 1
    if asked > 1:
        others = {f"{d}_size": getattr(pc, f"{d}_size", 1) for d in ("dp_replicate", "dp_shard", "tp", "cp")}
        others = {k: v for k, v in others.items() if (v or 1) > 1}
        if others:
            raise ValueError(f"TrainingArguments parallelism_config {others} with sp_size = {asked}: under fsdpzero "
                             "only sp_size is read from it (sharding and tensor parallelism come from the DeepSpeed "
                             "config: zero_optimization, tensor_parallel.autotp_size) -> leave those sizes at 1")
        if size > 1 and size != asked:
            raise ValueError(f"sequence_parallel_size = {size} in the DeepSpeed config but TrainingArguments "
                             f"parallelism_config sp_size = {asked}: make them equal, or set only one")
        size = raw["sequence_parallel_size"] = asked
    if size == 1:
        return 1, None
    if asked == 1:
        from accelerate import ParallelismConfig
        pc = ParallelismConfig(sp_backend="deepspeed", sp_size=size)
    return size, pc


def shard_loaders_over_data_replicas(accelerator, mesh) -> None:
    """With tensor parallelism (a mesh with model-parallel dimensions), `accelerator.prepare_data_loader` shards each
    loader over the data-parallel replicas, the tp ranks of one replica reading the same batches, as accelerate does
    under DeepSpeed AutoTP (its `ds_device_mesh`: process_index // tp of num_processes // tp): accelerate's
    prepare_data_loader with this rank's replica and their number (fsdpzero.parallel.data_rank_and_size). Nothing
    to do without model-parallel dimensions. Dispatched batches (rank 0 reads and splits them over every rank) are
    refused with the fix."""
    from fsdpzero.parallel import data_rank_and_size
    rank, replicas = data_rank_and_size(mesh)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if replicas == world:
        return
    from accelerate.data_loader import prepare_data_loader

    def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return accelerator.__class__.prepare_data_loader(accelerator, data_loader, device_placement,
                                                             slice_fn_for_dispatch)
        dispatch = accelerator.dispatch_batches
        if dispatch is None:   # accelerate's default: dispatched for an IterableDataset
            dispatch = isinstance(getattr(data_loader, "dataset", None), torch.utils.data.IterableDataset)
        if dispatch:
            raise ValueError("TrainingArguments accelerator_config dispatch_batches: rank 0 would split each batch "
                             "over every rank, where with tensor_parallel.autotp_size the tp ranks of one replica "
                             "read the same batch -> pass accelerator_config={\"dispatch_batches\": False}")
        prepared = prepare_data_loader(
            data_loader, accelerator.device, num_processes=replicas, process_index=rank,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement if device_placement is None else device_placement,
            rng_types=accelerator.rng_types.copy(), dispatch_batches=False, even_batches=accelerator.even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader)
        accelerator._dataloaders.append(prepared)
        return prepared
    accelerator.prepare_data_loader = prepare


class Trainer(transformers.Trainer):
    """`transformers.Trainer` running the DeepSpeed config of `args.deepspeed` (use this module's
    TrainingArguments) or `ds_config=` on fsdpzero: sharding, precision policy, optimizer and scheduler come from
    the config; the Trainer keeps its loop, data, logging and evaluation. `save_model` writes a from_pretrained
    folder through the engine's streamed export; checkpoints hold DeepSpeed's layout (global_stepN/ + latest) next to
    the Trainer's own files, and resume_from_checkpoint reloads them."""

    def __init__(self, model: nn.Module = None, args: transformers.TrainingArguments = None, *pos,
                 ds_config: Any = None, **kwargs):
        import fsdpzero
        from fsdpzero.config.load import read_source
        ds_config = ds_config if ds_config is not None else getattr(args, "fsdpzero_config", None)
        if ds_config is None:
            raise ValueError("fsdpzero.hf.Trainer needs a DeepSpeed config: "
                             "fsdpzero.hf.TrainingArguments(..., deepspeed='ds.json') or Trainer(..., ds_config=...)")
        launched = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
        if launched > 1 and args.world_size != launched:
            raise ValueError(
                f"the Trainer sees {args.world_size} process(es) but {launched} ranks were launched: every rank would "
                f"train alone on every batch. On CPU pass TrainingArguments(use_cpu=True), without which accelerate "
                f"does not join a CPU process group")
        raw = dict(read_source(ds_config))
        client_optimizer, client_scheduler = kwargs.pop("optimizers", (None, None)) or (None, None)
        for key, client, what in (("optimizer", client_optimizer, "optimizers[0]"),
                                  ("scheduler", client_scheduler, "optimizers[1]")):
            if key in raw and client is not None:
                raise ValueError(f"Trainer(optimizers=...) passes {what} and the DeepSpeed config has a {key!r} "
                                 f"section: remove one (transformers + DeepSpeed would silently use the config's)")
        if args.bf16 and "bf16" not in raw and "fp16" not in raw:
            raw["bf16"] = {"enabled": True}   # as accelerate sets the engine's precision from the arguments
        fp16 = raw.get("fp16", {}).get("enabled") if isinstance(raw.get("fp16"), dict) else None
        if fp16 is True or (fp16 == "auto" and args.fp16) or (args.fp16 and "fp16" not in raw):
            raise ValueError(
                "fp16 under fsdpzero.hf.Trainer is not supported yet: the Trainer would clip the gradients while "
                "they are still loss-scaled and bypass the config's loss scaler. Use bf16 (bf16=True, \"bf16\": "
                "{\"enabled\": \"auto\"}), or the deepspeed.initialize-style loop (fsdpzero.initialize), which "
                "runs DeepSpeed's fp16 loss scaler")
        optimizer = None
        if "optimizer" not in raw:   # transformers + DeepSpeed: the Trainer's optimizer (or the client's) is used
            raw["zero_allow_untested_optimizer"] = True   # and, as transformers does, allowed under ZeRO
            optimizer = client_optimizer if client_optimizer is not None else trainers_optimizer(model, args)
        sp, self._sequence_parallel_config = sequence_parallel_size(raw, args)
        context = trainer_context(args, model, kwargs.get("train_dataset"), tp_size=_autotp_size(raw), sp_size=sp)
        self.engine = fsdpzero.wrap(model, raw, optimizer=optimizer, lr_scheduler=client_scheduler, **context)
        _log_choice(raw, client_optimizer, client_scheduler, args)
        sharded = self.engine.module
        # no DDP wrap, no .to(): FSDP2 owns placement. Marked on every transformers model inside, so a PEFT wrapper
        # (not itself a PreTrainedModel) reports it through its base model as well
        for module in sharded.modules():
            if isinstance(module, transformers.PreTrainedModel) or module is sharded:
                module._is_distributed_loading_by_transformers = True
        # no scheduler section and none passed: lr_scheduler is None and the Trainer creates its own (create_scheduler,
        # from lr_scheduler_type and the warmup arguments) over the engine's optimizer, as with DeepSpeed
        self._engine_optimizer = _EngineOptimizer(self.engine)
        self._scheduler_steps_with_optimizer = "optimizer" in raw or "scheduler" in raw
        kwargs["optimizers"] = (self._engine_optimizer, self._stepped_by_optimizer(self.engine.lr_scheduler))
        # transformers refuses full checkpoints of models sharded at load time because it cannot save their optimizer
        # state; here the engine saves and resumes it (save_model, _save_optimizer_and_scheduler below), so the
        # refusal is stepped around for the constructor only and the user's save_only_model is kept.
        save_only_model, args.save_only_model = args.save_only_model, True
        # Ulysses: the accelerator gets its ParallelismConfig after it is built (create_accelerator_and_postprocess):
        # accelerate's constructor refuses one on CPU ranks (MULTI_CPU is none of its FSDP2 / multi-device /
        # DeepSpeed types)
        hidden = self._sequence_parallel_config is not None
        if hidden:
            parallelism_config, args.parallelism_config = args.parallelism_config, None
        try:
            super().__init__(sharded, args, *pos, **kwargs)
        finally:
            args.save_only_model = save_only_model
            if hidden:
                args.parallelism_config = parallelism_config
        # transformers before the "sharded at load time" flag (5.17 seen) hands the sharded model to
        # accelerate.prepare, which on several GPUs refuses its DTensors or wraps it in DDP; newer versions prepare
        # it as for evaluation (no DDP, no placement). Do that on every version.
        prepare_model = self.accelerator.prepare_model

        def _prepare_model(model, device_placement=None, evaluation_mode=False):
            if model is sharded:
                return prepare_model(model, device_placement=False, evaluation_mode=True)
            if evaluation_mode and self._shard_for_inference(model):
                return self._inference_engines[-1].module
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self.accelerator.prepare_model = _prepare_model
        self._inference_engines: list = []
        shard_loaders_over_data_replicas(self.accelerator, self.engine.mesh)

    def create_accelerator_and_postprocess(self) -> None:
        """With Ulysses, transformers' own DeepSpeed ALST hooks, driven by the accelerator's ParallelismConfig
        (sp_backend="deepspeed"): the batch and step counts over world / sp, model_accepts_loss_kwargs off, and the
        train loader wrapped after preparation by `accelerator.deepspeed_ulysses_dl_adapter`, here fsdpzero's
        UlyssesSPDataLoaderAdapter over the engine's group (accelerate's imports DeepSpeed's). The loss is
        compute_loss's; evaluation runs unsplit, as accelerate registers DeepSpeed's attention (disable_in_eval)."""
        super().create_accelerator_and_postprocess()
        pc = getattr(self, "_sequence_parallel_config", None)
        if pc is None:
            held = self.accelerator.state.parallelism_config   # process-wide: an earlier Trainer's Ulysses
            if held is not None and held.sp_size > 1:
                self.accelerator.state.parallelism_config = None
            return
        self.accelerator.state.parallelism_config = pc
        sp = self.engine.sequence_parallel
        sp.attention.disable_in_eval = True
        self.accelerator.deepspeed_ulysses_dl_adapter = lambda dl, model: sp.dataloader(dl, self.engine.device)

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch=None):
        """Training under Ulysses: the mean over the real tokens of each whole sequence, on every rank of the group
        (transformers' deepspeed_sp_compute_loss, on the engine's group: that one reads DeepSpeed's groups, and its
        all_gather backward fails on gloo when sp < world). Otherwise the Trainer's."""
        sp = self.engine.sequence_parallel
        if sp is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        from fsdpzero.parallel.ulysses import sequence_parallel_loss
        inputs = sp.model_inputs(inputs)   # labels = shift_labels; a batch the adapter never split is refused
        outputs = model(**inputs)
        loss = sequence_parallel_loss(outputs.loss, inputs["shift_labels"], sp.group)
        return (loss, outputs) if return_outputs else loss

    def get_tp_size(self) -> int:
        """The tensor-parallel size (transformers reads it from DeepSpeed's config, which the Trainer here does not
        see): the tokens it counts over every rank hold each tp group's batch tp times."""
        return self.engine.plan.tensor_parallel.size

    def _shard_for_inference(self, model: nn.Module) -> bool:
        """A second model the trainer only runs forward (TRL's DPO/KTO/GRPO reference model, which TRL prepares
        through deepspeed.initialize with an inference config under DeepSpeed): at ZeRO-3 it is sharded as the
        trained model is, on a forward-only engine (no optimizer, no gradient path), instead of kept whole on every
        rank. Returns whether it did (below stage 3, with NVMe parameters, or already sharded: as accelerate has it)."""
        import dataclasses

        from torch.distributed.tensor import DTensor

        import fsdpzero
        plan = self.engine.plan
        if plan.shard.stage != 3 or plan.offload.param_device == "nvme" or not isinstance(model, nn.Module) \
                or any(isinstance(p, DTensor) for p in model.parameters()):
            return False
        inference = dataclasses.replace(plan, optimizer=type(plan.optimizer)(), scheduler=type(plan.scheduler)(),
                                        offload=dataclasses.replace(plan.offload, optimizer_device="none"))
        engine = fsdpzero.wrap(model, inference, allow_no_optimizer=True)
        engine.module.eval()
        self._inference_engines.append(engine)     # alive as long as the trainer: the model is its module
        return True

    def _sync_replicated_trainable_parameters(self, model: nn.Module) -> None:
        """Nothing: transformers adds a broadcast and a per-parameter all-reduce hook for trainable parameters that
        are not DTensors (stage 1's replicated parameters), on top of the engine's bucketed reduce-scatter, which
        already averages every trainable gradient."""

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the engine reloads the best checkpoint's state (model, and optimizer and scheduler,
        as transformers + DeepSpeed do) into the sharded model; PEFT adapters load through PEFT."""
        best = self.state.best_model_checkpoint
        if is_peft_model(self.model):
            return super()._load_best_model()
        if not os.path.isfile(os.path.join(best, "latest")):
            raise ValueError(f"load_best_model_at_end: {best} holds no engine checkpoint (saved with "
                             "save_only_model=True?); as with DeepSpeed, the best model loads from a full checkpoint")
        self.engine.load_checkpoint(best)

    def _move_model_to_device(self, model: nn.Module, device) -> None:
        """Nothing: the engine placed every shard (on the accelerator, or on the CPU for offload_param). transformers
        before the "sharded at load time" flag moves the model with .to(device), which would pull CPU-offloaded
        shards onto the GPU."""

    def _stepped_by_optimizer(self, scheduler):
        if scheduler is None or not self._scheduler_steps_with_optimizer:
            return scheduler
        self._engine_optimizer.scheduler = scheduler
        return _StepsWithOptimizer(scheduler)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's own scheduler (no scheduler section), stepped where transformers + DeepSpeed step it."""
        made = self.lr_scheduler is None
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if made:
            self.lr_scheduler = scheduler = self._stepped_by_optimizer(scheduler)
        return scheduler

    def _own_scheduler(self):
        """The scheduler the Trainer made or was given (saved to scheduler.pt), or None for the config's."""
        scheduler = getattr(self.lr_scheduler, "inner", self.lr_scheduler)
        return None if scheduler is None or scheduler is self.engine.lr_scheduler else scheduler

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """Off-boundary micro-steps: accumulate locally, no reduce-scatter (the engine's set_sync)."""
        self.engine.grad_path.set_sync(False)
        try:
            yield
        finally:
            self.engine.grad_path.set_sync(True)

    def _clip_grad_norm(self, model):
        """The engine's clipping: the global norm over all shards, DeepSpeed's clip factor."""
        from fsdpzero.optim import clip_factor
        path = self.engine.grad_path
        path.finish_gradients()
        norm = path.grad_norm()
        path.scale_grads_(clip_factor(norm, self.args.max_grad_norm))
        return norm

    # -- saving and resuming: the engine writes, streamed and sharded; the Trainer keeps its own files --------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face folder plain `from_pretrained` loads (safetensors in the compute dtype + config), written
        by the engine's streamed export: one full tensor at a time on rank 0, never the whole model. At stage 3 with
        `stage3_gather_16bit_weights_on_model_save: false`, as DeepSpeed: no weights, the full engine checkpoint
        instead (`fsdpzero convert DIR --to safetensors` recovers them). Collective: every rank calls it."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        plan = self.engine.plan
        if is_peft_model(self.model):
            self._save_adapters(output_dir)
        elif plan.shard.stage == 3 and not plan.shard.gather_16bit_weights_on_model_save:
            if self.args.should_save:
                logging.getLogger("fsdpzero").warning(
                    "stage3_gather_16bit_weights_on_model_save=false: saving the full checkpoint to %s instead of "
                    "model weights; `fsdpzero convert %s --to safetensors` writes them", output_dir, output_dir)
            self._save_engine_checkpoint(output_dir)
            self._engine_checkpoint_in = output_dir
        else:
            self.engine.save_16bit_model(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_adapters(self, output_dir: str) -> None:
        """A PEFT model: the adapter only, as transformers + DeepSpeed save it at every stage."""
        from fsdpzero.precision import DTYPES
        self.engine.wait_for_params()
        save_adapters(self.model, output_dir, DTYPES[self.engine.plan.precision.param_dtype], self.args.should_save)

    def save_merged_model(self, output_dir: str, max_shard_size: int | str = "5GB") -> None:
        """A PEFT model's full weights with the LoRA adapters merged in, as a from_pretrained folder of the base
        model (what PEFT's merge_and_unload() + save_pretrained() give), streamed one weight at a time in the
        compute dtype. Collective: every rank calls it."""
        from fsdpzero.precision import DTYPES
        if not is_peft_model(self.model):
            raise ValueError("save_merged_model: the model is not a PEFT model; use save_model")
        self.engine.wait_for_params()
        dtype = DTYPES[self.engine.plan.precision.param_dtype]
        save_merged_model(self.model, output_dir, dtype=None if dtype == torch.float32 else dtype,
                          max_shard_size=max_shard_size, param_swapper=self.engine.grad_path.param_swapper)
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """DeepSpeed's layout inside the Trainer's checkpoint-N/: global_stepN/ (model, optimizer, the config's
        scheduler and engine counters, sharded DCP) and `latest`, as transformers + DeepSpeed write it. A scheduler
        the Trainer made (no scheduler section) goes to scheduler.pt, as transformers does under DeepSpeed."""
        if getattr(self, "_engine_checkpoint_in", None) == output_dir:   # save_model already wrote it
            self._engine_checkpoint_in = None
        else:
            self._save_engine_checkpoint(output_dir)
        if self._own_scheduler() is not None and self.args.should_save:
            torch.save(self._own_scheduler().state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _save_engine_checkpoint(self, output_dir: str) -> None:
        """Tagged global_step<Trainer step>, as DeepSpeed's is under the Trainer (the engine's counters follow the
        Trainer's optimizer steps: _EngineOptimizer.step)."""
        self.engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """resume_from_checkpoint: the engine reloads model, optimizer, scheduler and its counters from the
        checkpoint's global_stepN/ (any stage or world size); the Trainer then reads its state and RNG files."""
        path, _ = self.engine.load_checkpoint(resume_from_checkpoint)
        if path is None:
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: no engine checkpoint there (no "
                             "`latest` / global_stepN); checkpoints saved with save_only_model=True hold weights "
                             "only and cannot resume training, as with DeepSpeed")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """_load_from_checkpoint restored the optimizer and the config's scheduler with the model; a scheduler the
        Trainer made is read back from scheduler.pt (tensors only: weights_only)."""
        scheduler = self._own_scheduler()
        if checkpoint is None or scheduler is None:
            return
        scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))
        # the Trainer built this scheduler after the engine restored the optimizer, and building it reset the
        # groups' lr to the schedule's start: put back the rate of the restored step
        for group, lr in zip(self.engine.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            self.engine.grad_path.finish_gradients()
            grad_norm = self.engine.grad_path.grad_norm()
        return grad_norm.item() if hasattr(grad_norm, "item") else grad_norm
