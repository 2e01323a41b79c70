"""Base models and the peripheral ds_config sections (I/O, checkpoints, monitors, features fsdpzero does not
carry). Names and defaults are DeepSpeed 0.19.8's; the core sections and the whole-file model are in schema.py."""
from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=False)


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, validate_default=False)


def finite_number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError("must be a finite number")
    return v


DTypeName = Literal["fp32", "fp16", "bf16"]
_DTYPE_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}


def dtype_name(v: Any) -> Any:
    if isinstance(v, str) and v.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[v.lower()]
    return v


# ---------------------------------------------------------------- NVMe / checkpoint / misc (lenient)
class Aio(Lenient):
    """DeepSpeed's `aio` section: the one declaration of its keys, defaults and meanings. The plan's AioPlan is
    derived from it (fsdpzero/plan/types.py), the library passes its values to the ops' engine (fsdpzero_ops.aio
    takes them as plain arguments) and docs/nvme.md's list of the keys is printed from the descriptions
    (`python -m fsdpzero.cli.migrate --write-docs`). Range and alignment checks: fsdpzero/config/bounds.py."""
    block_size: int = Field(1_048_576, gt=0, description="each request is cut into chunks of this many bytes")
    queue_depth: int = Field(8, gt=0, description="chunks each worker keeps in flight on its own kernel queue")
    intra_op_parallelism: int = Field(1, gt=0, description="workers (old name: `thread_count`) that drain one "
                                      "shared chunk queue, so a single request is split across all of them")
    single_submit: bool = Field(False, description="one syscall per chunk instead of one per batch")
    overlap_events: bool = Field(True, description="refill the queue after every completion instead of working "
                                 "in waves")
    use_gds: bool = Field(False, description="`true` is refused with a clear error: GPUDirect Storage is not "
                          "supported (swaps go through pinned CPU buffers)")


class ActivationCheckpointing(Lenient):
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class ParallelWrite(Lenient):
    pipeline_stage: bool = False


class CheckpointWriter(Lenient):
    type: Literal["FAST", "PYTHON", "MOCK"] = "FAST"
    io_buffer_size: int = Field(64 * 1024 * 1024, gt=0)
    io_buffer_double: bool = True
    show_statistics: bool = False
    data_parallel: Optional[Literal["REPLICA", "SOCKET", "MACHINE"]] = None
    decoupled: bool = False
    io_multiplier: int = 1

    _upper = field_validator("type", "data_parallel", mode="before")(
        classmethod(lambda cls, v: v.upper() if isinstance(v, str) else v))


class Checkpoint(Lenient):
    tag_validation: Literal["IGNORE", "WARN", "FAIL"] = "WARN"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWrite = Field(default_factory=ParallelWrite)
    checkpoint_serialization: bool = True
    writer: Optional[CheckpointWriter] = None

    _upper = field_validator("tag_validation", mode="before")(
        classmethod(lambda cls, v: v.upper() if isinstance(v, str) else v))


class FlopsProfiler(Lenient):
    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: Optional[str] = None


# ---------------------------------------------------------------- monitors and loggers (strict)
class TensorBoard(Strict):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class Wandb(Strict):
    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CSVMonitor(Strict):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class Comet(Strict):
    enabled: bool = False
    samples_log_interval: int = 100
    project: Optional[str] = None
    workspace: Optional[str] = None
    api_key: Optional[str] = None
    experiment_name: Optional[str] = None
    experiment_key: Optional[str] = None
    online: Optional[bool] = None
    mode: Optional[str] = None


class CommsLogger(Strict):
    enabled: bool = False
    prof_all: bool = True
    prof_ops: list = Field(default_factory=list)
    verbose: bool = False
    debug: bool = False


class ThroughputTimer(Strict):
    enabled: bool = True
    synchronized: bool = True


class Timers(Lenient):
    throughput: ThroughputTimer = Field(default_factory=ThroughputTimer)


# ---------------------------------------------------------------- features fsdpzero does not carry (strict in DS)
class TPInner(Strict):
    tp_size: int = 1
    tp_grain_size: int = 1
    mpu: Any = None
    tp_group: Any = None


class TensorParallel(Strict):
    dtype: DTypeName = "fp16"
    autotp_size: int = 0
    tp_overlap_comm: bool = False
    vocab_parallel_lm_head: Optional[bool] = None
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    tensor_parallel: TPInner = Field(default_factory=TPInner, alias="tp")
    injection_policy_tuple: Optional[Any] = None
    partition_config: Optional[dict[str, Any]] = None
    preset_model: Optional[str] = None
    keep_module_on_host: bool = False
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    _dtype = field_validator("dtype", mode="before")(classmethod(lambda cls, v: dtype_name(v)))


class Compile(Strict):
    # older DeepSpeed releases' torch.compile keys (DeepSpeed 0.19 rejects them and compiles in engine.compile());
    # fsdpzero reads them: torch.compile per transformer block (fsdpzero/compile.py)
    enabled: bool = False
    backend: str = "inductor"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    deepcompile: bool = False
    autoep_non_moe: bool = False
    free_activation: bool = False
    free_activation_threshold: int = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: Optional[list[str]] = None


class HybridEngine(Strict):
    enabled: bool = False
    max_out_tokens: int = Field(512, gt=0)
    inference_tp_size: int = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = 8
    enable_cuda_graph: bool = False


class WeightQuantization(Strict):
    enabled: bool = True
    num_bits: int = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: int = 1
    quantized_initialization: dict = Field(default_factory=dict)
    post_init_quant: dict = Field(default_factory=dict)
