"""The plan: what a DeepSpeed config becomes under FSDP2.

Frozen dataclasses, produced by the pure function `fsdpzero.plan.translate.translate(config, env)` and consumed by the
engine. Nothing here imports torch or torch.distributed: dtypes are strings ("float32", "bfloat16", "float16") so
`fsdpzero migrate` stays fast and the plan serialises to JSON as it is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from fsdpzero.config.schema import FP16, OffloadOptimizer, OffloadParam, ZenFlow, ZeroOptimization
from fsdpzero.config.sections import ActivationCheckpointing, Aio, Checkpoint, Compile

Status = Literal["mapped", "approximated", "noop", "unsupported"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True, kw_only=True)
class Env:
    """Where the plan will run. Pure data: `fsdpzero migrate --world-size 8` builds one without any GPU."""
    world_size: int = 1
    nodes: int = 1
    device_type: Literal["cpu", "cuda"] = "cpu"

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.world_size // max(1, self.nodes))


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The fate of one DeepSpeed key: printed once at start and in `fsdpzero migrate`."""
    key: str                      # dotted path, e.g. "zero_optimization.stage3_prefetch_bucket_size"
    value: Any
    status: Status
    detail: str                   # one line naming the FSDP2 API or ops/ component that carries it (or why not)
    explicit: bool = True         # False when the value is DeepSpeed's default, not written by the user


def schema_default(section: type[BaseModel], key: str) -> Any:
    """A key's default as the schema declares it (DeepSpeed's), for a plan field that renames or merges sections."""
    return section.model_fields[key].get_default(call_default_factory=True)


@dataclass(frozen=True, kw_only=True)
class ShardPlan:
    """How parameters, gradients and optimizer state are laid out. The zero_optimization keys it carries take the
    schema's defaults (sizes in elements, as DeepSpeed counts them)."""
    stage: int = schema_default(ZeroOptimization, "stage")   # 0 replicate, 1 ops stage-1 optimizer, 2/3 fully_shard
    reshard_after_forward: bool | int = False       # stage 3: True; hpZ: int group size; stage 2: False
    mesh_shape: tuple[int, ...] = (1,)              # (dp,) or (replicate, shard) for MiCS / hybrid
    mesh_dim_names: tuple[str, ...] = ("dp",)
    prefetch_depth: int = 1                         # modules prefetched ahead, from stage3_prefetch_bucket_size
    prefetch_bucket_size: int = schema_default(ZeroOptimization, "prefetch_bucket_size")
    # modules with fewer params stay unsharded (stage 3)
    param_persistence_threshold: int = schema_default(ZeroOptimization, "param_persistence_threshold")
    # the real knob for stage 0 (DDP) and stage 1 (fsdpzero_ops.stage1, which takes it as a plain argument)
    reduce_bucket_size: int = schema_default(ZeroOptimization, "reduce_bucket_size")
    allgather_bucket_size: int = schema_default(ZeroOptimization, "allgather_bucket_size")   # stage 1's
    overlap_comm: bool = False                      # the schema's None resolves to stage == 3
    ignore_unused_parameters: bool = schema_default(ZeroOptimization, "ignore_unused_parameters")
    gather_16bit_weights_on_model_save: bool = schema_default(ZeroOptimization, "gather_16bit_weights_on_model_save")


@dataclass(frozen=True, kw_only=True)
class LossScalePlan:
    """DeepSpeed's fp16 DynamicLossScaler settings (static when loss_scale > 0); the defaults are the schema's fp16
    section's (fsdpzero.loss_scaler takes them as plain arguments)."""
    loss_scale: float = float(schema_default(FP16, "loss_scale"))
    initial_scale_power: int = schema_default(FP16, "initial_scale_power")
    loss_scale_window: int = schema_default(FP16, "loss_scale_window")
    hysteresis: int = schema_default(FP16, "hysteresis")
    consecutive_hysteresis: bool = schema_default(FP16, "consecutive_hysteresis")
    min_loss_scale: float = float(schema_default(FP16, "min_loss_scale"))


@dataclass(frozen=True, kw_only=True)
class PrecisionPlan:
    param_dtype: DType = "float32"          # compute dtype of the all-gathered params (MixedPrecisionPolicy)
    reduce_dtype: DType = "float32"         # communication_data_type (DeepSpeed default: the model dtype)
    master_dtype: DType = "float32"         # DeepSpeed always keeps fp32 masters unless bf16_master_weights...
    optimizer_state_dtype: DType = "float32"  # bf16.bf16_optimizer_states -> "bfloat16"
    loss_scale: LossScalePlan | None = None  # set iff fp16
    check_grad_overflow: bool = False       # bf16: skip steps with inf/nan grads (DeepSpeed >= 0.19.3 default)
    autocast_dtype: DType | None = None     # torch_autocast section


def section_plan(name: str, section: type[BaseModel], doc: str) -> type:
    """A frozen plan dataclass with a schema section's keys, types and defaults: the section is declared once, in
    fsdpzero/config (a key added there is a plan field here, with its default)."""
    spec = [(key, f.annotation, field() if f.is_required() else field(default_factory=f.default_factory)
             if f.default_factory else field(default=f.default)) for key, f in section.model_fields.items()]
    cls = dataclasses.make_dataclass(name, spec, frozen=True, kw_only=True)
    cls.__module__, cls.__doc__ = __name__, doc
    return cls


AioPlan = section_plan("AioPlan", Aio, "DeepSpeed's `aio` section as validated (fsdpzero.config.sections.Aio); "
                       "the NVMe swaps hand its values to fsdpzero_ops.aio.AioConfig.")


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """zero_optimization.offload_optimizer and offload_param (its keys as param_*), sub_group_size and the aio
    section. Every default is the schema's: a plan built without those sections equals the translated one."""
    optimizer_device: Literal["none", "cpu", "nvme"] = schema_default(OffloadOptimizer, "device")
    param_device: Literal["none", "cpu", "nvme"] = schema_default(OffloadParam, "device")
    pin_memory: bool = schema_default(OffloadParam, "pin_memory")
    optimizer_nvme_path: str | None = schema_default(OffloadOptimizer, "nvme_path")
    param_nvme_path: str | None = schema_default(OffloadParam, "nvme_path")
    buffer_count: int = schema_default(OffloadOptimizer, "buffer_count")   # optimizer swap buffers
    param_buffer_count: int = schema_default(OffloadParam, "buffer_count")
    param_buffer_size: int = schema_default(OffloadParam, "buffer_size")
    max_in_cpu: int = schema_default(OffloadParam, "max_in_cpu")
    ratio: float = schema_default(OffloadOptimizer, "ratio")
    sub_group_size: int = schema_default(ZeroOptimization, "sub_group_size")
    aio: AioPlan = field(default_factory=AioPlan)
    # offload_optimizer.super_offload at stage 3 (DeepSpeed reads it there only): the share of this rank's cores
    # the CPU step keeps, the rest reserved for PyTorch (cpuadam_cores_perc); None otherwise
    cpuadam_cores_perc: float | None = None


@dataclass(frozen=True, kw_only=True)
class OptimizerPlan:
    """type is canonical lower-case for DeepSpeed's own ("adamw", "adam", "lamb", "sgd", "adagrad", "lion"),
    or the exact torch.optim class name for anything else; None means the client supplies the optimizer."""
    type: str | None = None
    params: dict[str, Any] = field(default_factory=dict)   # kwargs, DeepSpeed-only keys removed
    torch_adam: bool = False
    adam_w_mode: bool = True
    zero_allow_untested_optimizer: bool = False


@dataclass(frozen=True, kw_only=True)
class SchedulerPlan:
    type: str | None = None                 # "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"
    params: dict[str, Any] = field(default_factory=dict)   # DeepSpeed's defaults filled in
    deferred: tuple[str, ...] = ()          # params given as "auto" that the trainer fills from the step count


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    train_batch_size: int = 1
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 1.0          # DeepSpeed >= 0.19.3 default
    gradient_predivide_factor: float = 1.0     # recorded, not applied: FSDP2 averages (fate approximated)
    prescale_gradients: bool = False
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    dataloader_drop_last: bool = False


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointPlan:
    enabled: bool = False                   # HF gradient_checkpointing or the section's presence
    cpu_checkpointing: bool = schema_default(ActivationCheckpointing, "cpu_checkpointing")
    # recorded only: sizes DeepSpeed's contiguous buffers (fate noop)
    number_checkpoints: int | None = schema_default(ActivationCheckpointing, "number_checkpoints")


@dataclass(frozen=True, kw_only=True)
class CompilePlan:
    """torch.compile per transformer block (fsdpzero/compile.py): the `compile` section's enabled/backend/kwargs,
    `deepcompile` (read as a request for the fastest compiled path), or fsdpzero's `compile` tuning knob."""
    enabled: bool = False                                  # the section's enabled or deepcompile, or the knob
    backend: str = schema_default(Compile, "backend")
    kwargs: dict[str, Any] = field(default_factory=dict)   # torch.compile keyword arguments (mode, dynamic, ...)
    source: str = ""                                       # what turned it on: a config key or the knob


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    tag_validation: Literal["ignore", "warn", "fail"] = schema_default(Checkpoint, "tag_validation").lower()
    load_universal: bool = schema_default(Checkpoint, "load_universal")
    # recorded only: one node is a noop, several unsupported
    use_node_local_storage: bool = schema_default(Checkpoint, "use_node_local_storage")
    async_save: bool = False
    keep_last: int | None = None


@dataclass(frozen=True, kw_only=True)
class MonitorPlan:
    """The enabled monitor sections as DeepSpeed spells them (None = off): the Engine's fsdpzero.monitor.Monitor."""
    tensorboard: dict[str, Any] | None = None
    csv_monitor: dict[str, Any] | None = None
    wandb: dict[str, Any] | None = None
    comet: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class ZenFlowPlan:
    """`zero_optimization.zenflow`, resolved as DeepSpeed 0.19.8's configure_zenflow does (fsdpzero.optim.zenflow):
    select_interval in steps (0: select once, after the warm-up rounds; "auto" is the "epoch" strategy, 1 epoch);
    update_interval None for "auto"."""
    topk_ratio: float = schema_default(ZenFlow, "topk_ratio")
    select_strategy: str = "epoch"          # "step" or "epoch" ("auto" resolves to "epoch")
    select_interval: int = 0
    update_interval: int | None = None
    overlap_step: bool = schema_default(ZenFlow, "overlap_step")
    offload: bool = schema_default(ZenFlow, "offload")
    auto_ratio: float = schema_default(ZenFlow, "auto_ratio")
    full_warm_up_rounds: int = schema_default(ZenFlow, "full_warm_up_rounds")
    pt_reserved_cores_perc: float = schema_default(ZenFlow, "pt_reserved_cores_perc")


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """DeepSpeed's AutoTP training (`tensor_parallel` section): DTensor tensor parallelism over the mesh's "tp"
    dimension (fsdpzero/parallel/tensor_parallel.py), FSDP2 over the data-parallel dimensions. size 1: off."""
    size: int = 1                                    # tensor_parallel.autotp_size (DeepSpeed's 0 and 1: off)
    preset_model: str | None = None                  # one of DeepSpeed's AutoTPPresets (validated)
    partition_config: dict[str, Any] | None = None   # DeepSpeed's AutoTPConfig as JSON (validated)


@dataclass(frozen=True, kw_only=True)
class SequenceParallelPlan:
    """DeepSpeed's Ulysses / ALST (`sequence_parallel_size`): each sequence split over `size` consecutive ranks,
    all-to-all attention over heads (fsdpzero/parallel/ulysses.py); ZeRO shards over all ranks, dp x sp, as
    DeepSpeed's sequence-data-parallel group; the batch triad counts world / size. size 1: off."""
    size: int = 1


@dataclass(frozen=True, kw_only=True)
class Plan:
    env: Env = field(default_factory=Env)
    shard: ShardPlan = field(default_factory=ShardPlan)
    precision: PrecisionPlan = field(default_factory=PrecisionPlan)
    offload: OffloadPlan = field(default_factory=OffloadPlan)
    optimizer: OptimizerPlan = field(default_factory=OptimizerPlan)
    scheduler: SchedulerPlan = field(default_factory=SchedulerPlan)
    batch: BatchPlan = field(default_factory=BatchPlan)
    activation_checkpointing: ActivationCheckpointPlan = field(default_factory=ActivationCheckpointPlan)
    compile: CompilePlan = field(default_factory=CompilePlan)
    checkpoint: CheckpointPlan = field(default_factory=CheckpointPlan)
    monitor: MonitorPlan = field(default_factory=MonitorPlan)
    sequence_parallel: SequenceParallelPlan = field(default_factory=SequenceParallelPlan)
    tensor_parallel: TensorParallelPlan = field(default_factory=TensorParallelPlan)
    zenflow: ZenFlowPlan | None = None      # zero_optimization.zenflow: fsdpzero.optim.zenflow's gradient path
    decisions: tuple[Decision, ...] = ()

    @property
    def unsupported(self) -> list[Decision]:
        return [d for d in self.decisions if d.status == "unsupported"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the decisions are reported separately by `fsdpzero migrate`."""
        d = dataclasses.asdict(self)
        d.pop("decisions")
        return d


# Who reads each plan field that a mapped/approximated fate names ("module:qualname", or a module where a whole
# section is read by name): the claim "this key is carried" points here, and tests/plan/test_fate_consumers.py
# imports each consumer and checks that it reads the field. A field no runtime code reads has no entry, and a fate
# naming it fails that test.
CONSUMERS: dict[str, tuple[str, ...]] = {
    "ActivationCheckpointPlan.cpu_checkpointing": ("fsdpzero.sharding:checkpoint_activations",),
    **{f"AioPlan.{f}": ("fsdpzero_ops.aio:AioConfig",) for f in (
        "block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds")},
    "BatchPlan.train_batch_size": ("fsdpzero.engine:Engine.train_batch_size",),
    "BatchPlan.micro_batch_size": ("fsdpzero.engine:Engine.train_micro_batch_size_per_gpu",),
    "BatchPlan.gradient_accumulation_steps": ("fsdpzero.engine:Engine.gradient_accumulation_steps",),
    "BatchPlan.wall_clock_breakdown": ("fsdpzero.engine:Engine.__init__",),
    "CheckpointPlan.tag_validation": ("fsdpzero.checkpoint.engine_state:save_engine",),
    "CheckpointPlan.async_save": ("fsdpzero.checkpoint.engine_state:save_engine",),
    "CheckpointPlan.load_universal": ("fsdpzero.checkpoint.engine_state:from_deepspeed",),
    **{f"LossScalePlan.{f}": ("fsdpzero.loss_scaler:make_loss_scaler",) for f in (
        "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
        "min_loss_scale")},
    **{f"MonitorPlan.{f}": ("fsdpzero.monitor",) for f in (   # the Engine's Monitor(plan.monitor)
        "tensorboard", "csv_monitor", "wandb", "comet")},
    "OffloadPlan.optimizer_device": ("fsdpzero.api:grad_path_type",),
    "OffloadPlan.param_device": ("fsdpzero.sharding:offload_policy",),
    "OffloadPlan.pin_memory": ("fsdpzero.sharding:offload_policy",),
    "OffloadPlan.optimizer_nvme_path": ("fsdpzero.offload.nvme_adam:NVMeAdam.__init__",),
    "OffloadPlan.buffer_count": ("fsdpzero.offload.nvme_adam:NVMeAdam.__init__",),
    "OffloadPlan.aio": ("fsdpzero.offload.nvme_adam:NVMeAdam.__init__",
                        "fsdpzero.offload.param_swapper:ParamSwapper.__init__"),
    **{f"OffloadPlan.{f}": ("fsdpzero.offload.param_swapper:ParamSwapper.__init__",) for f in (
        "param_nvme_path", "param_buffer_count", "param_buffer_size", "max_in_cpu")},
    "OffloadPlan.ratio": ("fsdpzero.offload.path:OffloadGradPath.build",),
    "OffloadPlan.cpuadam_cores_perc": ("fsdpzero.offload.path:OffloadGradPath.build",),
    "OffloadPlan.sub_group_size": ("fsdpzero.offload.prepare:chunk_size",),
    "OptimizerPlan.type": ("fsdpzero.optim.factory:make_optimizer_factory",),
    "OptimizerPlan.params": ("fsdpzero.optim.factory:make_optimizer_factory",),
    "OptimizerPlan.torch_adam": ("fsdpzero.optim.factory:make_optimizer_factory",),
    "OptimizerPlan.adam_w_mode": ("fsdpzero.optim.factory:make_optimizer_factory",),
    "OptimizerPlan.zero_allow_untested_optimizer": ("fsdpzero.optim.factory:check_optimizer",),
    "PrecisionPlan.master_dtype": ("fsdpzero.precision:upcast_to_master",),
    "PrecisionPlan.optimizer_state_dtype": ("fsdpzero.optim.factory:check_optimizer",),
    "PrecisionPlan.check_grad_overflow": ("fsdpzero.precision:checks_overflow",),
    "PrecisionPlan.autocast_dtype": ("fsdpzero.precision:autocast",),
    "SchedulerPlan.type": ("fsdpzero.optim.schedulers:build_scheduler",),
    "SchedulerPlan.params": ("fsdpzero.optim.schedulers:build_scheduler",),
    "ShardPlan.stage": ("fsdpzero.sharding:shard_model",),
    "ShardPlan.reshard_after_forward": ("fsdpzero.sharding:reshard_policy",),
    "ShardPlan.prefetch_depth": ("fsdpzero.sharding:prefetch_depth",),
    "ShardPlan.param_persistence_threshold": ("fsdpzero.sharding:shard_model",),
    "ShardPlan.reduce_bucket_size": ("fsdpzero.optim.stage1:Stage1GradPath.build",),
    "ShardPlan.allgather_bucket_size": ("fsdpzero.optim.stage1:Stage1GradPath.build",),
    "ShardPlan.gather_16bit_weights_on_model_save": ("fsdpzero.hf.trainer:Trainer.save_model",),
    "SequenceParallelPlan.size": ("fsdpzero.parallel.ulysses:apply_sequence_parallel",),
    "TensorParallelPlan.size": ("fsdpzero.sharding:build_mesh", "fsdpzero.parallel.tp_plan:resolve_tp_plan"),
    "TensorParallelPlan.preset_model": ("fsdpzero.parallel.tp_plan:resolve_tp_plan",),
    "TensorParallelPlan.partition_config": ("fsdpzero.parallel.tp_plan:resolve_tp_plan",),
}
