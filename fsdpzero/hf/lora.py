"""PEFT models on the engine: the adapter-only save that transformers' Trainer writes for a PeftModel, and a merged
save of the full weights (base + LoRA delta), streamed like save_16bit_model so rank 0 never holds the model."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def save_adapters(model: nn.Module, output_dir: str | Path, dtype: torch.dtype, should_save: bool) -> None:
    """The trainable (adapter) weights, gathered in `dtype`, written by PEFT's own save_pretrained
    (adapter_model.safetensors + adapter_config.json, which PeftModel.from_pretrained loads). Collective; adapters
    are small, so rank 0 holds them."""
    from fsdpzero.checkpoint.export import full_tensor
    adapters = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = full_tensor(p).detach()
            adapters[name] = full.to("cpu", dtype if full.is_floating_point() else full.dtype)
    if should_save:
        model.save_pretrained(output_dir, state_dict=adapters, safe_serialization=True)
    if dist.is_initialized():
        dist.barrier()


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """FQN of each LoRA-wrapped base weight -> its LoRA layer; refuses what a plain merge cannot express."""
    from peft.tuners.lora import LoraLayer
    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        active = [a for a in module.active_adapters if a in module.lora_A]
        if getattr(module, "use_dora", {}) and any(module.use_dora.get(a) for a in active):
            raise NotImplementedError(f"{name}: DoRA adapters are not merged here; load the adapter with PEFT and "
                                      "call merge_and_unload()")
        if not isinstance(module.base_layer, nn.Linear):
            raise NotImplementedError(f"{name}: only LoRA on nn.Linear is merged here (found "
                                      f"{type(module.base_layer).__name__}); use PEFT's merge_and_unload()")
        layers[f"{name}.base_layer.weight"] = module
    return layers


def merged_name(name: str, active: tuple[str, ...] = ("default",)) -> str | None:
    """PeftModel parameter name -> the name merge_and_unload() + save_pretrained() give it; None for what the merged
    model does not keep (the original of a modules_to_save module, its inactive copies)."""
    name = name.removeprefix("base_model.model.")
    if ".original_module." in name:
        return None
    if ".modules_to_save." in name:
        head, _, rest = name.partition(".modules_to_save.")
        adapter, _, tail = rest.partition(".")
        return f"{head}.{tail}" if adapter in active else None
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def save_merged_model(model: nn.Module, output_dir: str | Path, *, dtype: torch.dtype | None,
                      max_shard_size: int | str = "5GB", param_swapper=None) -> Path | None:
    """Full weights of a (sharded) PeftModel with its active LoRA adapters merged in, as a from_pretrained folder of
    the base model: W + scaling * B @ A for every LoRA Linear, the other weights as they are, no adapter weights.
    One weight at a time is gathered on every rank and written by rank 0. Collective. Returns output_dir on rank 0."""
    from fsdpzero.checkpoint.export import full_tensor, write_sharded
    lora = _lora_layers(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    active = tuple(getattr(model, "active_adapters", None) or ("default",))
    seen: set[int] = set()
    names = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or ".lora_" in name or merged_name(name, active) is None:
            continue                   # tied weights once (transformers re-ties on load); adapters merge in
        seen.add(id(p))
        names.append((name, p))
    params = dict(names)
    specs = [(merged_name(n, active), dtype if dtype is not None and p.is_floating_point() else p.dtype,
              tuple(p.shape)) for n, p in names]
    by_merged = {merged_name(n, active): n for n, _ in names}

    def lazy():   # offload_param nvme: the swapped units stay on disk; their shards are read from the swap files
        return param_swapper.lazy() if param_swapper is not None else contextlib.nullcontext()

    def full(t):
        return full_tensor(t, param_swapper).float()

    def gathered(out_names):
        for out in out_names:
            name = by_merged[out]
            with lazy():
                weight = full(params[name])
                layer = lora.get(name)
                deltas = [] if layer is None else [
                    (full(layer.lora_B[a].weight) @ full(layer.lora_A[a].weight), layer.scaling[a])
                    for a in layer.active_adapters if a in layer.lora_A]
            for delta, scaling in deltas:
                weight = weight + (delta.T if layer.fan_in_fan_out else delta) * scaling
            out_dtype = dtype if dtype is not None and weight.is_floating_point() else params[name].dtype
            yield weight.to(out_dtype).cpu() if rank == 0 else None

    if rank == 0:
        write_sharded(output_dir, specs, gathered, max_shard_size=max_shard_size)
        base = model.get_base_model()
        base.config.save_pretrained(output_dir)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(output_dir)
    else:
        for _ in gathered([s[0] for s in specs]):
            pass
    if dist.is_initialized():
        dist.barrier()
    return Path(output_dir) if rank == 0 else None
