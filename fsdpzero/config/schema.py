"""Typed schema of every ds_config section DeepSpeed knows, with DeepSpeed's defaults.

Field names and defaults follow DeepSpeed COMPAT_VERSION (see `fsdpzero.config.COMPAT_VERSION`). Sections that
DeepSpeed validates with pydantic (`extra="forbid"`) are `Strict` here too; sections DeepSpeed reads with
`dict.get` are `Lenient`: their unknown keys are kept (and reported by the loader), not rejected by pydantic.
We type-check lenient sections as well; DeepSpeed would only fail later, at first use.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Literal, Optional, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from fsdpzero.config.sections import (  # noqa: F401  (re-exported: schema.X names every section)
    Strict, Lenient, finite_number, DTypeName, dtype_name, Aio, ActivationCheckpointing, ParallelWrite,
    CheckpointWriter, Checkpoint, FlopsProfiler, TensorBoard, Wandb, CSVMonitor, Comet, CommsLogger,
    ThroughputTimer, Timers, TPInner, TensorParallel, Compile, HybridEngine, WeightQuantization)

COMPAT_VERSION = "0.19.8"   # the DeepSpeed release whose config semantics we follow, key by key


# ---------------------------------------------------------------- precision (strict in DeepSpeed >= 0.17.1)
class FP16(Strict):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1
    fp16_master_weights_and_grads: bool = False

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale(cls, v):
        if isinstance(v, bool):
            raise ValueError("must be a number, not bool")
        v = finite_number(v)
        if isinstance(v, (int, float)) and v < 0:
            raise ValueError("must be >= 0 (0 enables dynamic loss scaling)")
        return v

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _no_bool(cls, v):
        if isinstance(v, bool):
            raise ValueError("must be an integer, not bool")
        return finite_number(v)

    @model_validator(mode="after")
    def _dynamic_scaler(self):
        if self.enabled and self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise ValueError("loss_scale_window must be > 0 when dynamic loss scaling is enabled")
            if self.min_loss_scale <= 0:
                raise ValueError("min_loss_scale must be > 0 when dynamic loss scaling is enabled")
        return self


class BF16(Strict):
    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True           # default True since DeepSpeed 0.19.3
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


class TorchAutocast(Lenient):
    enabled: bool = False
    dtype: Optional[DTypeName] = None
    lower_precision_safe_modules: Optional[list[str]] = None
    _dtype = field_validator("dtype", mode="before")(classmethod(lambda cls, v: dtype_name(v)))


class DataTypes(Lenient):
    grad_accum_dtype: Optional[DTypeName] = None
    param_dtype: Optional[DTypeName] = None
    buffer_dtype: Optional[DTypeName] = None
    keep_in_fp32_modules: Union[Literal["auto"], list[str]] = "auto"
    _dtype = field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")(
        classmethod(lambda cls, v: dtype_name(v)))


# ---------------------------------------------------------------- optimizer / scheduler (lenient kwargs dicts)
class Optimizer(Lenient):
    type: Optional[str] = None
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False


class Scheduler(Lenient):
    type: Optional[str] = None
    params: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------- ZeRO (strict)
OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadParam(Strict):
    device: OffloadDevice = "none"
    nvme_path: Optional[str] = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True                    # True since DeepSpeed 0.19.5


class OffloadOptimizer(Strict):
    device: OffloadDevice = "none"
    nvme_path: Optional[str] = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)


class ZenFlow(Strict):
    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    select_strategy: str = "auto"
    select_interval: Union[int, str] = "auto"
    update_interval: Union[int, str] = "auto"
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    full_warm_up_rounds: int = 0
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    steps_per_epoch: Optional[int] = None


class LeafModule(Strict):
    classes: list[str] = Field(default_factory=lambda: [
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"])
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _one_string_is_a_list(cls, v):
        if isinstance(v, dict):
            return {k: [x] if k in ("classes", "names", "name_suffixes") and isinstance(x, str) else x
                    for k, x in v.items()}
        return v


class ZeroOptimization(Strict):
    stage: int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: Optional[bool] = None        # None: True iff stage 3 (DeepSpeed's dynamic default)
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[OffloadParam] = None
    offload_optimizer: Optional[OffloadOptimizer] = None
    zenflow: Optional[ZenFlow] = None
    sub_group_size: int = Field(1_000_000_000, ge=0)
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: LeafModule = Field(default_factory=LeafModule)
    # Removed from DeepSpeed in 0.19.8 (MiCS). fsdpzero still carries it: an HSDP (replicate, shard) mesh.
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False

    @field_validator("stage", mode="before")
    @classmethod
    def _stage(cls, v):
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError("must be one of 0, 1, 2, 3")
        return v

    @model_validator(mode="after")
    def _cross_checks(self):
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError("compute_grad_norm=false is supported only with ZeRO stage 1 or 2")
        return self


# ---------------------------------------------------------------- the whole file
class DSConfig(Lenient):
    """A validated ds_config. Unknown top-level keys stay in `model_extra` (DeepSpeed ignores them too)."""
    train_batch_size: Optional[int] = Field(None, gt=0)
    train_micro_batch_size_per_gpu: Optional[int] = Field(None, gt=0)
    gradient_accumulation_steps: Optional[int] = Field(None, gt=0)
    managed_gradient_accumulation: bool = True
    gradient_clipping: float = Field(1.0, ge=0.0)     # 1.0 since DeepSpeed 0.19.3 (0.0 before)
    steps_per_print: Optional[int] = None
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    disable_python_gc: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    communication_data_type: Optional[DTypeName] = None
    seq_parallel_communication_data_type: DTypeName = "fp32"
    disable_allgather: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    vocabulary_size: Optional[int] = None
    dataloader_drop_last: bool = False
    log_level: Optional[str] = None
    use_data_before_expert_parallelism: bool = False
    sequence_parallel_size: Optional[int] = Field(None, gt=0)

    optimizer: Optional[Optimizer] = None
    scheduler: Optional[Scheduler] = None
    fp16: FP16 = Field(default_factory=FP16)
    bf16: BF16 = Field(default_factory=BF16)
    torch_autocast: Optional[TorchAutocast] = None
    data_types: Optional[DataTypes] = None
    zero_optimization: ZeroOptimization = Field(default_factory=ZeroOptimization)
    aio: Optional[Aio] = None
    activation_checkpointing: Optional[ActivationCheckpointing] = None
    checkpoint: Optional[Checkpoint] = None
    flops_profiler: Optional[FlopsProfiler] = None
    tensorboard: Optional[TensorBoard] = None
    wandb: Optional[Wandb] = None
    csv_monitor: Optional[CSVMonitor] = None
    comet: Optional[Comet] = None
    comms_logger: Optional[CommsLogger] = None
    timers: Optional[Timers] = None
    tensor_parallel: Optional[TensorParallel] = None
    compile: Optional[Compile] = None
    hybrid_engine: Optional[HybridEngine] = None
    weight_quantization: Optional[WeightQuantization] = None
    # Sections DeepSpeed reads leniently and fsdpzero does not carry: kept as dicts, judged by translate.
    pipeline: Optional[dict[str, Any]] = None
    data_efficiency: Optional[dict[str, Any]] = None
    autotuning: Optional[dict[str, Any]] = None
    datastates: Optional[dict[str, Any]] = None
    expert_parallel: Optional[dict[str, Any]] = None

    _lower = field_validator("gradient_allreduce_op", mode="before")(
        classmethod(lambda cls, v: v.lower() if isinstance(v, str) else v))
    _dtype = field_validator("communication_data_type", "seq_parallel_communication_data_type", mode="before")(
        classmethod(lambda cls, v: dtype_name(v)))

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _steps_per_print(cls, v):       # 1e5 occurs in the wild; accelerate writes inf
        if isinstance(v, float) and (math.isinf(v) or v.is_integer()):
            return None if math.isinf(v) else int(v)
        return v

    # Filled by fsdpzero.config.load_config: what the user wrote and what the loader did about it.
    _raw: dict = PrivateAttr(default_factory=dict)            # normalised dict, autos resolved
    _explicit: tuple = PrivateAttr(default=())                # dotted paths written by the user
    _unknown: dict = PrivateAttr(default_factory=dict)        # unknown lenient keys -> value (fate: noop)
    _autos: dict = PrivateAttr(default_factory=dict)          # path -> (value, TrainingArguments source)
    _deferred: tuple = PrivateAttr(default=())                # scheduler params the trainer must fill
    _notes: list = PrivateAttr(default_factory=list)          # warnings: renamed aliases, ignored keys, ...
    _rounded: dict = PrivateAttr(default_factory=dict)        # path -> float as written (size keys rounded)

    def record_load(self, *, raw: dict, notes: list, explicit, unknown: dict, autos: dict, deferred,
                    rounded: dict | None = None) -> None:
        """What load_config learned beyond the fields: the normalised dict, the user's keys, unknown keys, resolved
        autos, deferred scheduler params, sizes rounded from floats and warnings (read back through the
        properties below)."""
        self._raw, self._notes, self._explicit = raw, notes, tuple(explicit)
        self._unknown, self._autos, self._deferred = unknown, autos, tuple(deferred)
        self._rounded = dict(rounded or {})

    @property
    def raw(self) -> dict:
        return self._raw

    @property
    def explicit_keys(self) -> tuple[str, ...]:
        return self._explicit

    @property
    def unknown_keys(self) -> dict[str, Any]:
        return dict(self._unknown)

    @property
    def autos(self) -> dict[str, tuple[Any, str]]:
        return dict(self._autos)

    @property
    def rounded(self) -> dict[str, float]:
        """Size keys written as near-integer floats (path -> the float), stored rounded to int."""
        return dict(self._rounded)

    @property
    def deferred(self) -> tuple[str, ...]:
        return self._deferred

    @property
    def warnings(self) -> list[str]:
        return list(self._notes)


# Sections DeepSpeed validates with pydantic (extra="forbid"): unknown keys there are errors in DeepSpeed too.
STRICT_SECTIONS = frozenset({
    "zero_optimization", "fp16", "bf16", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
    "tensor_parallel", "compile", "hybrid_engine", "weight_quantization"})
