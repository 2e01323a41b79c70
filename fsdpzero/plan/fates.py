"""The fate of a DeepSpeed key given its value: decide() reads the table in fsdpzero.plan.fate_table and overrides it
where the value changes the answer (a feature switched on, a stage that changes the meaning). translate.py calls it
for every key of a config.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdpzero.config.rules import SCHEDULERS, canonical_optimizer, optimizer_kind
# FATES and WHEN are imported from here too (migrate, tests)
from fsdpzero.plan.fate_table import FATES, UNKNOWN_FATE, WHEN

if TYPE_CHECKING:
    from fsdpzero.config import DSConfig
    from fsdpzero.plan import Env

__all__ = ["FATES", "UNKNOWN_FATE", "WHEN", "decide"]
_OFFLOAD_PARAM = "zero_optimization.offload_param."


def decide(path: str, value: Any, cfg: "DSConfig", env: "Env") -> tuple[str, str]:
    """The fate of one key given its value: the table, overridden where the value changes the answer."""
    z = cfg.zero_optimization
    on = bool(value) and value not in ("none", "auto")
    if path == "zero_optimization.stage":
        return {0: ("mapped", "replicated params, all-reduced grads (DDP-style; reduce_bucket_size buckets)"),
                1: ("mapped", "fsdpzero/ops/stage1/optimizer.py: replicated params; grads reduce-scattered into fp32 "
                              "shards at the boundary, sharded optimizer step, params all-gathered"),
                2: ("mapped", "fully_shard(reshard_after_forward=False) per block + root"),
                3: ("mapped", "fully_shard(reshard_after_forward=True) per block + root")}[z.stage]
    if path == "zero_optimization.zero_hpz_partition_size" and value not in (0, 1):
        if z.stage != 3:
            return "noop", "hpZ acts only at ZeRO stage 3"
        return "mapped", f"fully_shard(reshard_after_forward={value}): hpZ secondary shard group"
    if path == "zero_optimization.mics_shard_size" and isinstance(value, int) and value > 0:
        return "mapped", (f"HSDP: init_device_mesh({(env.world_size // value, value)}, ('replicate','shard')) "
                          "(MiCS was removed from DeepSpeed 0.19.8)")
    if path in ("zero_optimization.zero_quantized_weights", "zero_optimization.zero_quantized_gradients") and on:
        return "approximated", "ZeRO++ quantized collectives are not carried: full-precision communication"
    if path == "zero_optimization.zero_quantized_nontrainable_weights" and on:
        return "unsupported", "quantized frozen weights (ZeRO++) are not implemented"
    if path == "zero_optimization.legacy_stage1" and on:
        return "unsupported", "DeepSpeed's legacy stage-1 implementation"
    swaps_params = z.offload_optimizer is not None and z.offload_optimizer.device != "none"
    if path.endswith("offload_param.device") and value == "nvme":
        if not swaps_params:
            return "approximated", ("parameters offloaded to CPU memory (CPUOffloadPolicy), not to NVMe: the NVMe "
                                    "parameter swapper runs with offload_optimizer (cpu or nvme), which steps "
                                    "one FSDP unit at a time")
        return "mapped", ("fsdpzero.offload.param_swapper: FSDP2's CPU shards (CPUOffloadPolicy) swapped per FSDP unit "
                          "to ops aio swap files, read back ahead of each unit in forward and backward, written "
                          "back after the optimizer step")
    if (path.startswith(_OFFLOAD_PARAM) and z.offload_param is not None and z.offload_param.device == "nvme"
            and not swaps_params
            and path[len(_OFFLOAD_PARAM):] in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu")):
        return "noop", "no parameter swapper without offload_optimizer: parameters stay in CPU memory"
    if path.endswith("offload_param.device") and value != "none":
        return "mapped", "fully_shard(offload_policy=CPUOffloadPolicy(pin_memory)); the optimizer steps on CPU"
    if path.endswith("offload_optimizer.device") and value != "none":
        return "mapped", ("ops cpuadam: fp32 master + Adam state on CPU, grad shards copied D2H"
                          if value == "cpu" else "ops aio NVMe optimizer-state swapper + ops cpuadam")
    if path.endswith("offload_optimizer.ratio") and isinstance(value, (int, float)) and value < 1:
        oo, op = z.offload_optimizer, z.offload_param
        if (oo is not None and oo.device == "nvme") or (op is not None and op.device not in (None, "none")):
            return "unsupported", (f"ratio {value} with offload_param or an nvme optimizer: partial offload "
                                   "needs the params on the GPU (set ratio to 1.0)")
        return "mapped", (f"ratio {value}: the CPU steps that fraction of each rank's elements (the last chunks in "
                          "forward order), the GPU the rest with fused torch Adam on device fp32 masters")
    if path.endswith("offload_optimizer.super_offload") and on:
        return "approximated", "superchip offload: regular CPU offload"
    if path == "optimizer.type":
        kind = optimizer_kind(value)
        low = (value or "").lower()
        if kind == "onebit":
            return "unsupported", f"{value}: compressed-communication optimizers are not implemented"
        if low in ("muadam", "muadamw", "musgd", "muon", "lion"):
            return "unsupported", f"{value}: no fsdpzero implementation"
        canon = canonical_optimizer(value, cfg.optimizer.params if cfg.optimizer else {})
        how = {"adamw": "torch.optim.AdamW (foreach) on DTensor shards", "adam": "torch.optim.Adam (foreach)",
               "lamb": "fsdpzero.optim.lamb.Lamb (torch has no LAMB)", "sgd": "torch.optim.SGD",
               "adagrad": "torch.optim.Adagrad"}.get(canon, f"torch.optim.{value}")
        return "mapped", f"OptimizerPlan.type={canon!r}: {how}"
    if path.startswith("optimizer.params."):
        key = path.rsplit(".", 1)[1]
        if key in ("torch_adam", "adam_w_mode"):
            return "mapped", f"OptimizerPlan.{key}"
        if key in ("fp32_optimizer_states", "set_grad_none"):
            return "noop", "DeepSpeed kernel option; torch optimizers keep fp32 state for fp32 params"
        return "mapped", f"keyword argument of the {cfg.optimizer.type if cfg.optimizer else ''} optimizer"
    if path == "scheduler.type":
        if value in SCHEDULERS:
            return "mapped", f"fsdpzero's {value}: same formula as DeepSpeed, stepped per optimizer step"
        return "mapped", f"torch.optim.lr_scheduler.{value}"
    if path.startswith("scheduler.params."):
        return "mapped", f"{cfg.scheduler.type} keyword argument"
    if path == "gradient_allreduce_op" and value == "sum":
        return "unsupported", "summed (not averaged) gradients are not carried"
    if path == "managed_gradient_accumulation" and value is False:
        return "unsupported", "client-managed accumulation boundaries are not carried"
    if path == "sequence_parallel_size" and isinstance(value, int) and value > 1:
        return "unsupported", "sequence parallelism is not implemented"
    if path == "tensor_parallel.autotp_size" and isinstance(value, int) and value > 1:
        return "unsupported", "AutoTP tensor parallelism is not implemented"
    if path == "compile.deepcompile" and on:
        return "unsupported", "DeepCompile is not implemented (torch.compile per block is)"
    if path == "hybrid_engine.enabled" and on:
        return "unsupported", "the RLHF hybrid engine is not implemented"
    if path in ("data_efficiency", "datastates") and isinstance(value, dict) and value.get("enabled"):
        return "unsupported", f"DeepSpeed {path} is not implemented"
    if path == "activation_checkpointing.partition_activations" and on:
        return "approximated", "needs tensor parallelism: activations are checkpointed whole"
    if path == "fp16.fp16_master_weights_and_grads" and on:
        return "mapped", "PrecisionPlan.master_dtype=float16 (DeepSpeed: with CPU Adam only)"
    if path in ("fp16.enabled", "bf16.enabled", "torch_autocast.enabled") and not on:
        return "noop", "off"
    section = path.split(".", 1)[0]
    if section in ("fp16", "bf16") and "." in path and not getattr(cfg, section).enabled:
        return "noop", f"{section} is off"
    if path.startswith("zero_optimization."):
        leaf = path.split(".")[1]
        if leaf.startswith("stage3_") and z.stage != 3:
            return "noop", f"acts only at ZeRO stage 3 (stage is {z.stage})"
        if z.stage == 1 and leaf in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"):
            return "mapped", {"reduce_bucket_size": "ops stage-1 reduce-scatter bucket (elements)",
                              "allgather_bucket_size": "ops stage-1 post-step all-gather bucket (elements)",
                              "overlap_comm": "ops stage-1 reduce-scatters buckets from backward hooks "
                                              "as they fill"}[leaf]
        if leaf == "allgather_bucket_size" and z.stage != 1:
            return "noop", "FSDP2 all-gathers per wrapped block" if z.stage else "no sharding at stage 0"
        if leaf == "reduce_bucket_size" and z.stage >= 2:
            return "noop", "FSDP2 reduce-scatters per wrapped block (the unit replaces the bucket)"
        if leaf == "sub_group_size" and (z.offload_optimizer is None or z.offload_optimizer.device == "none"):
            return "noop", "only tiles the offloaded optimizer step"
        if leaf in ("offload_param", "offload_optimizer") and "." in path[len("zero_optimization."):]:
            dev = getattr(z, leaf).device if getattr(z, leaf) is not None else "none"
            nvme_only = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read",
                         "pipeline_write")
            if dev == "none" or (dev == "cpu" and path.rsplit(".", 1)[1] in nvme_only):
                return "noop", f"{leaf} device is {dev!r}"
    status, detail = FATES.get(path, UNKNOWN_FATE)
    if status == "unsupported" and (value is None or value is False or value == {}):
        return "noop", "not used"
    return status, detail
