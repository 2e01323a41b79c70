"""fp32 / bf16 / fp16 on FSDP2, the way DeepSpeed does it: fp32 master weights in the optimizer, low-precision
copies for compute, gradients reduced in `communication_data_type`, fp16 with DeepSpeed's dynamic loss scaler.

FSDP2 keeps the sharded parameters in their own dtype and casts the all-gathered copy to `param_dtype`, so fp32
masters mean: make the sharded parameters fp32 (upcast, loudly, if the model was loaded in 16 bits) and set
`MixedPrecisionPolicy(param_dtype=<16-bit>)`. Overflow detection uses the global gradient norm, which is already
all-reduced, so every rank reaches the same skip decision without an extra collective.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdpzero.plan import Plan

log = logging.getLogger("fsdpzero")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mp_policy(plan: Plan) -> MixedPrecisionPolicy:
    p = plan.precision
    param = DTYPES[p.param_dtype]
    master = DTYPES[p.master_dtype]
    reduce = DTYPES[p.reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=None if param == master else param,
                                reduce_dtype=None if reduce == param else reduce,
                                cast_forward_inputs=True)


def cast_forward_inputs(model: nn.Module, plan: Plan):
    """Stage 1 (no fully_shard root): cast the floating tensors among the model's forward args and kwargs to the
    compute dtype, as FSDP2's root does under mp_policy's cast_forward_inputs at stages 0/2/3, so fp32 images or
    embeddings meet fp16/bf16 weights (DeepSpeed's fp16.auto_cast casts the positional inputs the same way).
    Returns the hook handle, or None when the compute dtype is the master dtype (nothing to cast)."""
    dtype = mp_policy(plan).param_dtype
    if dtype is None:
        return None

    def cast(value):
        if isinstance(value, torch.Tensor):
            return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [cast(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    return model.register_forward_pre_hook(lambda _m, args, kwargs: (cast(args), cast(kwargs)), with_kwargs=True)


def upcast_to_master(model: nn.Module, plan: Plan) -> list[str]:
    """Cast trainable floating parameters to the master dtype (fp32 unless bf16_master_weights_and_grads); returns
    their names. DeepSpeed always optimises fp32 masters; an FSDP2 user who loads a bf16 model would otherwise train
    bf16 weights with a bf16 optimizer, the classic cause of "FSDP loss differs from DeepSpeed".
    Frozen parameters (a LoRA base model) get no master: they are kept in the compute dtype, as DeepSpeed casts the
    module, so a bf16 base stays 2 bytes a parameter and an fp32 adapter meets no dtype mismatch."""
    master = DTYPES[plan.precision.master_dtype]
    compute = DTYPES[plan.precision.param_dtype]
    upcast = []
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        want = master if p.requires_grad else compute
        if p.dtype != want:
            p.data = p.data.to(want)
            if p.requires_grad:
                upcast.append(name)
    if upcast:   # the formatter adds the [fsdpzero] prefix; the names are many on a real model: the first few
        shown = ", ".join(upcast[:5]) + (f", ... ({len(upcast) - 5} more)" if len(upcast) > 5 else "")
        log.warning("cast %d trainable parameters to %s master weights, as DeepSpeed keeps %s masters: %s",
                    len(upcast), plan.precision.master_dtype, plan.precision.master_dtype, shown)
    return upcast


def make_scaler(plan: Plan):
    """DeepSpeed's fp16 loss scaler (dynamic, or static when loss_scale > 0), or None without fp16."""
    if plan.precision.loss_scale is None:
        return None
    from fsdpzero.loss_scaler import make_loss_scaler
    return make_loss_scaler(plan.precision.loss_scale)


def checks_overflow(plan: Plan) -> bool:
    """Whether a step with inf/nan grads is skipped: fp16 always; bf16 when check_grad_overflow (DeepSpeed >= 0.19.3
    default); fp32 always, as DeepSpeed's ZeRO 1-3 optimizers do (its stage 0 writes the NaN into the weights: we
    skip there too, docs/deepspeed_differences.md)."""
    p = plan.precision
    return p.loss_scale is not None or p.check_grad_overflow or p.param_dtype != "bfloat16"


def autocast(plan: Plan, device_type: str):
    """The `torch_autocast` section: forward under torch.autocast with fp32 params."""
    dtype = plan.precision.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[dtype])
