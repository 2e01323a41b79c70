"""The `deepspeed.*` submodules accelerate reaches for, under `fsdpzero launch` (see fsdpzero/compat/shim.py):
`deepspeed.runtime.lr_schedules`, `deepspeed.runtime.utils`, `deepspeed.checkpoint.utils`, `deepspeed.ops.adam`,
`deepspeed.utils`. Each name is what accelerate 1.x calls (accelerator.py `_prepare_deepspeed` / `get_state_dict`,
utils/deepspeed.py `map_pytorch_optim_to_deepspeed`; the ALST example's `move_to_device`), run by fsdpzero."""
from __future__ import annotations

from typing import Any

import torch

# deepspeed.runtime.lr_schedules: the scheduler names accelerate hands to deepspeed.initialize as they are
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


def move_to_device(item: Any, device, criterion_func=None) -> Any:
    """deepspeed.runtime.utils.move_to_device (accelerate's ALST example moves each batch with it): tensors in
    (nested) lists, tuples and dicts to `device`; with `criterion_func`, only the tensors it accepts, in place."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """deepspeed.checkpoint.utils.clone_tensors_for_torch_save: a copy of a (nested) state dict on `device`. A
    sharded DTensor entry (fsdpzero's stages 2 and 3) becomes the whole tensor: collective, every rank calls it,
    as accelerate's get_state_dict / save_model do."""
    from fsdpzero.checkpoint.export import full_tensor
    if torch.is_tensor(item):
        return full_tensor(item).detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item


def DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                     amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
    """deepspeed.ops.adam.DeepSpeedCPUAdam: what accelerate swaps a torch Adam/AdamW for when the optimizer is
    offloaded. fsdpzero's fused CPU Adam (fsdpzero_ops.CPUAdam) over the same groups; like DeepSpeed's, one
    `adamw_mode` holds for every group (a torch group's own `decoupled_weight_decay` is overridden)."""
    from fsdpzero_ops import CPUAdam
    if not fp32_optimizer_states:
        raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): fsdpzero keeps the CPU Adam moments in "
                         "fp32; drop the argument")
    groups = list(model_params)
    for g in groups:
        if isinstance(g, dict):   # torch's group dicts, kept (as DeepSpeed's optimizer keeps them): a scheduler
            g["decoupled_weight_decay"] = adamw_mode   # on the torch optimizer still sets their lr
            amsgrad = amsgrad or bool(g.pop("amsgrad", False))
    return CPUAdam(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                   bias_correction=bias_correction, amsgrad=amsgrad)


def set_z3_leaf_modules(model, leaf_module_classes):
    """deepspeed.utils.set_z3_leaf_modules (accelerate calls it for `transformer_moe_cls_names`): refused, as
    fsdpzero shards by transformer block, not by ZeRO-3 leaf module."""
    raise ValueError("DeepSpeedPlugin(transformer_moe_cls_names=...) / ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES: "
                     "ZeRO-3 leaf modules are not supported by fsdpzero (its units are the transformer blocks); "
                     "remove the setting")
