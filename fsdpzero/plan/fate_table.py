"""The key-fate table: what every DeepSpeed key becomes under FSDP2, as data.

FATES maps a canonical dotted key (DeepSpeed's documented spelling, e.g. `stage3_prefetch_bucket_size`) to
(status, detail); WHEN says in words where the value changes that fate. fsdpzero.plan.fates.decide starts from this
table and overrides it where the value matters (a feature switched on, a stage that changes the meaning).
docs/migration.md is generated from FATES and WHEN; a test checks that every field of the schema has an entry.
"""
from __future__ import annotations

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
    "gradient_predivide_factor": (M, "FSDPModule.set_gradient_divide_factor(f), then x f/dp after the reduce"),
    "prescale_gradients": (N, "FSDP2 averages in the reduce-scatter; pre- or post-scaling is the same mean"),
    "gradient_allreduce_op": (M, "mean: FSDP2's default reduce-scatter average"),
    "communication_data_type": (M, "MixedPrecisionPolicy(reduce_dtype=...); unset: the model dtype, as DeepSpeed"),
    "seq_parallel_communication_data_type": (N, "no sequence parallelism in fsdpzero"),
    "sequence_parallel_size": (N, "1: no sequence parallelism"),
    "steps_per_print": (M, "rank-0 progress log interval"),
    "wall_clock_breakdown": (M, "rank-0 step timers (forward/backward/step)"),
    "memory_breakdown": (N, "use torch.cuda.memory_summary(); not logged per step"),
    "dump_state": (N, "the resolved plan is printed at start instead"),
    "disable_python_gc": (N, "Python GC is left alone"),
    "disable_allgather": (N, "legacy DeepSpeed switch"),
    "zero_allow_untested_optimizer": (M, "OptimizerPlan.zero_allow_untested_optimizer: same check as DeepSpeed"),
    "zero_force_ds_cpu_optimizer": (M, "offload uses fsdpzero's CPU Adam (ops cpuadam), the DeepSpeed CPU Adam's "
                                       "counterpart"),
    "vocabulary_size": (N, "DeepSpeed only warns when not a multiple of 8"),
    "dataloader_drop_last": (M, "DataLoader(drop_last=...)"),
    "log_level": (M, "fsdpzero logger level (rank 0)"),
    "use_data_before_expert_parallelism": (N, "no expert parallelism"),
    # ---- precision
    "fp16": (M, "fp16 mixed precision section"),
    "fp16.enabled": (M, "MixedPrecisionPolicy(param_dtype=float16) + fp32 sharded master + DeepSpeed-semantics "
                        "dynamic loss scaler (fsdpzero.precision)"),
    "fp16.auto_cast": (M, "MixedPrecisionPolicy(cast_forward_inputs=True), FSDP2's default"),
    "fp16.loss_scale": (M, "LossScalePlan.loss_scale: 0 dynamic, > 0 static"),
    "fp16.initial_scale_power": (M, "LossScalePlan.initial_scale_power: first scale 2**p"),
    "fp16.loss_scale_window": (M, "LossScalePlan.loss_scale_window: clean steps before x2"),
    "fp16.hysteresis": (M, "LossScalePlan.hysteresis: overflows tolerated before /2 (GradScaler has none)"),
    "fp16.consecutive_hysteresis": (M, "LossScalePlan.consecutive_hysteresis"),
    "fp16.min_loss_scale": (M, "LossScalePlan.min_loss_scale: the floor; overflow at the floor aborts"),
    "fp16.fp16_master_weights_and_grads": (M, "PrecisionPlan.master_dtype=float16"),
    "bf16": (M, "bf16 mixed precision section"),
    "bf16.enabled": (M, "MixedPrecisionPolicy(param_dtype=bfloat16) + fp32 sharded master weights"),
    "bf16.immediate_grad_update": (N, "FSDP2 accumulates reduced gradient shards directly"),
    "bf16.check_grad_overflow": (M, "PrecisionPlan.check_grad_overflow: non-finite grad norm => skip the step"),
    "bf16.bf16_master_weights_and_grads": (M, "PrecisionPlan.master_dtype=bfloat16: pure-bf16 sharded params"),
    "bf16.bf16_optimizer_states": (M, "PrecisionPlan.optimizer_state_dtype=bfloat16"),
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
    _Z + "reduce_bucket_size": (M, "ShardPlan.reduce_bucket_size (elements): bucket of the stage-0 all-reduce and "
                                   "of the stage-1 reduce-scatter (fsdpzero/ops/stage1/optimizer.py); "
                                   "at stages 2/3 FSDP2 reduces per wrapped block"),
    _Z + "use_multi_rank_bucket_allreduce": (N, "FSDP2 buckets per wrapped block"),
    _Z + "allgather_partitions": (N, "FSDP2 always all-gathers"),
    _Z + "allgather_bucket_size": (M, "ShardPlan.allgather_bucket_size: post-step all-gather bucket of the "
                                      "stage-1 optimizer (ops stage1)"),
    _Z + "overlap_comm": (N, "FSDP2 always overlaps communication on separate streams; at stage 1 it starts the "
                             "reduce-scatter buckets from backward hooks (fsdpzero/ops/stage1/optimizer.py)"),
    _Z + "compute_grad_norm": (N, "the grad norm is always computed (clipping, overflow check)"),
    _Z + "load_from_fp32_weights": (M, "checkpoint load restores fp32 masters from DCP (always true)"),
    _Z + "elastic_checkpoint": (N, "DCP reshards natively on load"),
    _Z + "offload_param": (M, "OffloadPlan.param_device"),
    _Z + "offload_optimizer": (M, "OffloadPlan.optimizer_device"),
    _Z + "zenflow": (U, "ZenFlow's stale top-k CPU updates are not implemented"),
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
    _Z + "ignore_unused_parameters": (M, "FSDP2 tolerates None grads; stage 0 uses find_unused_parameters"),
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
    _OO + "pin_memory": (M, "OffloadPlan.pin_memory"),
    _OO + "pipeline_read": (A, "the NVMe swapper always overlaps reads"),
    _OO + "pipeline_write": (A, "the NVMe swapper always overlaps writes"),
    _OO + "fast_init": (N, "optimizer-state init speed-up only"),
    _OO + "ratio": (M, "OffloadPlan.ratio: 1.0, the whole optimizer step on CPU"),
    _OO + "super_offload": (N, "false"),
    _OO + "cpuadam_cores_perc": (A, "CPU Adam uses torch's intra-op threads"),
    # ---- NVMe I/O
    "aio": (M, "OffloadPlan.aio: parameters of the ops aio NVMe engine"),
    "aio.block_size": (M, "AioPlan.block_size"),
    "aio.queue_depth": (M, "AioPlan.queue_depth"),
    "aio.intra_op_parallelism": (M, "AioPlan.intra_op_parallelism (I/O threads)"),
    "aio.single_submit": (M, "AioPlan.single_submit"),
    "aio.overlap_events": (M, "AioPlan.overlap_events"),
    "aio.use_gds": (M, "AioPlan.use_gds (CUDA only)"),
    # ---- activation checkpointing
    "activation_checkpointing": (M, "ActivationCheckpointPlan: checkpoint_wrapper(NO_REENTRANT) per block before "
                                    "fully_shard"),
    "activation_checkpointing.partition_activations": (N, "needs tensor parallelism; activations are not split"),
    "activation_checkpointing.contiguous_memory_optimization": (N, "allocator detail"),
    "activation_checkpointing.cpu_checkpointing": (M, "ActivationCheckpointPlan.cpu_checkpointing: "
                                                      "torch.autograd.graph.save_on_cpu"),
    "activation_checkpointing.number_checkpoints": (M, "ActivationCheckpointPlan.number_checkpoints"),
    "activation_checkpointing.synchronize_checkpoint_boundary": (N, "profiling aid"),
    "activation_checkpointing.profile": (N, "profiling aid"),
    # ---- checkpoints
    "checkpoint": (M, "CheckpointPlan: DCP save/load under <save_dir>/<tag>/ plus `latest`"),
    "checkpoint.tag_validation": (M, "CheckpointPlan.tag_validation: all-gather tags and compare"),
    "checkpoint.load_universal": (M, "CheckpointPlan.load_universal: read DeepSpeed universal checkpoints"),
    "checkpoint.use_node_local_storage": (M, "CheckpointPlan.use_node_local_storage"),
    "checkpoint.parallel_write": (N, "pipeline-parallel write option"),
    "checkpoint.parallel_write.pipeline_stage": (N, "no pipeline parallelism"),
    "checkpoint.checkpoint_serialization": (N, "DCP writes its own format"),
    "checkpoint.writer": (A, "DCP FileSystemWriter with its own threads"),
    "checkpoint.writer.type": (A, "DCP FileSystemWriter"),
    "checkpoint.writer.io_buffer_size": (N, "DCP manages buffers"),
    "checkpoint.writer.io_buffer_double": (N, "DCP manages buffers"),
    "checkpoint.writer.show_statistics": (N, "no writer statistics"),
    "checkpoint.writer.data_parallel": (N, "every rank writes its shard"),
    "checkpoint.writer.decoupled": (A, "CheckpointPlan.async_save: dcp.async_save"),
    "checkpoint.writer.io_multiplier": (N, "DCP manages I/O"),
    # ---- monitoring
    "tensorboard": (M, "MonitorPlan.tensorboard: rank-0 SummaryWriter (Train/Samples/*)"),
    "tensorboard.enabled": (M, "MonitorPlan.tensorboard"),
    "tensorboard.output_path": (M, "log directory"),
    "tensorboard.job_name": (M, "run name"),
    "wandb": (M, "MonitorPlan.wandb: rank-0 wandb.log"),
    "wandb.enabled": (M, "MonitorPlan.wandb"),
    "wandb.group": (M, "wandb group"),
    "wandb.team": (M, "wandb entity"),
    "wandb.project": (M, "wandb project"),
    "csv_monitor": (M, "MonitorPlan.csv_monitor: rank-0 CSV files"),
    "csv_monitor.enabled": (M, "MonitorPlan.csv_monitor"),
    "csv_monitor.output_path": (M, "CSV directory"),
    "csv_monitor.job_name": (M, "run name"),
    "comet": (M, "MonitorPlan.comet: rank-0 comet_ml experiment"),
    **{f"comet.{k}": (M, f"comet_ml {k}") for k in ("enabled", "samples_log_interval", "project", "workspace",
                                                    "api_key", "experiment_name", "experiment_key", "online",
                                                    "mode")},
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
    # ---- features fsdpzero does not carry (fates change when switched on; see translate.decide)
    "tensor_parallel": (N, "autotp_size 0/1: no tensor parallelism"),
    **{f"tensor_parallel.{k}": (N, "no tensor parallelism") for k in (
        "dtype", "autotp_size", "tp_overlap_comm", "vocab_parallel_lm_head", "vocab_parallel_ce_backend", "tp",
        "tp.tp_size", "tp.tp_grain_size", "tp.mpu", "tp.tp_group", "injection_policy_tuple", "partition_config",
        "preset_model", "keep_module_on_host", "kernel_inject")},
    "compile": (N, "DeepCompile off: compile with torch.compile per block after fully_shard"),
    **{f"compile.{k}": (N, "DeepCompile option") for k in (
        "deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
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
    "expert_parallel": (U, "expert parallelism is not implemented"),
}
for _k in ("topk_ratio", "select_strategy", "select_interval", "update_interval", "overlap_step", "offload",
           "auto_ratio", "full_warm_up_rounds", "pt_reserved_cores_perc", "steps_per_epoch"):
    FATES[_Z + "zenflow." + _k] = (N, "part of the zenflow section (its fate is the section's)")

UNKNOWN_FATE = (N, "unknown to DeepSpeed, ignored as DeepSpeed does")

# Where the value changes the fate (fsdpzero.plan.fates.decide), in words for docs/migration.md.
WHEN = {
    _Z + "stage": "0: replicated params, all-reduced grads; 1: ops stage1; 2/3: fully_shard per block + root",
    _Z + "zero_hpz_partition_size": "k > 1 at stage 3: reshard_after_forward=k (k must divide the world size)",
    _Z + "mics_shard_size": "k > 0: HSDP mesh (world/k, k) ('replicate', 'shard'); removed from DeepSpeed 0.19.8",
    _Z + "zero_quantized_weights": "true: approximated (full-precision all-gather)",
    _Z + "zero_quantized_gradients": "true: approximated (full-precision reduce-scatter)",
    _Z + "zero_quantized_nontrainable_weights": "true: unsupported",
    _Z + "legacy_stage1": "true: unsupported",
    _Z + "reduce_bucket_size": "stages 2/3: noop (the wrapped block is the unit)",
    _Z + "allgather_bucket_size": "stages 0/2/3: noop",
    _Z + "sub_group_size": "without optimizer offload: noop",
    _OP + "device": "cpu: CPUOffloadPolicy; nvme: fsdpzero.offload.param_swapper swapper with offload_optimizer on, "
                    "else approximated (CPU memory)",
    _OO + "device": "cpu: ops cpuadam; nvme: ops aio swapper + cpuadam",
    _OO + "ratio": "< 1 (stage 3): that fraction of the elements steps on CPU, the rest on the GPU (fused torch "
                   "Adam on device fp32 masters); with offload_param or nvme: unsupported",
    _OO + "super_offload": "true: approximated (regular CPU offload)",
    "optimizer.type": "Adam -> 'adamw' unless adam_w_mode false; OneBitAdam/ZeroOneAdam/OneBitLamb, Lion, "
                      "MuAdam/MuAdamW/MuSGD, Muon: unsupported",
    "gradient_allreduce_op": "sum: unsupported",
    "managed_gradient_accumulation": "false: unsupported",
    "sequence_parallel_size": "> 1: unsupported",
    "tensor_parallel.autotp_size": "> 1: unsupported",
    "compile.deepcompile": "true: unsupported",
    "hybrid_engine.enabled": "true: unsupported",
    "data_efficiency": "enabled: unsupported",
    "datastates": "enabled: unsupported",
    "activation_checkpointing.partition_activations": "true: approximated",
    "fp16.enabled": "false: noop (and every other fp16 key)",
    "bf16.enabled": "false: noop (and every other bf16 key)",
    "pipeline": "absent: noop", "expert_parallel": "absent: noop", "weight_quantization": "absent: noop",
    _Z + "zenflow": "absent: noop",
}
