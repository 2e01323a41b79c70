"""The key-fate table: what every DeepSpeed key becomes under FSDP2, as data.

One table of rules (key pattern, condition, fate, how). `CONDITIONAL` holds the rules whose condition looks at the
value or the rest of the config (a feature switched on, a stage that changes the meaning), in the order they are
tried; `FATES` holds the default rule of every canonical key (DeepSpeed's documented spelling), taken when no
conditional rule matches. `RULES` is the two together, in that order: `fsdpzero.plan.fates.decide` walks it,
docs/migration.md is generated from it (`fsdpzero.cli.migrate --write-docs`), and the startup report and
`fsdpzero migrate` print what decide returns. A condition is a named predicate (`When`): its text is what the docs
print, next to the code that evaluates it, so the two cannot drift apart.

A mapped/approximated rule that names a plan field (`SomethingPlan.field`) claims that runtime code reads it:
tests/plan/test_fate_consumers.py checks the field's declared consumer (fsdpzero.plan.types) reads it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Callable

from fsdpzero.config.rules import SCHEDULERS, canonical_optimizer, optimizer_kind

if TYPE_CHECKING:
    from fsdpzero.config import DSConfig
    from fsdpzero.plan.types import Env

M, A, N, U = "mapped", "approximated", "noop", "unsupported"
_Z = "zero_optimization."
_OP, _OO = _Z + "offload_param.", _Z + "offload_optimizer."

FATES: dict[str, tuple[str, str]] = {
    # ---- batch and step
    "train_batch_size": (M, "BatchPlan.train_batch_size: global samples per optimizer step (triad checked)"),
    "train_micro_batch_size_per_gpu": (M, "BatchPlan.micro_batch_size: DataLoader batch_size per rank"),
    "gradient_accumulation_steps": (M, "BatchPlan.gradient_accumulation_steps: loss / GA; "
                                       "FSDPModule.set_requires_gradient_sync(False) off the boundary"),
    "managed_gradient_accumulation": (M, "engine owns the accumulation boundary (false: unsupported)"),
    "gradient_clipping": (M, "torch.nn.utils.clip_grad_norm_ on DTensor grads after unscaling (0 = off)"),
    "gradient_predivide_factor": (M, "1.0: the ranks' gradients averaged in the reduction, as DeepSpeed"),
    "prescale_gradients": (N, "FSDP2 averages in the reduce-scatter; pre- or post-scaling is the same mean"),
    "gradient_allreduce_op": (M, "mean: FSDP2's default reduce-scatter average"),
    "communication_data_type": (M, "MixedPrecisionPolicy(reduce_dtype=...); unset: the model dtype, as DeepSpeed"),
    "seq_parallel_communication_data_type": (N, "the Ulysses all-to-alls run in the activations' dtype, as "
                                                "DeepSpeed's UlyssesSPAttentionHF (only DeepSpeed's older "
                                                "DistributedAttention reads this key)"),
    "sequence_parallel_size": (N, "1: no sequence parallelism"),
    "steps_per_print": (M, "rank-0 progress log interval"),
    "wall_clock_breakdown": (M, "BatchPlan.wall_clock_breakdown: rank-0 step timers in the step log and, with a "
                                "monitor, DeepSpeed's Train/Samples/elapsed_time_ms_* events"),
    "memory_breakdown": (N, "use torch.cuda.memory_summary(); not logged per step"),
    "dump_state": (N, "the resolved plan is printed at start instead"),
    "disable_python_gc": (N, "Python GC is left alone"),
    "disable_allgather": (N, "legacy DeepSpeed switch"),
    "zero_allow_untested_optimizer": (M, "OptimizerPlan.zero_allow_untested_optimizer: same check as DeepSpeed"),
    "zero_force_ds_cpu_optimizer": (M, "offload uses fsdpzero's CPU Adam (ops cpuadam), the DeepSpeed CPU Adam's "
                                       "counterpart"),
    "vocabulary_size": (N, "DeepSpeed only warns when not a multiple of 8"),
    "dataloader_drop_last": (M, "DataLoader(drop_last=...)"),
    "log_level": (N, "not applied: rank 0 logs at INFO; logging.getLogger('fsdpzero').setLevel(...) changes it"),
    "use_data_before_expert_parallelism": (N, "no expert parallelism"),
    # ---- precision
    "fp16": (M, "fp16 mixed precision section"),
    "fp16.enabled": (M, "MixedPrecisionPolicy(param_dtype=float16) + fp32 sharded master + DeepSpeed-semantics "
                        "dynamic loss scaler (fsdpzero.precision)"),
    "fp16.auto_cast": (M, "floating inputs cast to the compute dtype at every stage (FSDP2's cast_forward_inputs; "
                          "stage 1: fsdpzero's forward pre-hook), keyword inputs too; DeepSpeed casts positional only"),
    "fp16.loss_scale": (M, "LossScalePlan.loss_scale: 0 dynamic, > 0 static"),
    "fp16.initial_scale_power": (M, "LossScalePlan.initial_scale_power: first scale 2**p"),
    "fp16.loss_scale_window": (M, "LossScalePlan.loss_scale_window: clean steps before x2"),
    "fp16.hysteresis": (M, "LossScalePlan.hysteresis: overflows tolerated before /2 (GradScaler has none)"),
    "fp16.consecutive_hysteresis": (M, "LossScalePlan.consecutive_hysteresis"),
    "fp16.min_loss_scale": (M, "LossScalePlan.min_loss_scale: the floor; overflow at the floor aborts"),
    "fp16.fp16_master_weights_and_grads": (M, "false: fp32 master weights (PrecisionPlan.master_dtype)"),
    "bf16": (M, "bf16 mixed precision section"),
    "bf16.enabled": (M, "MixedPrecisionPolicy(param_dtype=bfloat16) + fp32 sharded master weights"),
    "bf16.immediate_grad_update": (N, "FSDP2 accumulates reduced gradient shards directly"),
    "bf16.check_grad_overflow": (M, "PrecisionPlan.check_grad_overflow: non-finite grad norm => skip the step"),
    "bf16.bf16_master_weights_and_grads": (M, "false: fp32 master weights (PrecisionPlan.master_dtype)"),
    "bf16.bf16_optimizer_states": (M, "PrecisionPlan.optimizer_state_dtype: false, the moments stay fp32 (bf16 "
                                      "master weights then need offload_optimizer, as in DeepSpeed)"),
    "torch_autocast": (M, "torch.autocast around forward with fp32 parameters"),
    "torch_autocast.enabled": (M, "PrecisionPlan.autocast_dtype: torch.autocast(device, dtype)"),
    "torch_autocast.dtype": (M, "PrecisionPlan.autocast_dtype (default bfloat16)"),
    "torch_autocast.lower_precision_safe_modules": (A, "autocast covers all modules; per-class low-precision "
                                                       "communication is not carried"),
    "data_types": (M, "dtype overrides"),
    "data_types.grad_accum_dtype": (A, "FSDP2 accumulates reduced shards in the master dtype (fp32)"),
    "data_types.param_dtype": (M, "MixedPrecisionPolicy(param_dtype=...)"),
    "data_types.buffer_dtype": (N, "FSDP2 never casts buffers (DeepSpeed >= 0.19.2 default behaviour)"),
    "data_types.keep_in_fp32_modules": (A, "buffers keep their loaded dtype; module-level fp32 pins are not "
                                           "carried"),
    # ---- optimizer and scheduler
    "optimizer": (M, "OptimizerPlan"),
    "optimizer.type": (M, "OptimizerPlan.type"),
    "optimizer.params": (M, "OptimizerPlan.params: optimizer keyword arguments"),
    "optimizer.legacy_fusion": (N, "unused by DeepSpeed"),
    "scheduler": (M, "SchedulerPlan: fsdpzero's bit-exact DeepSpeed schedulers (LRScheduler subclasses)"),
    "scheduler.type": (M, "SchedulerPlan.type"),
    "scheduler.params": (M, "SchedulerPlan.params with DeepSpeed's defaults filled"),
    # ---- ZeRO
    "zero_optimization": (M, "ShardPlan"),
    _Z + "stage": (M, "ShardPlan.stage"),
    _Z + "contiguous_gradients": (N, "FSDP2 always reduce-scatters flat per-group gradient buffers"),
    _Z + "reduce_scatter": (N, "FSDP2 always reduce-scatters"),
    _Z + "reduce_bucket_size": (M, "ShardPlan.reduce_bucket_size (elements): bucket of the stage-1 reduce-scatter "
                                   "(ops/fsdpzero_ops/stage1/optimizer.py); at stages 0/2/3 FSDP2 reduces per wrapped "
                                   "block"),
    _Z + "use_multi_rank_bucket_allreduce": (N, "FSDP2 buckets per wrapped block"),
    _Z + "allgather_partitions": (N, "FSDP2 always all-gathers"),
    _Z + "allgather_bucket_size": (M, "ShardPlan.allgather_bucket_size: post-step all-gather bucket of the "
                                      "stage-1 optimizer (ops stage1)"),
    _Z + "overlap_comm": (N, "FSDP2 always overlaps communication on separate streams; at stage 1 it starts the "
                             "reduce-scatter buckets from backward hooks (ops/fsdpzero_ops/stage1/optimizer.py)"),
    _Z + "compute_grad_norm": (N, "the grad norm is always computed (clipping, overflow check)"),
    _Z + "load_from_fp32_weights": (M, "checkpoint load restores fp32 masters from DCP (always true)"),
    _Z + "elastic_checkpoint": (N, "DCP reshards natively on load"),
    _Z + "offload_param": (M, "OffloadPlan.param_device"),
    _Z + "offload_optimizer": (M, "OffloadPlan.optimizer_device"),
    _Z + "zenflow": (A, "fsdpzero.optim.zenflow.ZenFlowGradPath (see the conditional rows)"),
    _Z + "sub_group_size": (M, "OffloadPlan.sub_group_size: CPU Adam step tile (offload only)"),
    _Z + "stage3_prefetch_bucket_size": (M, "ShardPlan.prefetch_depth: FSDPModule.set_modules_to_forward_prefetch "
                                            "within this element budget"),
    _Z + "stage3_param_persistence_threshold": (A, "ShardPlan.param_persistence_threshold: modules with fewer "
                                                   "parameters stay in the root group (not resharded)"),
    _Z + "stage3_model_persistence_threshold": (N, "FSDP2 has no global cap on persisted parameters"),
    _Z + "stage3_max_live_parameters": (N, "FSDP2 frees each block after use; no live-parameter cap"),
    _Z + "stage3_max_reuse_distance": (N, "FSDP2 reshards deterministically per block"),
    _Z + "stage3_gather_16bit_weights_on_model_save": (M, "ShardPlan.gather_16bit_weights_on_model_save: "
                                                          "get_model_state_dict(full_state_dict=True), rank-0 save"),
    _Z + "stage3_module_granularity_threshold": (N, "fetch granularity is the wrapped block"),
    _Z + "stage3_use_all_reduce_for_fetch_params": (N, "FSDP2 all-gathers"),
    _Z + "stage3_allgather_sequential": (N, "FSDP2 all-gathers per block"),
    _Z + "ignore_unused_parameters": (M, "true: parameters without gradients are tolerated; one with a gradient on "
                                         "some ranks only gets zeros reduced on the others, as DeepSpeed "
                                         "(fsdpzero.sharding: FSDP2's set_reduce_scatter_unused_params on torch "
                                         ">= 2.13, a zero fill before each unit's reduce-scatter on 2.11/2.12; "
                                         "a block none of whose params ran on a rank is not covered)"),
    _Z + "legacy_stage1": (N, "false: the current stage-1 implementation"),
    _Z + "round_robin_gradients": (N, "CPU-offload copy ordering; no effect on results"),
    _Z + "parameter_alignment": (N, "flat-buffer padding detail of DeepSpeed"),
    _Z + "zero_hpz_partition_size": (M, "ShardPlan.reshard_after_forward=int (hpZ secondary group)"),
    _Z + "zero_quantized_weights": (N, "false: full-precision all-gather"),
    _Z + "zero_quantized_nontrainable_weights": (N, "false"),
    _Z + "zero_quantized_gradients": (N, "false: full-precision reduce-scatter"),
    _Z + "memory_efficient_linear": (N, "DeepSpeed stage-3 linear hook; not needed with FSDP2"),
    _Z + "pipeline_loading_checkpoint": (N, "DeepSpeed pipeline-engine load detail"),
    _Z + "override_module_apply": (N, "DeepSpeed stage-3 module.apply patch; not needed with FSDP2"),
    _Z + "log_trace_cache_warnings": (N, "DeepSpeed trace cache; FSDP2 has none"),
    _Z + "enable_sanity_checks": (N, "DeepSpeed internal debugging"),
    _Z + "save_muon_momentum_buffer_in_memory": (N, "Muon + NVMe only"),
    _Z + "leaf_module": (A, "wrapping policy: one fully_shard per listed module class/name"),
    _Z + "leaf_module.classes": (A, "fully_shard unit per class"),
    _Z + "leaf_module.names": (A, "fully_shard unit per module name"),
    _Z + "leaf_module.name_suffixes": (A, "fully_shard unit per name suffix"),
    _Z + "mics_shard_size": (M, "-1: one flat (dp,) mesh"),
    _Z + "mics_hierarchical_params_gather": (N, "HSDP all-gathers within the shard dimension"),
    # ---- offload
    _OP + "device": (M, "OffloadPlan.param_device"),
    _OP + "nvme_path": (M, "OffloadPlan.param_nvme_path: the parameter swap file (fsdpzero.offload.param_swapper)"),
    _OP + "buffer_count": (A, "OffloadPlan.param_buffer_count: counts FSDP units (a block's shards) in CPU memory "
                              "at once, where DeepSpeed counts one buffer per parameter tensor"),
    _OP + "buffer_size": (A, "OffloadPlan.param_buffer_size: bounds the largest FSDP unit's shard, where DeepSpeed "
                             "bounds the largest parameter tensor's partition"),
    _OP + "max_in_cpu": (M, "OffloadPlan.max_in_cpu: most shard elements in CPU memory at once (swapper bound)"),
    _OP + "pin_memory": (M, "OffloadPlan.pin_memory: CPUOffloadPolicy(pin_memory=...) (not pinned without a GPU)"),
    _OO + "device": (M, "OffloadPlan.optimizer_device"),
    _OO + "nvme_path": (M, "OffloadPlan.optimizer_nvme_path: ops aio swap files"),
    _OO + "buffer_count": (M, "OffloadPlan.buffer_count: optimizer swap buffers"),
    _OO + "pin_memory": (N, "the optimizer's copy buffers are pinned whenever a GPU is present (pageable copies "
                            "measured 8x slower); fp32 masters and moments stay pageable either way"),
    _OO + "pipeline_read": (A, "the NVMe swapper always overlaps reads"),
    _OO + "pipeline_write": (A, "the NVMe swapper always overlaps writes"),
    _OO + "fast_init": (N, "optimizer-state init speed-up only"),
    _OO + "ratio": (M, "OffloadPlan.ratio: 1.0, the whole optimizer step on CPU"),
    _OO + "super_offload": (N, "false"),
    _OO + "cpuadam_cores_perc": (N, "DeepSpeed reads it for super_offload's CPU Adam only (stage 3); fsdpzero's CPU "
                                    "step runs on this rank's own slice of whole cores, one thread per CPU of it, "
                                    "with an accelerator (fsdpzero/host.py; knob offload_threads sets the count, "
                                    "offload_bind 0 the unpinned usable cores / local ranks; CPU-only: torch's "
                                    "threads)"),
    # ---- NVMe I/O
    "aio": (M, "OffloadPlan.aio: parameters of the ops aio NVMe engine"),
    "aio.block_size": (M, "AioPlan.block_size"),
    "aio.queue_depth": (M, "AioPlan.queue_depth"),
    "aio.intra_op_parallelism": (M, "AioPlan.intra_op_parallelism (I/O threads)"),
    "aio.single_submit": (M, "AioPlan.single_submit"),
    "aio.overlap_events": (M, "AioPlan.overlap_events"),
    "aio.use_gds": (N, "false: swaps go through CPU buffers, DeepSpeed's default"),
    # ---- activation checkpointing
    "activation_checkpointing": (M, "ActivationCheckpointPlan: a non-reentrant torch.utils.checkpoint per block "
                                    "before fully_shard (Hugging Face models: their activation_checkpointing_enable; "
                                    "others: fsdpzero.activation.CheckpointedBlock)"),
    "activation_checkpointing.partition_activations": (N, "needs tensor parallelism; activations are not split"),
    "activation_checkpointing.contiguous_memory_optimization": (N, "allocator detail"),
    "activation_checkpointing.cpu_checkpointing": (M, "ActivationCheckpointPlan.cpu_checkpointing: "
                                                      "torch.autograd.graph.save_on_cpu"),
    "activation_checkpointing.number_checkpoints": (N, "sizes DeepSpeed's contiguous activation buffers "
                                                       "(contiguous_memory_optimization), which fsdpzero does not "
                                                       "allocate: every wrapped block is checkpointed"),
    "activation_checkpointing.synchronize_checkpoint_boundary": (N, "profiling aid"),
    "activation_checkpointing.profile": (N, "profiling aid"),
    # ---- checkpoints
    "checkpoint": (M, "CheckpointPlan: DCP save/load under <save_dir>/<tag>/ plus `latest`"),
    "checkpoint.tag_validation": (M, "CheckpointPlan.tag_validation: the tag's SHA-1 compared across ranks"),
    "checkpoint.load_universal": (N, "false: checkpoints are fsdpzero's own (DCP)"),
    "checkpoint.use_node_local_storage": (N, "false: checkpoints under save_dir, as DeepSpeed"),
    "checkpoint.parallel_write": (N, "pipeline-parallel write option"),
    "checkpoint.parallel_write.pipeline_stage": (N, "no pipeline parallelism"),
    "checkpoint.checkpoint_serialization": (N, "DCP writes its own format"),
    "checkpoint.writer": (A, "DCP FileSystemWriter with its own threads"),
    "checkpoint.writer.type": (A, "DCP FileSystemWriter"),
    "checkpoint.writer.io_buffer_size": (N, "DCP manages buffers"),
    "checkpoint.writer.io_buffer_double": (N, "DCP manages buffers"),
    "checkpoint.writer.show_statistics": (N, "no writer statistics"),
    "checkpoint.writer.data_parallel": (N, "every rank writes its shard"),
    "checkpoint.writer.decoupled": (M, "CheckpointPlan.async_save: DCP async_save; complete before `latest` moves"),
    "checkpoint.writer.io_multiplier": (N, "DCP manages I/O"),
    # ---- monitoring
    "tensorboard": (M, "MonitorPlan.tensorboard: the Engine writes DeepSpeed's Train/Samples/* events to a rank-0 "
                       "SummaryWriter in output_path/job_name (fsdpzero.monitor; needs the tensorboard package, "
                       "else one warning)"),
    "tensorboard.enabled": (M, "MonitorPlan.tensorboard"),
    "tensorboard.output_path": (M, "MonitorPlan.tensorboard: log directory (output_path/job_name)"),
    "tensorboard.job_name": (M, "MonitorPlan.tensorboard: run directory name"),
    "wandb": (M, "MonitorPlan.wandb: the Engine's events through rank-0 wandb.log(step=global samples) "
                 "(fsdpzero.monitor; needs wandb, else one warning)"),
    "wandb.enabled": (M, "MonitorPlan.wandb"),
    "wandb.group": (M, "MonitorPlan.wandb: wandb.init(group=...)"),
    "wandb.team": (M, "MonitorPlan.wandb: wandb.init(entity=...)"),
    "wandb.project": (M, "MonitorPlan.wandb: wandb.init(project=...)"),
    "csv_monitor": (M, "MonitorPlan.csv_monitor: the Engine's events as rank-0 CSV files, one per tag, in "
                       "DeepSpeed's layout (fsdpzero.monitor)"),
    "csv_monitor.enabled": (M, "MonitorPlan.csv_monitor"),
    "csv_monitor.output_path": (M, "MonitorPlan.csv_monitor: CSV directory (output_path/job_name)"),
    "csv_monitor.job_name": (M, "MonitorPlan.csv_monitor: run directory name"),
    "comet": (M, "MonitorPlan.comet: the Engine's events through a rank-0 comet_ml experiment (fsdpzero.monitor; "
                 "needs comet_ml, else one warning)"),
    "comet.enabled": (M, "MonitorPlan.comet"),
    "comet.samples_log_interval": (M, "MonitorPlan.comet: a tag is logged again after this many samples"),
    **{f"comet.{k}": (M, f"MonitorPlan.comet: comet_ml.start({k}=...)") for k in (
        "project", "workspace", "api_key", "experiment_key", "online", "mode")},
    "comet.experiment_name": (M, "MonitorPlan.comet: experiment.set_name(...)"),
    "comms_logger": (N, "use torch.profiler for collective timings"),
    **{f"comms_logger.{k}": (N, "torch.profiler instead") for k in ("enabled", "prof_all", "prof_ops", "verbose",
                                                                    "debug")},
    "flops_profiler": (N, "use torch.utils.flop_counter.FlopCounterMode"),
    **{f"flops_profiler.{k}": (N, "FlopCounterMode instead") for k in (
        "enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed",
        "output_file")},
    "timers": (M, "rank-0 throughput log"),
    "timers.throughput": (M, "samples/s in the step log"),
    "timers.throughput.enabled": (M, "samples/s in the step log"),
    "timers.throughput.synchronized": (N, "timings synchronise at log steps only"),
    # ---- features fsdpzero does not carry (fates change when switched on: see CONDITIONAL)
    "tensor_parallel": (N, "autotp_size 0/1: no tensor parallelism"),
    **{f"tensor_parallel.{k}": (N, "no tensor parallelism") for k in (
        "dtype", "autotp_size", "tp_overlap_comm", "vocab_parallel_lm_head", "vocab_parallel_ce_backend", "tp",
        "tp.tp_size", "tp.tp_grain_size", "tp.mpu", "tp.tp_group", "injection_policy_tuple", "partition_config",
        "preset_model", "keep_module_on_host", "kernel_inject")},
    "compile": (N, "torch.compile per block when enabled (fsdpzero/compile.py)"),
    "compile.enabled": (N, "off"), "compile.deepcompile": (N, "off"),
    "compile.backend": (N, "compile is off"), "compile.kwargs": (N, "compile is off"),
    **{f"compile.{k}": (N, "DeepCompile option") for k in (
        "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
        "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log",
        "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
        "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors", "passes")},
    "hybrid_engine": (N, "RLHF hybrid engine off"),
    **{f"hybrid_engine.{k}": (N, "hybrid engine option") for k in (
        "enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache", "pin_parameters",
        "tp_gather_partition_size", "enable_cuda_graph")},
    "weight_quantization": (U, "DeepSpeed weight quantization is not implemented"),
    **{f"weight_quantization.{k}": (N, "part of the weight_quantization section") for k in (
        "enabled", "num_bits", "q_type", "q_groups", "quantized_initialization", "post_init_quant")},
    "pipeline": (U, "DeepSpeed's pipeline engine (PipelineModule) is not implemented"),
    "data_efficiency": (N, "disabled"),
    "autotuning": (N, "the DeepSpeed autotuner is a launcher tool; the config runs as written"),
    "datastates": (N, "disabled"),
    "expert_parallel": (U, "AutoEP (expert_parallel.enabled) is not implemented: DeepSpeed swaps each MoE block of a "
                           "preset model (Mixtral, Qwen3-MoE, DeepSeek-V2/V3, ...) for its AutoEPMoELayer, with experts "
                           "split over autoep_size ranks, tokens dispatched by all-to-all, expert gradients reduced over "
                           "expert-data-parallel groups and its own expert checkpoint layout; fsdpzero trains MoE models "
                           "with ZeRO sharding every expert tensor over all ranks, no all-to-all: remove the section or "
                           "set expert_parallel.enabled false"),
}
for _k in ("topk_ratio", "select_strategy", "select_interval", "update_interval", "overlap_step", "offload",
           "auto_ratio", "full_warm_up_rounds", "pt_reserved_cores_perc", "steps_per_epoch"):
    FATES[_Z + "zenflow." + _k] = (N, "part of the zenflow section (its fate is the section's)")
FATES[_Z + "zenflow.auto_ratio"] = (N, "no effect, as in DeepSpeed 0.19.8: read only under update_interval \"auto\" "
                                       "(refused, see zero_optimization.zenflow), where the flag it sets is cleared "
                                       "before it is read (backward_prologue clears it, then the engine toggles "
                                       "zenflow_state), so updates happen at select_interval boundaries only")

UNKNOWN_FATE = (N, "unknown to DeepSpeed, ignored as DeepSpeed does")


# ---------------------------------------------------------------- conditions
@dataclass(frozen=True)
class Ctx:
    """What a condition and a `how` template see: the key, its value, the config and the environment."""
    key: str
    value: Any
    cfg: "DSConfig"
    env: "Env"

    @property
    def on(self) -> bool:
        return bool(self.value) and self.value not in ("none", "auto")

    @property
    def stage(self) -> int:
        return self.cfg.zero_optimization.stage

    def device(self, section: str) -> str:
        """offload_param / offload_optimizer device ("none" when the section is absent)."""
        sub = getattr(self.cfg.zero_optimization, section)
        return sub.device if sub is not None and sub.device else "none"

    def fields(self) -> dict[str, Any]:
        """The names a `how` template may use."""
        parts = self.key.split(".")
        opt, sch = self.cfg.optimizer, self.cfg.scheduler
        v = self.value
        return {"value": v, "stage": self.stage, "leaf": parts[-1], "section": parts[0],
                "part": parts[1] if len(parts) > 2 else parts[-1],
                "dev": self.device(parts[1]) if len(parts) > 2 and parts[1].startswith("offload_") else "",
                "mics_mesh": (self.env.world_size // v, v) if isinstance(v, int) and v > 0 else None,
                "canon": canonical_optimizer(v, opt.params if opt else {}) if self.key == "optimizer.type" else "",
                "opt_type": opt.type if opt else "", "sched_type": sch.type if sch else ""}


@dataclass(frozen=True)
class When:
    text: str                                   # printed in docs/migration.md
    test: Callable[[Ctx], bool]

    def __and__(self, other: "When") -> "When":
        return When(f"{self.text} and {other.text}", lambda c: self.test(c) and other.test(c))

    def __or__(self, other: "When") -> "When":
        return When(f"({self.text} or {other.text})", lambda c: self.test(c) or other.test(c))


def value_is(v: Any) -> When:
    return When(f"value {json.dumps(v)}", lambda c: type(c.value) is type(v) and c.value == v)


def value_in(*vs: Any) -> When:
    return When("value in " + ", ".join(json.dumps(v) for v in vs), lambda c: c.value in vs)


def value_above(n: float) -> When:
    return When(f"value > {n}", lambda c: isinstance(c.value, (int, float)) and not isinstance(c.value, bool)
                and c.value > n)


def value_below(n: float) -> When:
    return When(f"value < {n}", lambda c: isinstance(c.value, (int, float)) and not isinstance(c.value, bool)
                and c.value < n)


def stage_in(*stages: int) -> When:
    return When("stage " + "/".join(map(str, stages)), lambda c: c.stage in stages)


def device_is(section: str, *devices: str) -> When:
    return When(f"{section}.device " + "/".join(devices), lambda c: c.device(section) in devices)


def leaf_in(*leaves: str) -> When:
    return When("key is one of " + ", ".join(leaves), lambda c: c.key.rsplit(".", 1)[1] in leaves)


def section_off(section: str) -> When:
    return When(f"{section}.enabled false", lambda c: not getattr(c.cfg, section).enabled)


ON = When("true (on)", lambda c: c.on)
OFF = When("false (off)", lambda c: not c.on)
ABSENT = When("absent or off", lambda c: c.value is None or c.value is False or c.value == {})
SECTION_ENABLED = When("the section is enabled", lambda c: isinstance(c.value, dict) and bool(c.value.get("enabled")))
OFFLOADED_OPT = device_is("offload_optimizer", "cpu", "nvme")
ZENFLOW = When("the section is given", lambda c: isinstance(c.value, dict))
MUON = When("Muon", lambda c: (c.value or "").lower() == "muon")
ONEBIT_ADAM = When("OneBitAdam", lambda c: (c.value or "").lower() == "onebitadam")
OPT_IS_ONEBIT_ADAM = When("optimizer.type OneBitAdam", lambda c: c.cfg.optimizer is not None
                          and (c.cfg.optimizer.type or "").lower() == "onebitadam")
OPT_IS_MUON = When("optimizer.type Muon", lambda c: c.cfg.optimizer is not None
                   and (c.cfg.optimizer.type or "").lower() == "muon")
NO_OFFLOADED_OPT = device_is("offload_optimizer", "none")
OWN_DEVICE_NONE = When("its section's device is none", lambda c: c.device(c.key.split(".")[1]) == "none")
OWN_DEVICE_CPU = When("its section's device is cpu", lambda c: c.device(c.key.split(".")[1]) == "cpu")
MULTI_NODE = When("more than one node", lambda c: c.env.nodes > 1)
ALWAYS = When("otherwise", lambda c: True)
DEEPCOMPILE_ON = When("compile.deepcompile", lambda c: c.cfg.compile is not None and bool(c.cfg.compile.deepcompile))
COMPILE_ON = When("compile.enabled or compile.deepcompile", lambda c: c.cfg.compile is not None and bool(
    c.cfg.compile.enabled or c.cfg.compile.deepcompile))


@dataclass(frozen=True)
class Rule:
    pattern: str                                # a canonical key, or an fnmatch pattern over keys
    when: When
    status: str
    how: str                                    # str.format template over Ctx.fields()

    def matches(self, ctx: Ctx) -> bool:
        return fnmatchcase(ctx.key, self.pattern) and self.when.test(ctx)


_NVME_ONLY = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write")
_ADAM_HOW = {"adamw": "torch.optim.AdamW (foreach) on DTensor shards", "adam": "torch.optim.Adam (foreach)",
             "lamb": "fsdpzero.optim.lamb.Lamb (torch has no LAMB)", "sgd": "torch.optim.SGD",
             "adagrad": "torch.optim.Adagrad"}
_UNSUPPORTED_WHEN_ON = {   # key: (condition, why)
    "gradient_allreduce_op": (value_is("sum"), "summed (not averaged) gradients are not carried"),
    "managed_gradient_accumulation": (value_is(False), "client-managed accumulation boundaries are not carried"),
    "hybrid_engine.enabled": (ON, "the RLHF hybrid engine is not implemented"),
    "data_efficiency": (SECTION_ENABLED, "DeepSpeed data_efficiency is not implemented"),
    "datastates": (SECTION_ENABLED, "DeepSpeed datastates is not implemented"),
}

TP_ON = When("tensor_parallel.autotp_size > 1", lambda c: c.cfg.tensor_parallel is not None
             and c.cfg.tensor_parallel.autotp_size > 1)
_TP = "tensor_parallel."
_TP_WITHOUT = "with tensor_parallel.autotp_size > 1 is not implemented (untested combination): remove one of the two"


def _reshaped_specs(c: Ctx) -> bool:
    from fsdpzero.config.autotp import effective_partition_config, unsupported_specs
    tp = c.cfg.tensor_parallel
    try:
        return bool(unsupported_specs(effective_partition_config(tp.preset_model, tp.partition_config)))
    except ValueError:
        return False   # a bad spec is a ConfigError of translate, not a fate


RESHAPED_SPECS = When("a layer spec with shape / partition_dim / grad_allreduce", _reshaped_specs)
_AUTOTP_RULES = (   # first: what AutoTP changes or cannot run with, before the stage and offload rules
    Rule(_TP + "autotp_size", value_above(1), M,
         "TensorParallelPlan.size: a (dp, tp) DeviceMesh, tp = {value} innermost; each planned Linear's weight a "
         "DTensor over tp, computed on its local shards (ParallelLinear: DeepSpeed's collectives; DTensor's "
         "ColwiseParallel / RowwiseParallel for Linear subclasses) with the plan from partition_config / "
         "preset_model, else "
         "the model's transformers tp_plan (base_model_tp_plan + _tp_plan); then fully_shard over dp. The batch "
         "triad counts the whole world, tp ranks included, as DeepSpeed 0.19.8's config does (a step reads "
         "micro x GA x dp distinct samples). No plan at all (DeepSpeed's name heuristic) is refused with the fix"),
    Rule(_TP + "preset_model", When("set", lambda c: c.value is not None) & TP_ON & RESHAPED_SPECS, U,
         "{value}: its fused layer specs (shape, partition_dim) are not implemented; give a partition_config "
         "over the unfused layers"),
    Rule(_TP + "preset_model", When("set", lambda c: c.value is not None) & TP_ON, M,
         "TensorParallelPlan.preset_model: DeepSpeed's AutoTPPresets layer specs (column: output features sharded, "
         "row: input features sharded, skip: left whole); before the model's tp_plan"),
    Rule(_TP + "partition_config", When("set", lambda c: c.value is not None) & TP_ON & RESHAPED_SPECS, U,
         "layer specs with shape / partition_dim (fused sub-parameters) or grad_allreduce are not implemented"),
    Rule(_TP + "partition_config", When("set", lambda c: c.value is not None) & TP_ON, M,
         "TensorParallelPlan.partition_config: DeepSpeed's AutoTPConfig (first matching spec per Linear weight; "
         "gather_output: the column output all-gathered; use_default_specs merges a preset after it; "
         "strict_mode: an unmatched Linear is an error); unknown keys are errors"),
    Rule(_TP + "vocab_parallel_lm_head", ON & TP_ON, U, "the vocabulary-parallel head and its distributed loss are "
         "not implemented: set it to null or false (the head then follows the plan)"),
    Rule(_TP + "vocab_parallel_lm_head", TP_ON, A, "null/false: the output head follows the plan (the transformers "
         "plan: column-parallel with its logits gathered); a tied embedding and head stay whole, where DeepSpeed's "
         "null shards them over the vocabulary when the transformers plan asks embedding_rowwise: the same loss, "
         "more memory"),
    Rule(_TP + "vocab_parallel_ce_backend", value_is("liger") & TP_ON, U, "needs the vocabulary-parallel head, "
         "not implemented: use \"torch\""),
    Rule(_TP + "tp_overlap_comm", ON & TP_ON, A, "DTensor issues the tensor-parallel all-reduces in autograd "
         "order; no separate overlap of them"),
    Rule(_TP + "tp.tp_grain_size", value_above(1) & TP_ON, U, "grain-aligned uneven shards are not implemented: "
         "DTensor shards evenly (set it to 1)"),
    Rule(_TP + "tp.mpu", When("set", lambda c: c.value is not None) & TP_ON, U, "an mpu object: the mesh is fsdpzero's"),
    Rule(_TP + "tp.tp_group", When("set", lambda c: c.value is not None) & TP_ON, U,
         "a process group object: the mesh is fsdpzero's"),
    Rule(_TP + "injection_policy_tuple", When("set", lambda c: c.value is not None) & TP_ON, U,
         "DeepSpeed's heuristic injection policy is not carried: give partition_config"),
    Rule(_TP + "kernel_inject", ON & TP_ON, U, "DeepSpeed's inference kernels are not carried"),
    Rule(_TP + "*", TP_ON, N, "DeepSpeed reads it for inference or tp_model_init only; training precision comes "
         "from fp16 / bf16"),
    Rule("train_batch_size", TP_ON, M, "BatchPlan.train_batch_size: micro x GA x world, the tp ranks counted as "
         "DeepSpeed 0.19.8 counts them (a step reads train_batch_size / autotp_size distinct samples)"),
    Rule(_Z + "stage", value_is(1) & TP_ON, A,
         "with tensor_parallel.autotp_size: FSDP2 over dp with stage 2's layout (fully_shard, "
         "reshard_after_forward=False): the same update; parameters and gradients are sharded over dp too, not only "
         "the optimizer state (less memory than DeepSpeed's stage 1)"),
    *(Rule(_Z + k, stage_in(1) & TP_ON, N, "stage 1 with tensor_parallel.autotp_size runs on FSDP2, which "
           "reduces and gathers per wrapped block") for k in ("reduce_bucket_size", "allgather_bucket_size",
                                                              "overlap_comm")),
    *(Rule(k, ON & TP_ON, U, k.split(".")[1] + " " + _TP_WITHOUT) for k in (
        "fp16.fp16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states")),
    Rule("optimizer.type", MUON & TP_ON, U, "Muon (whole-matrix Newton-Schulz on one rank) " + _TP_WITHOUT),
    Rule(_OO + "device", value_in("cpu", "nvme") & TP_ON, U, "offload_optimizer " + _TP_WITHOUT),
    Rule(_OP + "device", value_in("cpu", "nvme") & TP_ON, U, "offload_param " + _TP_WITHOUT),
    Rule(_Z + "mics_shard_size", value_above(0) & TP_ON, U, "MiCS / hybrid sharding " + _TP_WITHOUT),
    Rule(_Z + "zero_hpz_partition_size", value_above(1) & stage_in(3) & TP_ON, U, "hpZ " + _TP_WITHOUT),
    Rule("compile.enabled", ON & TP_ON, U, "compile " + _TP_WITHOUT),
    Rule("compile.deepcompile", ON & TP_ON, U, "deepcompile " + _TP_WITHOUT),
)

# Tried in order before the key's default rule in FATES; the first whose pattern and condition match decides.


def _sp_untested(c: Ctx) -> bool:
    z, cfg = c.cfg.zero_optimization, c.cfg
    return bool(c.device("offload_optimizer") in ("cpu", "nvme") or c.device("offload_param") in ("cpu", "nvme")
                or z.mics_shard_size > 0 or (z.stage == 3 and z.zero_hpz_partition_size > 1)
                or (cfg.compile is not None and (cfg.compile.enabled or cfg.compile.deepcompile)))


_SP_RULES = (
    Rule("sequence_parallel_size", value_above(1) & When("with offload, MiCS / hpZ or compile", _sp_untested), U,
         "sequence parallelism with CPU/NVMe offload, MiCS / hpZ or compile is not implemented (untested "
         "combination): remove one of the two"),
    Rule("sequence_parallel_size", value_above(1), M,
         "SequenceParallelPlan.size: Ulysses over groups of {value} consecutive ranks "
         "(fsdpzero/parallel/ulysses.py): the model's attention (sdpa, eager, flash) registered in transformers' "
         "AttentionInterface behind head/sequence all-to-alls; UlyssesSPDataLoaderAdapter / shard_batch shift the "
         "labels then slice every tensor, position_ids kept global; the loss is the mean over the real tokens of the "
         "whole sequence. ZeRO 0-3 shard over all ranks (dp x sp, DeepSpeed's sequence-data-parallel group; with "
         "tensor_parallel one sp group per tp rank, ZeRO over the data dimension); the batch triad counts world / "
         "{value}. Gradients equal the unsharded run's (DeepSpeed 0.19.8's ZeRO 1/2 divide by dp only: their "
         "gradients and grad norm are {value}x, stage 3 matches). accelerate's door "
         "(ParallelismConfig(sp_backend=\"deepspeed\")) sets it from the mpu accelerate passes to "
         "deepspeed.initialize, and there the loop aggregates the loss, as with DeepSpeed"),
)

CONDITIONAL: tuple[Rule, ...] = (
    *_SP_RULES,
    *_AUTOTP_RULES,
    # ---- ZeRO layout
    Rule(_Z + "stage", value_is(0), M, "FSDP2 on a (world, 1) mesh: replicated params, gradients all-reduced per "
                                       "wrapped block (DDP-style)"),
    Rule(_Z + "stage", value_is(1), M, "ops/fsdpzero_ops/stage1/optimizer.py: replicated params; grads reduce-scattered "
                                       "into fp32 shards at the boundary, sharded optimizer step, params all-gathered"),
    Rule(_Z + "stage", value_is(2), M, "fully_shard(reshard_after_forward=False) per block + root"),
    Rule(_Z + "stage", value_is(3), M, "fully_shard(reshard_after_forward=True) per block + root"),
    Rule(_Z + "zero_hpz_partition_size", value_above(1) & stage_in(0, 1, 2), N, "hpZ acts only at ZeRO stage 3"),
    Rule(_Z + "zero_hpz_partition_size", value_above(1), M,
         "fully_shard(reshard_after_forward={value}): hpZ secondary shard group"),
    Rule(_Z + "mics_shard_size", value_above(0) & stage_in(0), N, "stage 0 shards nothing: FSDP2 on a (world, 1) "
                                                                  "mesh whatever the shard size"),
    Rule(_Z + "mics_shard_size", value_above(0) & stage_in(1), N, "MiCS acted at stage 3 only (DeepSpeed before "
         "0.19.8, which removed it): stage 1's optimizer shards its state over all data ranks, the (replicate, "
         "shard) mesh flattened"),
    Rule(_Z + "mics_shard_size", value_above(0) & stage_in(2), A, "DeepSpeed (before 0.19.8 removed MiCS) ignored "
         "it below stage 3 and sharded over all ranks; here stage 2 shards gradients and optimizer state within "
         "groups of {value} ranks, replicated across groups (HSDP): more memory per rank, the same update"),
    Rule(_Z + "mics_shard_size", value_above(0), M, "HSDP: init_device_mesh({mics_mesh}, ('replicate','shard')) "
                                                    "(MiCS was removed from DeepSpeed 0.19.8)"),
    Rule(_Z + "zero_quantized_weights", ON, A, "ZeRO++ quantized collectives are not carried: full-precision "
                                               "communication"),
    Rule(_Z + "zero_quantized_gradients", ON, A, "ZeRO++ quantized collectives are not carried: full-precision "
                                                 "communication"),
    Rule(_Z + "zero_quantized_nontrainable_weights", ON, U, "quantized frozen weights (ZeRO++) are not implemented"),
    Rule(_Z + "legacy_stage1", ON, U, "DeepSpeed's legacy stage-1 implementation"),
    # ---- offload
    Rule(_OP + "device", value_is("nvme") & NO_OFFLOADED_OPT, A,
         "parameters offloaded to CPU memory (CPUOffloadPolicy), not to NVMe: the NVMe parameter swapper runs with "
         "offload_optimizer (cpu or nvme), which steps one FSDP unit at a time"),
    Rule(_OP + "device", value_is("nvme"), M,
         "fsdpzero.offload.param_swapper: FSDP2's CPU shards (CPUOffloadPolicy) swapped per FSDP unit to ops aio "
         "swap files, read back ahead of each unit in forward and backward, written back after the optimizer step"),
    *(Rule(_OP + leaf, device_is("offload_param", "nvme") & NO_OFFLOADED_OPT, N,
           "no parameter swapper without offload_optimizer: parameters stay in CPU memory")
      for leaf in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu")),
    Rule(_OP + "device", value_is("cpu"), M,
         "fully_shard(offload_policy=CPUOffloadPolicy(pin_memory)); the optimizer steps on CPU"),
    Rule(_OO + "device", value_is("cpu"), M, "ops cpuadam: fp32 master + Adam state on CPU, grad shards copied D2H"),
    Rule(_OO + "device", value_is("nvme") & stage_in(1), U, "stage 1 offloads the optimizer to the CPU only: use "
         "\"cpu\", or stage 2/3 for NVMe offload"),
    Rule(_OO + "device", value_is("nvme"), M, "ops aio NVMe optimizer-state swapper + ops cpuadam"),
    Rule(_OO + "ratio", value_below(1) & NO_OFFLOADED_OPT, N, "no optimizer offload: the whole step is on the "
         "GPU whatever the ratio"),
    Rule(_OO + "ratio", value_below(1) & (device_is("offload_optimizer", "nvme") | device_is("offload_param", "cpu",
                                                                                             "nvme")), U,
         "ratio {value} with offload_param or an nvme optimizer: partial offload needs the params on the GPU (set "
         "ratio to 1.0)"),
    Rule(_OO + "ratio", value_below(1), M,
         "ratio {value}: the CPU steps that fraction of each rank's elements (the last chunks in forward order), the "
         "GPU the rest with fused torch Adam on device fp32 masters (12 more GPU bytes per param it steps, 14 at "
         "stage 2 where their units keep their shards); stages 2 and 3 (DeepSpeed: stage 3 only)"),
    Rule(_OO + "cpuadam_cores_perc", When("super_offload on at stage 3", lambda c: c.stage == 3 and bool(
        c.cfg.zero_optimization.offload_optimizer and c.cfg.zero_optimization.offload_optimizer.super_offload)), M,
         "OffloadPlan.cpuadam_cores_perc: the CPU step's threads are this rank's cores less int((1 - {value}) x "
         "cores), the share DeepSpeed's SuperOffload reserves for PyTorch (the knob offload_threads overrides); one "
         "process, so the reserved cores are not pinned apart as DeepSpeed's affinity split does"),
    Rule(_OO + "super_offload", ON & When("stage 1/2", lambda c: c.stage in (1, 2)), N,
         "DeepSpeed 0.19.8 reads super_offload in its stage-3 optimizer only: at stages 1/2 it does nothing there, "
         "nor here"),
    Rule(_OO + "super_offload", ON, A, "SuperOffload's overlap: fsdpzero's CPU step overlaps the next forward by "
         "default (exact), and its speculative step during backward is on by default on a GPU (knob "
         "offload_speculate; exact: shadow buffers, not rollback); cpuadam_cores_perc sets the CPU step's threads; "
         "no superchip-specific placement"),
    # ---- ZenFlow (one row for the section: fsdpzero.optim.zenflow; refusals of the section's values: translate.py)
    Rule(_Z + "zenflow", ZENFLOW & When('update_interval "auto" (the default)', lambda c: isinstance(
        c.cfg.zero_optimization.zenflow.update_interval, str)), U,
         'update_interval "auto": DeepSpeed 0.19.8 divides the loss by gradient_accumulation_steps, which '
         "configure_zenflow sets to update_interval = 0 under auto: inf gradients and NaN losses within the first "
         "steps (seen on CPU); and its auto rule never fires: the flag auto_ratio sets is cleared before it is read, "
         "so the CPU updates only at select_interval boundaries (with select_strategy auto/epoch and no dataloader: "
         "never after the warm-up); set update_interval to a number"),
    Rule(_Z + "zenflow", ZENFLOW & When("fp16 on", lambda c: bool(c.cfg.fp16.enabled)), U,
         "ZenFlow with fp16 is not implemented (the selective step would need the loss scale); use bf16 or fp32"),
    Rule(_Z + "zenflow", ZENFLOW & When("optimizer not Adam/AdamW", lambda c: c.cfg.optimizer is None or (
        c.cfg.optimizer.type or "").lower() not in ("adam", "adamw")), U,
         "ZenFlow's two steps are AdamW (DeepSpeed: ZenFlowSelectiveAdamW and ZenFlowCPUAdam); use optimizer.type "
         "Adam or AdamW"),
    Rule(_Z + "zenflow", ZENFLOW & When("mics_shard_size > 0 or hpZ at stage 3", lambda c: (
        c.cfg.zero_optimization.mics_shard_size > 0
        or (c.stage == 3 and c.cfg.zero_optimization.zero_hpz_partition_size > 1))), U,
         "ZenFlow on a replicated (HSDP) mesh is not implemented: its column pieces and its clip norm are taken over "
         "the whole world, so replicas would count the norm twice; remove mics_shard_size / zero_hpz_partition_size"),
    Rule(_Z + "zenflow", ZENFLOW & device_is("offload_param", "cpu", "nvme"), U,
         "offload_param with zenflow: the selective step updates the parameters on the device; remove "
         "offload_param"),
    Rule(_Z + "zenflow", ZENFLOW, A,
         "fsdpzero.optim.zenflow.ZenFlowGradPath, DeepSpeed 0.19.8's algorithm on FSDP2 (stages 1-3; stage 1 is "
         "laid out as stage 2): each micro-batch is one step with its loss scaled by 1/update_interval; at a "
         "selection boundary the top topk_ratio columns of each matrix by |gradient| sum, chosen per ZeRO-1/2 "
         "partition piece as DeepSpeed's flat partitions cut them (ZeRO 3: one top-k over the whole columns of each "
         "parameter's own partition, as DeepSpeed's stage 3), and their AdamW moments restart; the selected "
         "columns and the 1-D parameters take an unclipped AdamW step on the device every step; every gradient "
         "accumulates (fp32) and update_interval steps later (and at select_interval) the clipped accumulated "
         "gradient takes a CPU Adam step (bias correction at the step count, as DeepSpeed's step_id) whose result "
         "replaces the unselected part on the device; full_warm_up_rounds full CPU steps first; overlap_step: the CPU "
         "step runs in a thread beside the next interval's forward/backward and lands one interval late, with "
         "DeepSpeed's two alternating moment sets; offload keeps the selective moments (and the copy restored at an "
         "update) on the CPU between steps; "
         "the CPU step is placed as the offload path's (this rank's own cores, knobs offload_threads / offload_bind) "
         "and with overlap_step pt_reserved_cores_perc leaves ceil(perc x n) of its n threads to training, as "
         "DeepSpeed's affinity split (one process here: the two sides are not pinned apart). Differs: select_strategy "
         "\"epoch\"/\"auto\" select once after the warm-up (DeepSpeed: once per len(training_dataloader) steps when "
         "initialize got training_data); global_steps and the reported grad norm count every ZenFlow step (DeepSpeed: "
         "update boundaries, the accumulated gradient's norm); each step's gradient joins the host-resident sum "
         "(in the gradient's dtype, as DeepSpeed's) on the device in chunks (DeepSpeed: per parameter); DeepSpeed's "
         "stage-1 ZenFlow and a CPU step still running when a selection resyncs the masters are not reproduced"),
    # ---- optimizer and scheduler
    Rule("optimizer.type", ONEBIT_ADAM & stage_in(0), A,
         "{value}: 1-bit Adam's uncompressed warm-up math on every step (Adam without bias correction, decoupled "
         "weight decay: AdamNoBiasCorrection), with full-precision gradient all-reduce. DeepSpeed (older releases; "
         "0.19.8 has no 1-bit optimizers) switches at freeze_step to 1-bit compressed momentum with error feedback "
         "and a frozen variance, and its first step only primes the moments"),
    Rule("optimizer.type", ONEBIT_ADAM, U, "{value} with ZeRO: DeepSpeed's 1-bit Adam ran without ZeRO only; use "
         "stage 0, or AdamW"),
    Rule("optimizer.type", When("a 1-bit optimizer", lambda c: optimizer_kind(c.value) == "onebit"), U,
         "{value}: compressed-communication optimizers are not implemented"),
    Rule("optimizer.type", MUON & When("fp16 on", lambda c: bool(c.cfg.fp16.enabled)), U,
         "Muon with fp16: DeepSpeed keeps the momentum in loss-scaled units; use bf16 or fp32"),
    Rule("optimizer.type", MUON & device_is("offload_optimizer", "nvme"), U, "Muon with offload_optimizer nvme: "
         "not implemented (DeepSpeed 0.19.8 runs it at stage 3, the momentum swapped or, with "
         "save_muon_momentum_buffer_in_memory, in CPU memory); use offload_optimizer.device cpu"),
    Rule("optimizer.type", MUON & device_is("offload_optimizer", "cpu") & When(
        "offload_optimizer.ratio < 1", lambda c: float(c.cfg.zero_optimization.offload_optimizer.ratio) < 1), U,
         "Muon with offload_optimizer.ratio < 1: not implemented (the device-stepped part runs Adam); set ratio to "
         "1.0"),
    Rule("optimizer.type", MUON & device_is("offload_optimizer", "cpu") & When("bf16 on", lambda c: bool(
        c.cfg.bf16.enabled)), A,
         "fsdpzero.optim.muon.MuonWithAuxAdam's split, hyper-parameters and clipping order (see the fp32 row) with "
         "offload_optimizer cpu, as DeepSpeed 0.19.8 runs it (stage_1_and_2._apply_muon_updates_cpu_offload, "
         "stage3._muon_update_sub_group): fp32 masters and Muon's momentum on the CPU, each matrix's Newton-Schulz "
         "once, on one rank (DeepSpeed: on every rank). Differs at stages 2/3 (fsdpzero/offload/muon.py): "
         "the global norm reads the orthogonalized update rounded to the 16-bit gradient (DeepSpeed: its fp32 "
         "partition); the CPU step applies the fp32 update"),
    Rule("optimizer.type", MUON, M,
         "fsdpzero.optim.muon.MuonWithAuxAdam, DeepSpeed 0.19.8's: its split (matrices but embeddings and lm_head "
         "take Muon, the rest AdamW), nesterov momentum and 5-step Newton-Schulz (ns_method gram/standard) on each "
         "whole matrix, run once on one owner rank (gathered from the shards, its pieces scattered back); the "
         "momentum stays sharded. gradient_clipping in DeepSpeed's order: at ZeRO 1-3 the global norm is taken "
         "over the orthogonalized Muon updates and the AdamW gradients and the clip scales both (the momentum moves "
         "with the unclipped gradient; the reported grad norm is that norm, as DeepSpeed's); at ZeRO 0 over the raw "
         "gradients, before Muon. offload_optimizer cpu (stages 1-3, as DeepSpeed 0.19.8's "
         "stage_1_and_2._apply_muon_updates_cpu_offload / stage3._muon_update_sub_group, which compute what they do "
         "without offload): the fp32 masters and the momentum on the CPU, each matrix's Newton-Schulz once, on one "
         "rank, on the GPU where there is one (DeepSpeed: on every rank), the CPU step applies the update "
         "(fsdpzero/offload/muon.py; stage 1 steps its flat CPU shards). A Muon parameter of 3 or more dims "
         "(fused MoE experts (E, out, in), a Conv1d filter) is, as DeepSpeed's muon_update takes it, a batch of "
         "matrices over its leading dims, gathered whole to its owner. Refused with the fix: fp16, "
         "offload_optimizer nvme or ratio < 1, per_head_muon, a 4-D (Conv2d) Muon parameter (DeepSpeed's "
         "muon_update fails on it)"),
    Rule("optimizer.type", When("MuAdam, MuAdamW, MuSGD or Lion", lambda c: (c.value or "").lower() in (
        "muadam", "muadamw", "musgd", "lion")), U, "{value}: no fsdpzero implementation"),
    *(Rule("optimizer.type", When(f"{k} (canonical)", lambda c, k=k: c.fields()["canon"] == k), M,
           "OptimizerPlan.type={canon!r}: " + how) for k, how in _ADAM_HOW.items()),
    Rule("optimizer.type", ALWAYS, M, "OptimizerPlan.type={canon!r}: torch.optim.{value}"),
    Rule("optimizer.params.*", leaf_in("torch_adam"), M, "OptimizerPlan.torch_adam"),
    Rule("optimizer.params.*", leaf_in("adam_w_mode"), M, "OptimizerPlan.adam_w_mode"),
    Rule("optimizer.params.*", leaf_in("fp32_optimizer_states", "set_grad_none"), N,
         "DeepSpeed kernel option; torch optimizers keep fp32 state for fp32 params"),
    Rule("optimizer.params.*", leaf_in("freeze_step", "cuda_aware", "comm_backend_name") & OPT_IS_ONEBIT_ADAM, A,
         "1-bit compression is not implemented: gradients are all-reduced uncompressed on every step"),
    Rule("optimizer.params.*", leaf_in("bias_correction") & OPT_IS_ONEBIT_ADAM, N,
         "1-bit Adam never bias-corrects, whatever the value; fsdpzero's run of it neither"),
    Rule("optimizer.params.*", leaf_in("muon_lr", "adam_lr", "momentum", "ns_method") & OPT_IS_MUON, M,
         "MuonWithAuxAdam: muon_lr / adam_lr override lr for the Muon / AdamW half; momentum and ns_method are "
         "Muon's"),
    Rule("optimizer.params.*", leaf_in("per_head_muon") & OPT_IS_MUON & ON, U, "per-head Newton-Schulz is not "
         "implemented"),
    Rule("optimizer.params.*", leaf_in("per_head_muon") & OPT_IS_MUON, N, "false: whole-matrix Newton-Schulz, "
         "DeepSpeed's default"),
    Rule("optimizer.params.*", ALWAYS, M, "keyword argument of the {opt_type} optimizer"),
    Rule("scheduler.type", When("a DeepSpeed scheduler", lambda c: c.value in SCHEDULERS), M,
         "fsdpzero's {value}: same formula as DeepSpeed, stepped per optimizer step"),
    Rule("scheduler.type", ALWAYS, M, "torch.optim.lr_scheduler.{value}"),
    Rule("scheduler.params.*", ALWAYS, M, "{sched_type} keyword argument"),
    # ---- features fsdpzero does not carry
    *(Rule(k, cond, U, why) for k, (cond, why) in _UNSUPPORTED_WHEN_ON.items()),
    # compile: enabled (older DeepSpeed's key) or deepcompile turn on torch.compile per block (fsdpzero/compile.py)
    Rule("compile.enabled", ON, M, "torch.compile of each transformer block's forward, inside FSDP2's hooks, "
                                   "activation checkpointing inside the compiled region, and of an HF model's loss "
                                   "function (fsdpzero/compile.py)"),
    Rule("compile.enabled", OFF, N, "off (fsdpzero's compile tuning knob, FSDPZERO_COMPILE=1, turns it on)"),
    Rule("compile.deepcompile", ON, A, "DeepCompile's graph passes are not implemented: taken as a request for the "
                                       "fastest compiled path, torch.compile per transformer block (compile.backend, "
                                       "default inductor)"),
    # DeepCompile's memory passes: a config that relies on them to fit would not fit here; say so, with the keys
    # that do the same job under fsdpzero (the offloads refuse: a run that silently needs the full state on the GPU
    # fails late with out-of-memory; the activation passes only cost memory)
    Rule("compile.offload_opt_states", ON & DEEPCOMPILE_ON, U, "DeepCompile's optimizer-state offload pass is not "
         "carried: use zero_optimization.offload_optimizer (device cpu or nvme)"),
    Rule("compile.offload_parameters", ON & DEEPCOMPILE_ON, U, "DeepCompile's parameter offload pass is not "
         "carried: use zero_optimization.offload_param (stage 3)"),
    Rule("compile.free_activation", ON & DEEPCOMPILE_ON, A, "DeepCompile's activation-freeing pass is not carried: "
         "the run keeps activations as eager PyTorch does (more GPU memory); activation_checkpointing saves it"),
    Rule("compile.offload_activation", ON & DEEPCOMPILE_ON, A, "DeepCompile's activation offload pass is not "
         "carried: activations stay on the GPU (more memory); activation_checkpointing saves it"),
    Rule("compile.backend", COMPILE_ON, M, "torch.compile(backend=...) per block"),
    Rule("compile.kwargs", COMPILE_ON, M, "torch.compile keyword arguments (mode, dynamic, fullgraph, options) per "
                                          "block"),
    Rule("pipeline", ABSENT, N, "not used"),
    Rule("expert_parallel", ABSENT | When("expert_parallel.enabled false", lambda c: isinstance(c.value, dict)
                                          and not c.value.get("enabled")), N,
         "AutoEP is off: DeepSpeed 0.19.8 reads the section's other keys (autoep_size, ...) only when enabled is true"),
    *(Rule(k, ABSENT, N, "not used") for k in ("weight_quantization", _Z + "zenflow")),
    Rule("activation_checkpointing.partition_activations", ON, A,
         "needs tensor parallelism: activations are checkpointed whole"),
    # ---- precision
    Rule("aio.use_gds", ON, U, "GPUDirect Storage is not supported: swaps go through pinned CPU buffers (set it "
                               "to false)"),
    Rule("fp16.enabled", OFF, N, "off"),
    Rule("bf16.enabled", OFF, N, "off"),
    Rule("torch_autocast.enabled", OFF, N, "off"),
    Rule("fp16.*", section_off("fp16"), N, "fp16 is off"),
    Rule("bf16.*", section_off("bf16"), N, "bf16 is off"),
    *(Rule(f"{sec}.{sec}_master_weights_and_grads", ON & OFFLOADED_OPT, A,
           f"ops cpuadam keeps an fp32 copy of the {sec} master on the CPU and rounds the result into it (DeepSpeed's "
           "CPU Adam updates the 16-bit master directly): differences of rounding") for sec in ("fp16", "bf16")),
    *(Rule(f"{sec}.{sec}_master_weights_and_grads", ON & stage_in(1), A,
           "the stage-1 optimizer keeps fp32 master shards (more precise, twice the master memory)")
      for sec in ("fp16", "bf16")),
    Rule("fp16.fp16_master_weights_and_grads", ON, M, "PrecisionPlan.master_dtype=float16 (DeepSpeed: with CPU "
                                                      "Adam only)"),
    Rule("bf16.bf16_master_weights_and_grads", ON, M, "PrecisionPlan.master_dtype=bfloat16: pure-bf16 sharded "
                                                      "params"),
    Rule("bf16.bf16_optimizer_states", ON & OFFLOADED_OPT, A,
         "ops cpuadam keeps fp32 moments on the CPU, where DeepSpeed's CPU Adam keeps bf16 ones (more precise, "
         "twice the CPU memory)"),
    Rule("bf16.bf16_optimizer_states", ON & stage_in(1), A,
         "the stage-1 optimizer keeps fp32 masters and so fp32 moments (more precise, twice the state memory)"),
    Rule("bf16.bf16_optimizer_states", ON, M,
         "PrecisionPlan.optimizer_state_dtype=bfloat16: the Adam moments are created in bf16, the dtype of the "
         "bf16 master weights it requires (checked when the optimizer is built)"),
    Rule("gradient_predivide_factor", When("value != 1.0", lambda c: c.value != 1.0), A,
         "the reduced gradient is the same mean of the ranks' gradients; FSDP2 places the division itself (fp16: "
         "~sqrt(world) before and the rest after the reduction, the overflow guard this factor exists for; "
         "fp32/bf16: a fused average), so results differ from DeepSpeed's only by rounding. DeepSpeed 0.19.8 "
         "accepts a factor != 1 at ZeRO 1-3 only with reduce_scatter false"),
    Rule("checkpoint.load_universal", ON, M, "CheckpointPlan.load_universal: with no tag, load the DeepSpeed "
         "universal checkpoint `latest_universal` names, converted once (fsdpzero.checkpoint.universal)"),
    Rule("checkpoint.use_node_local_storage", ON & MULTI_NODE, U,
         "DCP writes each rank's shards plus one metadata file (rank 0) under save_dir, and loading needs them all "
         "in one directory: use storage every node sees"),
    Rule("checkpoint.use_node_local_storage", ON, N,
         "one node: every rank's files are on this node's storage already"),
    # ---- ZeRO knobs whose meaning depends on the stage or the offload device
    Rule(_Z + "ignore_unused_parameters", OFF, A,
         "parameters without gradients are tolerated, not reported as DeepSpeed's ZeRO 2/3 assertion does"),
    Rule("timers.throughput.enabled", OFF, N, "samples/s is always in the step log"),
    Rule(_Z + "stage3_*", stage_in(0, 1, 2), N, "acts only at ZeRO stage 3 (stage is {stage})"),
    Rule(_Z + "reduce_bucket_size", stage_in(1), M, "ops stage-1 reduce-scatter bucket (elements)"),
    Rule(_Z + "allgather_bucket_size", stage_in(1), M, "ops stage-1 post-step all-gather bucket (elements)"),
    Rule(_Z + "overlap_comm", stage_in(1), M, "ops stage-1 reduce-scatters buckets from backward hooks as they fill"),
    Rule(_Z + "allgather_bucket_size", stage_in(0), N, "no sharding at stage 0"),
    Rule(_Z + "allgather_bucket_size", stage_in(2, 3), N, "FSDP2 all-gathers per wrapped block"),
    Rule(_Z + "reduce_bucket_size", stage_in(0), N,
         "stage 0 is FSDP2 on a (world, 1) mesh: gradients are all-reduced per wrapped block, not in buckets"),
    Rule(_Z + "load_from_fp32_weights", OFF, A,
         "the fp32 masters are always restored from the checkpoint's fp32 copy (DeepSpeed: from the 16-bit weights "
         "when false)"),
    Rule(_Z + "reduce_bucket_size", stage_in(2, 3), N,
         "FSDP2 reduce-scatters per wrapped block (the unit replaces the bucket)"),
    Rule(_Z + "sub_group_size", NO_OFFLOADED_OPT, N, "only tiles the offloaded optimizer step"),
    Rule(_Z + "offload_*.*", OWN_DEVICE_NONE, N, "{part} device is 'none'"),
    *(Rule(_Z + "offload_*." + leaf, OWN_DEVICE_CPU, N, "{part} device is 'cpu'") for leaf in _NVME_ONLY),
)

# Every key's default rule, after the conditional ones: one table.
RULES: tuple[Rule, ...] = CONDITIONAL + tuple(Rule(k, ALWAYS, s, how) for k, (s, how) in FATES.items())


def decide(path: str, value: Any, cfg: "DSConfig", env: "Env") -> tuple[str, str]:
    """The fate of one canonical key given its value: the first rule of RULES that matches."""
    ctx = Ctx(path, value, cfg, env)
    for rule in CONDITIONAL:
        if rule.matches(ctx):
            return rule.status, rule.how.format_map(ctx.fields()) if "{" in rule.how else rule.how
    return FATES.get(path, UNKNOWN_FATE)
