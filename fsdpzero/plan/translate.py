"""Pure translation: validated DeepSpeed config + Env -> Plan, with a Decision for every key.

No torch, no process group: `fsdpzero migrate` runs this on a laptop. `build_plan` is load + "auto" + batch
triad + translate in one call, which is what the engine uses.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from pydantic import BaseModel

from fsdpzero.config import ConfigError, DSConfig, Problem, load_config, resolve_batch
from fsdpzero.config.autotp import effective_partition_config
from fsdpzero.config.load import model_of
from fsdpzero.config.rules import SCHEDULERS, canonical_optimizer, optimizer_kind
from fsdpzero.config.schema import Aio, OffloadOptimizer, OffloadParam
from fsdpzero.plan.fates import UNKNOWN_FATE, decide
from fsdpzero.plan import (ActivationCheckpointPlan, AioPlan, BatchPlan, CheckpointPlan, CompilePlan, Decision, Env,
                           LossScalePlan, MonitorPlan, OffloadPlan, OptimizerPlan, Plan, PrecisionPlan,
                           SchedulerPlan, ShardPlan)
from fsdpzero.plan.types import SequenceParallelPlan, ZenFlowPlan
from fsdpzero.plan.types import TensorParallelPlan

_DT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", None: None}
# DeepSpeed-only optimizer params: consumed here (plan fields) or meaningless outside DeepSpeed's kernels
_DS_ONLY_OPT_PARAMS = ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "set_grad_none")


def build_plan(source: Any, env: Env | None = None, *, context: Mapping[str, Any] | None = None,
               strict: bool = False, hf_defaults: bool = False) -> Plan:
    env = env or Env()
    ctx = dict(context or {})
    ctx.setdefault("world_size", env.world_size)
    return translate(load_config(source, context=ctx, hf_defaults=hf_defaults, strict=strict), env)


def translate(cfg: DSConfig, env: Env) -> Plan:
    """Raises ConfigError only for what depends on the environment (batch triad, mesh shape)."""
    sequence_parallel = _sequence_parallel(cfg, env)
    train, micro, ga = resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                     cfg.gradient_accumulation_steps, env.world_size // sequence_parallel.size)
    z = cfg.zero_optimization
    W = env.world_size
    if z.mics_shard_size > 0 and (W % z.mics_shard_size or z.mics_shard_size > W):
        raise ConfigError(Problem("zero_optimization.mics_shard_size",
                                  f"{z.mics_shard_size} does not divide the world size {W}",
                                  "use a divisor of the world size, e.g. the GPUs per node "
                                  f"({env.ranks_per_node})"))
    hpz = z.zero_hpz_partition_size
    if z.stage == 3 and hpz > 1 and (W % hpz or hpz > W):
        raise ConfigError(Problem("zero_optimization.zero_hpz_partition_size",
                                  f"{hpz} does not divide the world size {W} (FSDP2's reshard_after_forward=int "
                                  "needs a divisor)", f"use the GPUs per node ({env.ranks_per_node}) or 1"))
    tensor_parallel = _tensor_parallel(cfg, env)
    plan = Plan(env=env, shard=_shard(cfg, env, W // tensor_parallel.size), precision=_precision(cfg),
                offload=_offload(cfg), tensor_parallel=tensor_parallel,
                sequence_parallel=sequence_parallel, optimizer=_optimizer(cfg), scheduler=_scheduler(cfg),
                batch=BatchPlan(train_batch_size=train, micro_batch_size=micro, gradient_accumulation_steps=ga,
                                gradient_clipping=float(cfg.gradient_clipping),
                                gradient_predivide_factor=float(cfg.gradient_predivide_factor),
                                prescale_gradients=cfg.prescale_gradients, steps_per_print=cfg.steps_per_print,
                                wall_clock_breakdown=cfg.wall_clock_breakdown or bool(
                                    cfg.flops_profiler and cfg.flops_profiler.enabled),
                                dataloader_drop_last=cfg.dataloader_drop_last),
                activation_checkpointing=_activation(cfg), checkpoint=_checkpoint(cfg), monitor=_monitor(cfg),
                compile=_compile(cfg), zenflow=_zenflow(cfg, ga), decisions=tuple(decisions(cfg, env)))
    return plan


# ---------------------------------------------------------------- plan sections
def _tensor_parallel(cfg: DSConfig, env: Env) -> TensorParallelPlan:
    """AutoTP training: tensor_parallel.autotp_size > 1 (DeepSpeed reads the section only then). Its checks:
    the size divides the world (DeepSpeed's _ensure_divisibility), tp.tp_size is 1 or the same (its ValueError),
    and the preset and partition_config are read (fsdpzero.config.autotp, stricter than DeepSpeed on typos). The
    batch triad above counts the whole world, tp ranks included, as DeepSpeed 0.19.8's config does."""
    tp = cfg.tensor_parallel
    size = tp.autotp_size if tp is not None else 0
    if size <= 1:
        return TensorParallelPlan()
    W = env.world_size
    if W % size:
        raise ConfigError(Problem("tensor_parallel.autotp_size", f"{size} does not divide the world size {W}",
                                  "use a divisor of the world size, at most the GPUs per node "
                                  f"({env.ranks_per_node})"))
    if tp.tensor_parallel.tp_size not in (1, size):
        raise ConfigError(Problem("tensor_parallel.tp.tp_size", f"{tp.tensor_parallel.tp_size} does not match "
                                  f"tensor_parallel.autotp_size ({size})", f"remove it, or set it to {size}"))
    effective_partition_config(tp.preset_model, tp.partition_config)   # raises ConfigError on a bad one
    return TensorParallelPlan(size=size, preset_model=tp.preset_model.lower() if tp.preset_model else None,
                              partition_config=tp.partition_config)


def _sequence_parallel(cfg: DSConfig, env: Env) -> SequenceParallelPlan:
    """Ulysses: sequence_parallel_size > 1 divides the world (DeepSpeed's initialize_sequence_parallel raises
    otherwise), and with AutoTP the world / autotp_size replicas; the batch triad then counts world / size ranks,
    as DeepSpeed 0.19.8's config (tp ranks counted, as for AutoTP alone)."""
    size = cfg.sequence_parallel_size or 1
    if size <= 1:
        return SequenceParallelPlan()
    tp = cfg.tensor_parallel.autotp_size if cfg.tensor_parallel is not None else 0
    tp = tp if tp > 1 else 1
    if env.world_size % (size * tp):
        what = f"the world size {env.world_size}" + (f" / tensor_parallel.autotp_size {tp}" if tp > 1 else "")
        raise ConfigError(Problem("sequence_parallel_size", f"{size} does not divide {what}",
                                  f"use a divisor of {env.world_size // tp if env.world_size % tp == 0 else env.world_size}"))
    return SequenceParallelPlan(size=size)


def _shard(cfg: DSConfig, env: Env, data_world: int) -> ShardPlan:
    z = cfg.zero_optimization
    reshard: bool | int = z.stage == 3
    if z.stage == 3 and z.zero_hpz_partition_size > 1:
        reshard = z.zero_hpz_partition_size
    if z.mics_shard_size > 0:
        k = z.mics_shard_size
        mesh, names = (data_world // k, k), ("replicate", "shard")
    else:
        mesh, names = (data_world,), ("dp",)
    # prefetch depth: how many ~block-sized units fit in the budget; the engine refines it with block sizes
    depth = 1 if z.prefetch_bucket_size > 0 else 0
    return ShardPlan(stage=z.stage, reshard_after_forward=reshard, mesh_shape=mesh, mesh_dim_names=names,
                     prefetch_depth=depth, prefetch_bucket_size=z.prefetch_bucket_size,
                     param_persistence_threshold=z.param_persistence_threshold,
                     reduce_bucket_size=z.reduce_bucket_size, allgather_bucket_size=z.allgather_bucket_size,
                     overlap_comm=bool(z.overlap_comm), ignore_unused_parameters=z.ignore_unused_parameters,
                     gather_16bit_weights_on_model_save=z.gather_16bit_weights_on_model_save)


def _precision(cfg: DSConfig) -> PrecisionPlan:
    fp16, bf16 = cfg.fp16, cfg.bf16
    model = "float16" if fp16.enabled else "bfloat16" if bf16.enabled else "float32"
    param = _DT[cfg.data_types.param_dtype] if cfg.data_types and cfg.data_types.param_dtype else model
    reduce = _DT[cfg.communication_data_type] or model
    master = ("float16" if fp16.enabled and fp16.fp16_master_weights_and_grads else
              "bfloat16" if bf16.enabled and bf16.bf16_master_weights_and_grads else "float32")
    states = "bfloat16" if bf16.enabled and bf16.bf16_optimizer_states else "float32"
    scaler = None
    if fp16.enabled:
        scaler = LossScalePlan(loss_scale=float(fp16.loss_scale), initial_scale_power=fp16.initial_scale_power,
                               loss_scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                               consecutive_hysteresis=fp16.consecutive_hysteresis,
                               min_loss_scale=float(fp16.min_loss_scale))
    autocast = None
    if cfg.torch_autocast is not None and cfg.torch_autocast.enabled:
        autocast = _DT[cfg.torch_autocast.dtype] or "bfloat16"
    return PrecisionPlan(param_dtype=param, reduce_dtype=reduce, master_dtype=master, optimizer_state_dtype=states,
                         loss_scale=scaler, check_grad_overflow=bool(bf16.enabled and bf16.check_grad_overflow),
                         autocast_dtype=autocast)


def _offload(cfg: DSConfig) -> OffloadPlan:
    z = cfg.zero_optimization
    # an absent section is the schema's defaults (DeepSpeed's), declared there only
    op, oo, aio = z.offload_param or OffloadParam(), z.offload_optimizer or OffloadOptimizer(), cfg.aio or Aio()
    return OffloadPlan(
        optimizer_device=oo.device, param_device=op.device,
        pin_memory=op.pin_memory,   # offload_param's: FSDP2's CPUOffloadPolicy is its one reader
        optimizer_nvme_path=oo.nvme_path, param_nvme_path=op.nvme_path,
        buffer_count=oo.buffer_count, param_buffer_count=op.buffer_count,
        param_buffer_size=op.buffer_size, max_in_cpu=op.max_in_cpu,
        ratio=oo.ratio, sub_group_size=z.sub_group_size,
        cpuadam_cores_perc=oo.cpuadam_cores_perc if oo.super_offload and z.stage == 3 else None,
        aio=AioPlan(**aio.model_dump(include=set(AioPlan.__dataclass_fields__))))


def _zenflow(cfg: DSConfig, ga: int) -> ZenFlowPlan | None:
    """DeepSpeed 0.19.8's configure_zenflow / ZenFlowZeroOptimizer._configure_zenflow: the strategy and intervals
    resolved, its refusals raised here (before any process group)."""
    z = cfg.zero_optimization
    zf = z.zenflow
    if zf is None:
        return None
    key = "zero_optimization.zenflow."
    if zf.select_strategy not in ("auto", "step", "epoch"):
        raise ConfigError(Problem(key + "select_strategy", f"{zf.select_strategy!r} is not a selection strategy",
                                  'use "auto", "step" or "epoch"'))
    for name in ("select_interval", "update_interval"):
        v = getattr(zf, name)
        if isinstance(v, str) and v != "auto":
            raise ConfigError(Problem(key + name, f"{v!r}: a string must be \"auto\"", 'use "auto" or a number'))
    if isinstance(zf.update_interval, int) and zf.update_interval < 1:
        raise ConfigError(Problem(key + "update_interval", f"{zf.update_interval} is below 1", "use 1 or more"))
    if zf.select_strategy == "auto":
        if isinstance(zf.select_interval, int):   # DeepSpeed raises (a Warning, as an exception)
            raise ConfigError(Problem(key + "select_interval", f"{zf.select_interval} with select_strategy \"auto\" "
                                      "(which selects once per epoch)", 'remove it, or set select_strategy "step"'))
        strategy, interval = "epoch", 1
    else:
        if isinstance(zf.select_interval, str):
            raise ConfigError(Problem(key + "select_interval", f"\"auto\" with select_strategy "
                                      f"{zf.select_strategy!r}", "give the interval as a number"))
        strategy, interval = zf.select_strategy, int(zf.select_interval)
    if strategy == "epoch":   # DeepSpeed: interval * len(training_dataloader) when one was given, else 0 (once)
        interval = interval * zf.steps_per_epoch if zf.steps_per_epoch else 0
    update = None if isinstance(zf.update_interval, str) else int(zf.update_interval)
    if update is not None and interval != 0 and interval < update:
        raise ConfigError(Problem(key + "select_interval", f"{interval} is below update_interval {update}",
                                  "select at most as often as the CPU updates"))
    if ga > 1:   # each micro-batch is one ZenFlow step: DeepSpeed sets gradient_accumulation_steps = update_interval
        raise ConfigError(Problem("gradient_accumulation_steps", f"{ga} with zero_optimization.zenflow (DeepSpeed "
                                  "replaces it with update_interval: every micro-batch is one ZenFlow step)",
                                  "set gradient_accumulation_steps to 1 (train_batch_size = micro batch x ranks)"))
    oo = z.offload_optimizer
    if oo is None or oo.device != "cpu":
        raise ConfigError(Problem("zero_optimization.offload_optimizer.device",
                                  f"{oo.device if oo else 'none'!r} with zero_optimization.zenflow (DeepSpeed: "
                                  "\"Zenflow must be used with cpu offload\")", 'set it to "cpu"'))
    if zf.offload and not z.overlap_comm:
        raise ConfigError(Problem(key + "offload", "true without zero_optimization.overlap_comm (DeepSpeed asserts "
                                  "\"offload selective optimizer should be used with overlap_comm\")",
                                  "set overlap_comm true, or zenflow.offload false"))
    return ZenFlowPlan(topk_ratio=zf.topk_ratio, select_strategy=strategy, select_interval=interval,
                       update_interval=update, overlap_step=zf.overlap_step, offload=zf.offload,
                       auto_ratio=zf.auto_ratio, full_warm_up_rounds=zf.full_warm_up_rounds,
                       pt_reserved_cores_perc=zf.pt_reserved_cores_perc)


def _optimizer(cfg: DSConfig) -> OptimizerPlan:
    opt = cfg.optimizer
    if opt is None or opt.type is None:
        return OptimizerPlan(zero_allow_untested_optimizer=cfg.zero_allow_untested_optimizer)
    params = {k: v for k, v in opt.params.items() if k not in _DS_ONLY_OPT_PARAMS}
    if "betas" in params:
        params["betas"] = list(params["betas"])
    return OptimizerPlan(type=canonical_optimizer(opt.type, opt.params), params=params,
                         torch_adam=bool(opt.params.get("torch_adam", False)),
                         adam_w_mode=bool(opt.params.get("adam_w_mode", True)) or opt.type.lower() == "adamw",
                         zero_allow_untested_optimizer=cfg.zero_allow_untested_optimizer)


def _scheduler(cfg: DSConfig) -> SchedulerPlan:
    sch = cfg.scheduler
    if sch is None or sch.type is None:
        return SchedulerPlan()
    params = dict(sch.params)
    for key, default in SCHEDULERS.get(sch.type, {}).items():
        if key not in params and key not in cfg.deferred and default != "required":
            params[key] = default
    if sch.type == "WarmupLR" and params.get("warmup_max_lr") is None and cfg.optimizer is not None:
        lr = cfg.optimizer.params.get("lr")     # DeepSpeed >= 0.17.2: WarmupLR peaks at the optimizer's lr
        if lr is not None:
            params["warmup_max_lr"] = lr
    if sch.type == "OneCycle":
        params["cycle_second_step_size"] = params["cycle_second_step_size"] or params["cycle_first_step_size"]
        if params["cycle_second_stair_count"] is None:
            params["cycle_second_stair_count"] = params["cycle_first_stair_count"]
    return SchedulerPlan(type=sch.type, params=params, deferred=tuple(cfg.deferred))


def _activation(cfg: DSConfig) -> ActivationCheckpointPlan:
    ac = cfg.activation_checkpointing
    if ac is None:
        return ActivationCheckpointPlan()
    return ActivationCheckpointPlan(enabled=True, cpu_checkpointing=ac.cpu_checkpointing,
                                    number_checkpoints=ac.number_checkpoints)


def _compile(cfg: DSConfig) -> CompilePlan:
    """enabled (older DeepSpeed's key) or deepcompile: torch.compile per block; DeepCompile's own graph passes are
    not carried, so deepcompile asks for the same per-block compile, with the section's backend (inductor)."""
    c = cfg.compile
    if c is None:
        return CompilePlan()
    on = c.enabled or c.deepcompile     # off: backend and kwargs still serve the `compile` knob
    return CompilePlan(enabled=on, backend=c.backend, kwargs=dict(c.kwargs),
                       source=("compile.enabled" if c.enabled else "compile.deepcompile") if on else "")


def _checkpoint(cfg: DSConfig) -> CheckpointPlan:
    c = cfg.checkpoint
    if c is None:
        return CheckpointPlan()
    return CheckpointPlan(tag_validation=c.tag_validation.lower(), load_universal=c.load_universal,
                          use_node_local_storage=c.use_node_local_storage,
                          async_save=bool(c.writer and c.writer.decoupled))


def _monitor(cfg: DSConfig) -> MonitorPlan:
    def on(section):
        return section.model_dump() if section is not None and section.enabled else None
    return MonitorPlan(tensorboard=on(cfg.tensorboard), csv_monitor=on(cfg.csv_monitor), wandb=on(cfg.wandb),
                       comet=on(cfg.comet))


# ---------------------------------------------------------------- decisions
@functools.lru_cache(maxsize=None)
def schema_paths(model: type[BaseModel] = DSConfig, prefix: str = "") -> tuple[str, ...]:
    """Every canonical dotted key of the schema (DeepSpeed's documented spelling)."""
    out: list[str] = []
    for name, f in model.model_fields.items():
        key = prefix + (f.alias or name)
        out.append(key)
        sub = model_of(f.annotation)
        if sub is not None:
            out += schema_paths(sub, key + ".")
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _canonical(path: str) -> tuple[str, bool]:
    """User spelling -> (canonical spelling, known to the schema)."""
    model: Any = DSConfig
    parts, out = path.split("."), []
    for i, part in enumerate(parts):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ".".join(out + parts[i:]), True     # inside a free-form dict (optimizer.params.lr)
        hit = next(((n, f) for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if hit is None:
            return path, False
        out.append(hit[1].alias or hit[0])
        model = model_of(hit[1].annotation) or hit[1].annotation
    return ".".join(out), True


def _value(cfg: DSConfig, canonical: str) -> Any:
    node: Any = cfg
    for part in canonical.split("."):
        if isinstance(node, BaseModel):
            name = next((n for n, f in type(node).model_fields.items() if part in (n, f.alias)), part)
            node = getattr(node, name, None)
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            return None
    return node.model_dump(by_alias=True) if isinstance(node, BaseModel) else node


def _defaulted(cfg: DSConfig) -> list[str]:
    """Canonical keys the user did not write but whose DeepSpeed default applies: the top level and every field
    of each section present in the config (or always present: zero_optimization, fp16, bf16)."""
    out = []
    for name, f in DSConfig.model_fields.items():
        if model_of(f.annotation) is None:
            out.append(f.alias or name)
    for section in ("zero_optimization", "fp16", "bf16", *[k for k in cfg.raw if k in DSConfig.model_fields]):
        sub = model_of(DSConfig.model_fields[section].annotation)
        if sub is None:
            continue
        for p in schema_paths(sub, section + "."):
            parent = p.rsplit(".", 1)[0]
            if parent in _FREE_FORM:
                continue                            # the section is one row
            if parent == section or _value(cfg, parent) is not None:
                out.append(p)
    return list(dict.fromkeys(out))


def decisions(cfg: DSConfig, env: Env) -> list[Decision]:
    out: list[Decision] = []
    seen = set()
    autos = cfg.autos
    unknown = cfg.unknown_keys
    for path in cfg.explicit_keys:
        if not _is_row(cfg, path):
            continue
        canon, known = _canonical(path)
        if path in unknown or not known:
            out.append(Decision(key=path, value=unknown.get(path), status=UNKNOWN_FATE[0],
                                detail=UNKNOWN_FATE[1]))
            continue
        if any(path.startswith(u + ".") for u in unknown):
            continue
        value = _value(cfg, canon)
        status, detail = decide(canon, value, cfg, env)
        if path in autos:
            detail += f' ["auto" <- {autos[path][1]}]'
        if path in cfg.rounded:
            detail += f" [rounded from {cfg.rounded[path]!r}]"
        out.append(Decision(key=path, value=_jsonable(value), status=status, detail=detail))
        seen.add(canon)
    for canon in _defaulted(cfg):
        if canon in seen:
            continue
        value = _value(cfg, canon)
        status, detail = decide(canon, value, cfg, env)
        out.append(Decision(key=canon, value=_jsonable(value), status=status, detail=detail, explicit=False))
    for key in cfg.deferred:
        out.append(Decision(key=f"scheduler.params.{key}", value="auto", status="mapped",
                            detail="filled by the trainer from the number of training steps", explicit=True))
    return out


def _is_row(cfg: DSConfig, path: str) -> bool:
    """One table row per leaf the user wrote; a section of a free-form or unknown dict is one row."""
    if "." in path and any(path.startswith(p + ".") for p in _FREE_FORM + tuple(cfg.unknown_keys)):
        return False
    node: Any = cfg.raw
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and node and path not in cfg.unknown_keys and path not in _FREE_FORM:
        return False
    return True


# Sections listed as one row: free-form dicts, and whole features that are either off or unsupported.
_FREE_FORM = ("pipeline", "data_efficiency", "autotuning", "datastates", "expert_parallel",
              "zero_optimization.zenflow", "weight_quantization", "compile.kwargs")


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)
