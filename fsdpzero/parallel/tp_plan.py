"""Which Linear layers tensor parallelism shards, and how: DeepSpeed 0.19.8's AutoTP training rules, resolved against a
model before any process group exists (every error here is the same on every rank, and names the key and the fix).

DeepSpeed's priority (runtime/engine.py, _apply_autotp_partitioning): `partition_config` / `preset_model` (the first
matching layer spec per weight; unmatched layers stay whole), else the model's transformers plan (config
`base_model_tp_plan` merged with the class's `_tp_plan`, TPPlanConverter's styles), else its name heuristic, which
fsdpzero does not carry (an error asks for a plan). The result maps module names to one of STYLES.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from fsdpzero.config.autotp import LayerSpec, PartitionConfig, effective_partition_config, unsupported_specs

# column: the output features sharded (the output stays sharded for the next row layer);
# column_gather: the same, its output gathered whole (an untied LM head: "colwise_gather_output");
# row: the input features sharded, the output all-reduced.
STYLES = ("column", "column_gather", "row")
KEY = "tensor_parallel.autotp_size"
# transformers' tp_plan styles DeepSpeed 0.19.8 converts (tp_plan_converter.SUPPORTED_STYLES); others are its error
HF_STYLES = {"colwise": "column", "colwise_rep": "column_gather", "colwise_gather_output": "column_gather",
             "rowwise": "row", "embedding_rowwise": "skip", "replicated_with_grad_allreduce": None}


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """DeepSpeed's _get_hf_tp_plan: the config's base_model_tp_plan, the class's _tp_plan and the instance's, merged
    (a "model."-prefixed entry does not repeat one already there without the prefix)."""
    config = getattr(model, "config", None)
    plans = (getattr(config, "base_model_tp_plan", None) if config is not None else None,
             getattr(type(model), "_tp_plan", None), vars(model).get("_tp_plan"))
    merged: dict[str, str] = {}
    seen: set[str] = set()
    for plan in plans:
        if not isinstance(plan, dict):
            continue
        for pattern, style in plan.items():
            canonical = pattern[len("model."):] if pattern.startswith("model.") else pattern
            if pattern.startswith("model.") and canonical in seen:
                continue
            merged[pattern] = style
            seen.add(canonical)
    return merged


def _hf_specs(plan: dict[str, str], cls: str) -> PartitionConfig:
    """TPPlanConverter.convert: a wildcard pattern per entry, `.*` before it and `\\.weight$` after."""
    bad = sorted({s for s in plan.values() if s.lower() not in HF_STYLES})
    if bad:
        raise ValueError(f"{KEY}: {cls}'s transformers tp_plan has partition style(s) {bad} that DeepSpeed's AutoTP "
                         "does not convert either -> give tensor_parallel.partition_config for this model")
    specs = []
    for pattern, style in plan.items():
        kind = HF_STYLES[style.lower()]
        if kind is None:
            raise ValueError(f"{KEY}: {cls}'s transformers tp_plan asks 'replicated_with_grad_allreduce' for "
                             f"{pattern!r} (a whole weight whose gradient is summed over tp), which fsdpzero does not "
                             "implement -> give tensor_parallel.partition_config without those layers sharded")
        regex = ".*" + pattern.replace(".", r"\.").replace("*", ".*")
        regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
        specs.append(LayerSpec(patterns=(regex,), partition_type="skip" if kind == "skip" else
                               ("row" if kind == "row" else "column"), gather_output=kind == "column_gather"))
    return PartitionConfig(layer_specs=tuple(specs))


def _tied(model: nn.Module) -> set[int]:
    """ids of weights that more than one module holds (a tied embedding and LM head)."""
    count: dict[int, int] = {}
    for m in model.modules():
        w = m._parameters.get("weight")
        if w is not None:
            count[id(w)] = count.get(id(w), 0) + 1
    return {i for i, n in count.items() if n > 1}


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def resolve_tp_plan(model: nn.Module, tp, allow_meta: bool = False) -> dict[str, str]:
    """{module name: style in STYLES} for `tp` (a TensorParallelPlan); {} when tp.size is 1. Raises ValueError (one
    line naming the key, the value and the fix) for what cannot run: no plan, an unsupported spec, a plan that shards
    nothing, heads or features that do not divide over tp. allow_meta: a meta-device model only to count its shards
    (`fsdpzero estimate --tp`); training one is refused."""
    if tp.size <= 1:
        return {}
    if not allow_meta and any(p.is_meta for p in model.parameters()):
        raise ValueError(f"{KEY} = {tp.size}: the model was built on the meta device (zero.Init, HfDeepSpeedConfig); "
                         "tensor parallelism of such a model is not implemented -> build it on the CPU")
    cls = type(model).__name__
    config = effective_partition_config(tp.preset_model, tp.partition_config)
    source = ("tensor_parallel.partition_config" if tp.partition_config is not None else
              f"tensor_parallel.preset_model {tp.preset_model!r}")
    if config is None:
        plan = hf_tp_plan(model)
        if not plan:
            model_type = getattr(_text_config(model), "model_type", None)
            hint = (f'"preset_model": "{model_type}"' if model_type in ("llama", "qwen2", "mixtral", "bloom",
                                                                         "deepseek_v2") else '"partition_config"')
            raise ValueError(f"{KEY} = {tp.size}: {cls} has no transformers tp_plan and the config gives no "
                             "tensor_parallel.preset_model or partition_config (DeepSpeed would guess from layer "
                             f"names; fsdpzero does not) -> add {hint} to the tensor_parallel section")
        config, source = _hf_specs(plan, cls), f"{cls}'s transformers tp_plan"
    why = unsupported_specs(config)
    if why:
        raise ValueError(f"{source}: {why[0]} -> leave those layers out of the plan")
    model_type = getattr(_text_config(model), "model_type", None)
    tied = _tied(model)
    styles: dict[str, str] = {}
    unmatched = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if name else None
        if weight is None and isinstance(getattr(module, "base_layer", None), nn.Module):
            # a PEFT adapter layer (LoRA's lora.Linear): its Linear is `base_layer`, so the plan's pattern for this
            # name would miss it and leave it whole beside sharded neighbours (a shape error in attention)
            spec = config.find(f"{name}.weight", model_type)
            if spec is not None and spec.partition_type != "skip":
                raise ValueError(f"{KEY} = {tp.size}: {name} is wrapped by an adapter "
                                 f"({type(module).__module__}.{type(module).__name__}) "
                                 f"and {source} shards it; tensor parallelism of adapter-wrapped layers is not "
                                 f"implemented -> leave {name.rsplit('.', 1)[-1]} out of the adapter's "
                                 f"target_modules, or set {KEY} to 1")
            continue
        if weight is None or weight.dim() != 2:
            continue
        spec = config.find(f"{name}.weight", model_type)
        if spec is None:
            if isinstance(module, nn.Linear):
                unmatched.append(name)
            continue
        if spec.partition_type == "skip":
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{source}: {name} ({type(module).__name__}) matches a {spec.partition_type} spec; "
                             "fsdpzero shards nn.Linear layers only -> mark it \"skip\" or leave it out")
        if id(weight) in tied:
            continue   # a tied head stays whole, as DeepSpeed's gathered-column tie fallback keeps it
        if spec.partition_type == "row" and name.rsplit(".", 1)[-1] in config.lm_head_patterns:
            raise ValueError(f"{source}: the output head {name} as a row-parallel layer is not implemented -> "
                             "make it column with gather_output, or leave it out")
        styles[name] = "row" if spec.partition_type == "row" else ("column_gather" if spec.gather_output
                                                                  else "column")
    if config.strict_mode and unmatched:
        raise ValueError(f"{source}: strict_mode and no layer spec matches {unmatched[0]}.weight"
                         + (f" (and {len(unmatched) - 1} more)" if len(unmatched) > 1 else "")
                         + " -> add a spec for it or turn strict_mode off")
    if not styles:
        raise ValueError(f"{KEY} = {tp.size}: {source} matches no Linear layer of {cls} -> check its patterns "
                         "against the model's parameter names (model.named_parameters())")
    check_divisible(model, styles, tp.size, source)
    return styles


def check_divisible(model: nn.Module, styles: dict[str, str], size: int, source: str) -> None:
    """Every sharded feature dimension, and the attention heads of a sharded attention layer, split evenly over tp
    (DeepSpeed splits uneven head counts unevenly; DTensor's shards of one layer are equal)."""
    modules = dict(model.named_modules())
    cfg = _text_config(model)
    for name, style in styles.items():
        lin = modules[name]
        dim, what = (lin.in_features, "input") if style == "row" else (lin.out_features, "output")
        if dim % size:
            raise ValueError(f"{KEY} = {size}: {name} has {dim} {what} features, which do not split evenly over "
                             f"{size} tp ranks ({source}) -> use an autotp_size that divides {dim}")
        parent = modules.get(name.rpartition(".")[0])
        if parent is not None and "attention" in type(parent).__name__.lower():
            for attr in ("num_attention_heads", "num_key_value_heads"):
                heads = getattr(cfg, attr, None)
                if isinstance(heads, int) and heads % size:
                    raise ValueError(f"{KEY} = {size}: {type(model).__name__} has {heads} {attr.replace('_', ' ')} "
                                     f"({attr}), which do not split evenly over {size} tp ranks -> use an "
                                     f"autotp_size that divides {heads}")


def style_counts(styles: dict[str, str]) -> str:
    """e.g. "14 column, 1 column_gather, 4 row" for the startup log."""
    return ", ".join(f"{sum(1 for s in styles.values() if s == k)} {k}" for k in STYLES
                     if any(s == k for s in styles.values()))


__all__ = ["HF_STYLES", "STYLES", "check_divisible", "hf_tp_plan", "resolve_tp_plan", "style_counts"]
