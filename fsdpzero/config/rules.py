"""Cross-field checks: what DeepSpeed asserts at config time or at initialize(), plus the few that fsdpzero
adds because DeepSpeed would silently ignore a setting (offload_param below stage 3, NVMe without a path)."""
from __future__ import annotations

import math
from typing import Any, Mapping

from fsdpzero.config.errors import Problem, did_you_mean
from fsdpzero.config.schema import DSConfig

DS_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
# DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS, by the config type that builds them (FusedLamb and torch SGD are not in it)
ZERO_TESTED = ("adam", "adamw", "adagrad", "lion", "muon")
ONEBIT_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
TORCH_OPTIMIZERS = ("Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "ASGD", "LBFGS", "NAdam",
                    "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam", "Muon")
# kwargs each DeepSpeed optimizer accepts (FusedAdam / DeepSpeedCPUAdam / torch Adam(W) together for Adam)
OPTIMIZER_PARAMS = {
    "adam": {"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam",
             "fp32_optimizer_states", "foreach", "set_grad_none", "maximize", "capturable", "differentiable", "fused"},
    "lamb": {"lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_coeff", "min_coeff",
             "amsgrad"},
    "lion": {"lr", "betas", "weight_decay", "fp32_optimizer_states"},
    "adagrad": {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "foreach", "maximize",
                "differentiable", "fused", "fp32_optimizer_states"},
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "differentiable",
            "fused"},
}
OPTIMIZER_PARAMS["adamw"] = OPTIMIZER_PARAMS["adam"]

# DeepSpeed's schedulers: kwarg -> default ("required" when it has none)
REQUIRED = "required"
SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "OneCycle": {"cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0,
                 "cycle_first_step_size": 2000, "cycle_second_step_size": None, "cycle_first_stair_count": 0,
                 "cycle_second_stair_count": None, "decay_step_size": 0, "cycle_momentum": True,
                 "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False},
}
TORCH_SCHEDULERS = ("LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
                    "ExponentialLR", "SequentialLR", "CosineAnnealingLR", "ChainedScheduler", "ReduceLROnPlateau",
                    "CyclicLR", "CosineAnnealingWarmRestarts", "OneCycleLR", "PolynomialLR")


def optimizer_kind(name: str | None) -> str:
    """'ds' (DeepSpeed's own, matched case-insensitively), 'onebit', 'torch', or 'unknown'."""
    if name is None:
        return "none"
    if name.lower() in DS_OPTIMIZERS:
        return "ds"
    if name.lower() in ONEBIT_OPTIMIZERS:
        return "onebit"
    return "torch" if name in TORCH_OPTIMIZERS else "unknown"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    return _is_number(v) and math.isfinite(v)


def check(cfg: DSConfig, raw: dict, deferred: list[str]) -> list[Problem]:
    out: list[Problem] = []
    z = cfg.zero_optimization
    if cfg.fp16.enabled and cfg.bf16.enabled:
        out.append(Problem("bf16.enabled", "bfloat16 and fp16 modes cannot be simultaneously enabled",
                           "enable only one of fp16.enabled / bf16.enabled"))
    for name, off in (("offload_param", z.offload_param), ("offload_optimizer", z.offload_optimizer)):
        if off is not None and off.device == "nvme" and not off.nvme_path:
            out.append(Problem(f"zero_optimization.{name}.nvme_path", 'device "nvme" needs an nvme_path',
                               f"set zero_optimization.{name}.nvme_path to a directory on the NVMe drive"))
    op = z.offload_param
    if op is not None and op.device == "nvme":
        for knob, why in (("buffer_count", "units of parameters swapped in at once (the one in use + prefetch)"),
                          ("buffer_size", "elements of the largest FSDP unit's shard"),
                          ("max_in_cpu", "parameter elements kept in CPU memory")):
            if getattr(op, knob) < 1:
                out.append(Problem(f"zero_optimization.offload_param.{knob}", f"= {getattr(op, knob)}: the NVMe "
                                   f"parameter swapper needs at least 1 ({why})",
                                   f"set zero_optimization.offload_param.{knob} >= 1 (DeepSpeed's default: "
                                   f"{type(op).model_fields[knob].default})"))
    if z.offload_param is not None and z.offload_param.device != "none" and z.stage != 3:
        out.append(Problem("zero_optimization.offload_param", f"parameter offload needs ZeRO stage 3 (stage is "
                           f"{z.stage}); DeepSpeed would silently ignore it",
                           "set zero_optimization.stage to 3, or remove offload_param (offload_optimizer works "
                           "with stages 1-3)"))
    if z.offload_optimizer is not None and z.offload_optimizer.device != "none" and z.stage == 0:
        out.append(Problem("zero_optimization.offload_optimizer", "optimizer offload needs ZeRO stage 1, 2 or 3 "
                           "(stage is 0); DeepSpeed would silently ignore it",
                           "set zero_optimization.stage to 1-3, or remove offload_optimizer"))
    if z.offload_optimizer is not None and z.offload_optimizer.device != "none" and z.offload_optimizer.ratio < 1.0 \
            and z.stage not in (2, 3):
        # DeepSpeed 0.19.8 asserts "Partial offloading only supported for ZeRO Stage 3."; fsdpzero's offload path
        # is the same for stages 2 and 3, stage 1 offloads through its own optimizer (fsdpzero_ops.stage1)
        out.append(Problem("zero_optimization.offload_optimizer.ratio",
                           f"Partial offloading (ratio {z.offload_optimizer.ratio}) needs ZeRO stage 2 or 3 "
                           f"(stage is {z.stage}; DeepSpeed: stage 3 only)",
                           "set zero_optimization.stage to 2 or 3, or ratio to 1.0"))
    for flag, owner in (("fp16_master_weights_and_grads", cfg.fp16), ("bf16_master_weights_and_grads", cfg.bf16),
                        ("bf16_optimizer_states", cfg.bf16)):
        if getattr(owner, flag, False) and z.stage == 0:
            sec = "fp16" if owner is cfg.fp16 else "bf16"
            out.append(Problem(f"{sec}.{flag}", "is only supported with ZeRO stage 1, 2 or 3",
                               "set zero_optimization.stage to 1-3 or remove the flag"))
    if cfg.bf16.bf16_optimizer_states and not cfg.bf16.bf16_master_weights_and_grads:
        out.append(Problem("bf16.bf16_optimizer_states", "requires bf16_master_weights_and_grads to be enabled",
                           "set bf16.bf16_master_weights_and_grads to true"))
    if cfg.gradient_allreduce_op == "sum":
        for bad, why in ((z.stage == 3, "ZeRO stage 3"), (z.zenflow is not None, "ZenFlow"),
                         (cfg.compile is not None and cfg.compile.deepcompile, "DeepCompile")):
            if bad:
                out.append(Problem("gradient_allreduce_op", f"'sum' is not supported with {why}",
                                   'use "mean" (the default)'))
    opt = cfg.optimizer.type if cfg.optimizer else None
    if opt and z.stage >= 1 and not cfg.zero_allow_untested_optimizer and opt.lower() not in ZERO_TESTED \
            and optimizer_kind(opt) != "onebit":
        out.append(Problem("zero_allow_untested_optimizer", f"optimizer {opt!r} is not one DeepSpeed tests with ZeRO "
                           "(DeepSpeed asserts at initialize: 'You are using an untested ZeRO Optimizer')",
                           'add "zero_allow_untested_optimizer": true to run it anyway'))
    if z.zero_hpz_partition_size > 1 and z.mics_shard_size > 0:
        out.append(Problem("zero_optimization.zero_hpz_partition_size", "hpZ and MiCS cannot be combined",
                           "keep one of zero_hpz_partition_size / mics_shard_size"))
    return out


def check_sections(raw: dict, deferred: list[str]) -> list[Problem]:
    """Optimizer and scheduler kwargs, checked on the raw dicts so they are reported even when other sections
    fail validation."""
    def usable(section):        # malformed sections are reported by the schema instead
        return isinstance(section, dict) and isinstance(section.get("params", {}), dict) \
            and isinstance(section.get("type"), (str, type(None)))
    opt, sch = raw.get("optimizer"), raw.get("scheduler")
    out = []
    if usable(opt):
        out += _check_optimizer(opt.get("type"), opt.get("params") or {})
    if usable(sch):
        out += _check_scheduler(sch.get("type"), sch.get("params") or {}, deferred)
    return out


def _check_optimizer(name: str | None, params: dict) -> list[Problem]:
    out = []
    kind = optimizer_kind(name)
    if name is not None and kind == "unknown":
        out.append(Problem("optimizer.type", f"{name!r} is neither a DeepSpeed optimizer nor a torch.optim class",
                           did_you_mean(name, list(DS_OPTIMIZERS) + list(TORCH_OPTIMIZERS), 0.6)
                           or "use Adam, AdamW, Lamb, Lion, Adagrad or a torch.optim class name"))
    if "max_grad_norm" in params:
        out.append(Problem("optimizer.params.max_grad_norm", "is not supported as an optimizer parameter "
                           "(DeepSpeed raises at initialize)", "use the top-level `gradient_clipping` instead"))
    allowed = OPTIMIZER_PARAMS.get((name or "").lower()) if kind in ("ds", "torch") else None
    for key in params:
        if allowed is not None and key not in allowed and key != "max_grad_norm":
            out.append(Problem(f"optimizer.params.{key}", f"is not a keyword of the {name} optimizer "
                               "(DeepSpeed passes params as kwargs: TypeError at initialize)",
                               did_you_mean(key, allowed) or f"valid: {', '.join(sorted(allowed))}"))
    p = params
    if "lr" in p and not (_finite(p["lr"]) and p["lr"] >= 0):
        out.append(Problem("optimizer.params.lr", f"must be a finite number >= 0, got {p['lr']!r}", "e.g. 1e-4"))
    if "betas" in p and not (isinstance(p["betas"], (list, tuple)) and len(p["betas"]) == 2
                             and all(_finite(b) and 0 <= b < 1 for b in p["betas"])):
        out.append(Problem("optimizer.params.betas", f"must be two numbers in [0, 1), got {p['betas']!r}",
                           "e.g. [0.9, 0.999]"))
    if "eps" in p and not (_finite(p["eps"]) and p["eps"] > 0):
        out.append(Problem("optimizer.params.eps", f"must be a finite number > 0, got {p['eps']!r} (0 divides "
                           "by zero where a second moment is 0)", "e.g. 1e-8"))
    if "weight_decay" in p and not (_finite(p["weight_decay"]) and p["weight_decay"] >= 0):
        out.append(Problem("optimizer.params.weight_decay", f"must be a finite number >= 0, got "
                           f"{p['weight_decay']!r}", "e.g. 0.01"))
    for key, value in p.items():               # any other number reaches the update: NaN/inf poisons the weights
        if key not in ("lr", "betas", "eps", "weight_decay") and isinstance(value, float) \
                and not math.isfinite(value):
            out.append(Problem(f"optimizer.params.{key}", f"must be a finite number, got {value!r}",
                               "write a finite value"))
    return out


def _check_scheduler(name: str | None, params: dict, deferred: list[str]) -> list[Problem]:
    if name is None:
        return []
    if name not in SCHEDULERS:
        if name in TORCH_SCHEDULERS:
            return []
        return [Problem("scheduler.type", f"{name!r} is neither a DeepSpeed scheduler nor a "
                        "torch.optim.lr_scheduler class", did_you_mean(name, list(SCHEDULERS) +
                                                                       list(TORCH_SCHEDULERS), 0.6)
                        or f"use one of {', '.join(SCHEDULERS)}")]
    spec = SCHEDULERS[name]
    out = []
    for key, value in params.items():
        path = f"scheduler.params.{key}"
        if key not in spec:
            out.append(Problem(path, f"is not a parameter of {name} (TypeError in DeepSpeed)",
                               did_you_mean(key, spec) or f"valid: {', '.join(spec)}"))
        elif key == "warmup_type":
            if value not in ("log", "linear"):
                out.append(Problem(path, f"must be 'log' or 'linear', got {value!r}", "DeepSpeed's default: 'log'"))
        elif key in ("lr_range_test_staircase", "cycle_momentum"):
            if not isinstance(value, bool):
                out.append(Problem(path, f"must be true or false, got {value!r}", ""))
        elif key.endswith(("num_steps", "step_size", "stair_count")):
            if value is None and spec[key] is None:
                continue
            ok = isinstance(value, int) and not isinstance(value, bool) or (
                isinstance(value, float) and value.is_integer())
            # DeepSpeed raises on these at 0 when the scheduler is built (lr_schedules.py), after the process group
            positive = key in ("warmup_num_steps", "total_num_steps", "lr_range_test_step_size",
                               "cycle_first_step_size")
            if not ok or value < (1 if positive else 0):
                floor = 1 if positive else 0
                out.append(Problem(path, f"must be a {'positive' if positive else 'non-negative'} integer, "
                                   f"got {value!r}", f"use an integer >= {floor}" + (
                                       f" (DeepSpeed's default: {spec[key]!r})"
                                       if spec[key] not in (REQUIRED, None) else "")))
        elif not (_finite(value) or (value is None and spec[key] is None)):
            out.append(Problem(path, f"must be a finite number, got {value!r}",
                               f"DeepSpeed's default: {spec[key]!r}" if spec[key] != REQUIRED else ""))
    for key, default in spec.items():
        if default == REQUIRED and key not in params and key not in deferred:
            out.append(Problem(f"scheduler.params.{key}", f"is required by {name}",
                               f"set scheduler.params.{key}" + (' (or "auto" with max_steps known)'
                                                                if key == "total_num_steps" else "")))
    return out


def canonical_optimizer(name: str | None, params: Mapping[str, Any]) -> str | None:
    """DeepSpeed's optimizer name as the plan spells it: "adamw"/"adam" per adam_w_mode, DeepSpeed's own lower-cased,
    a torch.optim class name kept exact."""
    if name is None:
        return None
    low = name.lower()
    if low == "adamw":
        return "adamw"                          # DeepSpeed: "AdamW" is AdamW whatever adam_w_mode says
    if low == "adam":
        return "adamw" if params.get("adam_w_mode", True) else "adam"
    if optimizer_kind(name) == "ds" or name in ("SGD", "Adagrad"):
        return low
    return name                                 # a torch.optim class name, kept exact
