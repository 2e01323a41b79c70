"""DeepSpeed's AutoTP layer specs as data (pure: no torch): `tensor_parallel.preset_model` and
`tensor_parallel.partition_config`, read and checked as DeepSpeed 0.19.8 reads them
(deepspeed/module_inject/autotp_config.py, runtime/tensor_parallel/config.py), and more strictly where DeepSpeed
silently ignores a typo (an unknown preset or key is an error here with a suggestion).

The specs match *parameter* names (`model.layers.0.self_attn.q_proj.weight`) with `re.match`; the first matching spec
decides; `column` shards a Linear's output features, `row` its input features, `skip` keeps it whole. Resolving them
against a model is fsdpzero/parallel/tp_plan.py's job.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

from fsdpzero.config.errors import ConfigError, Problem

PARTITION_TYPES = ("column", "row", "skip")
_SPEC_KEYS = ("patterns", "partition_type", "gather_output", "grad_allreduce", "shape", "partition_dim",
              "model_types")
_CONFIG_KEYS = ("layer_specs", "tp_size", "embedding_partition_dim", "lm_head_patterns", "use_default_specs",
                "strict_mode")


@dataclass(frozen=True)
class LayerSpec:
    patterns: tuple[str, ...]
    partition_type: str = "column"
    gather_output: bool = False
    grad_allreduce: bool = False
    shape: Any = None
    partition_dim: int | None = None
    model_types: tuple[str, ...] | None = None

    def matches(self, param_name: str, model_type: str | None) -> bool:
        if self.model_types:
            if model_type is None or str(model_type).lower() not in {t.lower() for t in self.model_types}:
                return False
        return any(re.match(p, param_name) for p in self.patterns)

    @property
    def reshaped(self) -> bool:
        """A fused or sub-parameter spec (shape, or a partition_dim other than the type's default)."""
        default = 0 if self.partition_type == "column" else 1
        return self.shape is not None or (self.partition_dim is not None and self.partition_dim != default)


@dataclass(frozen=True)
class PartitionConfig:
    layer_specs: tuple[LayerSpec, ...]
    lm_head_patterns: tuple[str, ...] = ("lm_head", "embed_out")
    use_default_specs: bool = True
    strict_mode: bool = False
    embedding_partition_dim: int = 1

    def find(self, param_name: str, model_type: str | None) -> LayerSpec | None:
        return next((s for s in self.layer_specs if s.matches(param_name, model_type)), None)


def _spec(patterns: list[str], kind: str, **kw) -> LayerSpec:
    return LayerSpec(patterns=tuple(patterns), partition_type=kind, **kw)


_ROW_O = _spec([r".*\.self_attn\.o_proj\.weight$"], "row")
_COL_QKV = _spec([r".*\.self_attn\.[qkv]_proj\.weight$"], "column")
_ROW_DOWN = _spec([r".*\.mlp\.down_proj\.weight$"], "row")
_COL_UPGATE = _spec([r".*\.mlp\.(up|gate)_proj\.weight$"], "column")

# DeepSpeed 0.19.8's AutoTPPresets.get_preset names, spec for spec
PRESETS: dict[str, tuple[LayerSpec, ...]] = {
    "llama": (_ROW_O, _COL_QKV, _ROW_DOWN, _COL_UPGATE),
    "bloom": (_spec([r".*\.self_attention\.dense\.weight$"], "row"),
              _spec([r".*\.self_attention\.query_key_value\.weight$"], "column"),
              _spec([r".*\.mlp\.dense_4h_to_h\.weight$"], "row"),
              _spec([r".*\.mlp\.dense_h_to_4h\.weight$"], "column")),
    "chatglm": (_spec([r".*\.self_attention\.dense\.weight$"], "row"),
                _spec([r".*\.self_attention\.query_key_value\.weight$"], "column", shape=(3, -1), partition_dim=0),
                _spec([r".*\.mlp\.dense_4h_to_h\.weight$"], "row"),
                _spec([r".*\.mlp\.dense_h_to_4h\.weight$"], "column", shape=(2, -1), partition_dim=0)),
    "mixtral": (_ROW_O, _COL_QKV,
                _spec([r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"], "row"),
                _spec([r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"], "column"),
                _spec([r".*\.block_sparse_moe\.gate\.weight$"], "skip")),
    "deepseek_v2": (_ROW_O,
                    _spec([r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"], "skip"),
                    _spec([r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"], "column"),
                    _spec([r".*\.mlp\.experts\.\d+\.down_proj\.weight$"], "row"),
                    _spec([r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$"], "column"),
                    _spec([r".*\.mlp\.gate\.weight$"], "skip"),
                    _spec([r".*\.mlp\.shared_experts\.down_proj\.weight$"], "row"),
                    _spec([r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$"], "column")),
    "qwen2": (_ROW_O, _COL_QKV, _ROW_DOWN, _COL_UPGATE),
    "phi3": (_ROW_O,
             _spec([r".*\.self_attn\.qkv_proj\.weight$"], "column", shape=(3, -1), partition_dim=0),
             _ROW_DOWN,
             _spec([r".*\.mlp\.gate_up_proj\.weight$"], "column", shape=(2, -1), partition_dim=0)),
}


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {close[0]!r}?" if close else "use one of " + ", ".join(map(repr, choices))


def check_preset(name: str | None, key: str = "tensor_parallel.preset_model") -> None:
    """DeepSpeed ignores an unknown preset (get_preset returns None and the model's HF plan is used instead)."""
    if name is not None and name.lower() not in PRESETS:
        raise ConfigError(Problem(key, f"{name!r} is not one of DeepSpeed's AutoTP presets", _suggest(name.lower(),
                                                                                                      PRESETS)))


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(Problem(key, f"{value!r} is not a boolean", "use true or false"))
    return value


def _strings(value: Any, key: str, regex: bool = False) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(Problem(key, f"{value!r} is not a list of strings", 'use a JSON list, e.g. [".*\\\\.o_proj'
                                                                             '\\\\.weight$"]'))
    if regex:
        for v in value:
            try:
                re.compile(v)
            except re.error as e:
                raise ConfigError(Problem(key, f"{v!r} is not a regular expression ({e})",
                                          "escape dots as \\\\. and check the brackets")) from None
    return tuple(value)


def _shape(value: Any, key: str) -> Any:
    def conv(v):
        return tuple(conv(x) for x in v) if isinstance(v, list) else v
    if value is None:
        return None
    if not isinstance(value, list):
        raise ConfigError(Problem(key, f"{value!r} is not a list", "e.g. [3, -1]"))
    return conv(value)


def parse_partition_config(raw: Any, key: str = "tensor_parallel.partition_config") -> PartitionConfig:
    """DeepSpeed's AutoTPConfig.from_dict, with each key and value checked (DeepSpeed reads them with .get: a typo
    such as "layer_spec" is silently an empty spec list there)."""
    if not isinstance(raw, dict):
        raise ConfigError(Problem(key, f"{raw!r} is not an object", 'use {"layer_specs": [...]}'))
    for k in raw:
        if k not in _CONFIG_KEYS:
            raise ConfigError(Problem(f"{key}.{k}", "unknown AutoTP partition_config key", _suggest(k, _CONFIG_KEYS)))
    specs_raw = raw.get("layer_specs", [])
    if not isinstance(specs_raw, list):
        raise ConfigError(Problem(f"{key}.layer_specs", f"{specs_raw!r} is not a list", "a list of layer specs"))
    specs = []
    for i, s in enumerate(specs_raw):
        at = f"{key}.layer_specs[{i}]"
        if not isinstance(s, dict):
            raise ConfigError(Problem(at, f"{s!r} is not an object", '{"patterns": [...], "partition_type": "row"}'))
        for k in s:
            if k not in _SPEC_KEYS:
                raise ConfigError(Problem(f"{at}.{k}", "unknown AutoTP layer spec key", _suggest(k, _SPEC_KEYS)))
        kind = s.get("partition_type", "column")
        if not isinstance(kind, str) or kind.lower() not in PARTITION_TYPES:
            raise ConfigError(Problem(f"{at}.partition_type", f"{kind!r} is not a partition type",
                                      "use " + ", ".join(PARTITION_TYPES)))
        dim = s.get("partition_dim")
        if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim < 0):
            raise ConfigError(Problem(f"{at}.partition_dim", f"{dim!r} is not a dimension index", "use 0 or 1"))
        types = s.get("model_types")
        specs.append(LayerSpec(patterns=_strings(s.get("patterns", []), f"{at}.patterns", regex=True),
                               partition_type=kind.lower(),
                               gather_output=_bool(s.get("gather_output", False), f"{at}.gather_output"),
                               grad_allreduce=_bool(s.get("grad_allreduce", False), f"{at}.grad_allreduce"),
                               shape=_shape(s.get("shape"), f"{at}.shape"), partition_dim=dim,
                               model_types=None if types is None else _strings(types, f"{at}.model_types")))
    return PartitionConfig(layer_specs=tuple(specs),
                           lm_head_patterns=_strings(raw.get("lm_head_patterns", ["lm_head", "embed_out"]),
                                                     f"{key}.lm_head_patterns"),
                           use_default_specs=_bool(raw.get("use_default_specs", True), f"{key}.use_default_specs"),
                           strict_mode=_bool(raw.get("strict_mode", False), f"{key}.strict_mode"),
                           embedding_partition_dim=raw.get("embedding_partition_dim", 1))


def effective_partition_config(preset: str | None, partition_config: dict | None) -> PartitionConfig | None:
    """DeepSpeed's TPTrainingConfig.get_partition_config_object: the preset's specs; a partition_config replaces
    them, or (use_default_specs, the default, with a preset) goes before them. None: neither is given (the model's
    own HF tp_plan decides)."""
    check_preset(preset)
    config = PartitionConfig(layer_specs=PRESETS[preset.lower()]) if preset else None
    if partition_config is not None:
        custom = parse_partition_config(partition_config)
        if config is not None and custom.use_default_specs:
            config = PartitionConfig(layer_specs=custom.layer_specs + config.layer_specs,
                                     lm_head_patterns=custom.lm_head_patterns or config.lm_head_patterns,
                                     use_default_specs=True, strict_mode=custom.strict_mode,
                                     embedding_partition_dim=custom.embedding_partition_dim)
        else:
            config = custom
    return config


def unsupported_specs(config: PartitionConfig | None) -> list[str]:
    """Why each spec of `config` fsdpzero cannot run, as text (empty: all can): fused / sub-parameter shapes and
    grad_allreduce (a replicated weight whose gradient is summed over tp) are not implemented."""
    out = []
    for s in (config.layer_specs if config else ()):
        if s.reshaped:
            out.append(f"{list(s.patterns)}: shape/partition_dim (fused or sub-parameter sharding) is not implemented")
        if s.grad_allreduce:
            out.append(f"{list(s.patterns)}: grad_allreduce (a replicated weight whose gradient is summed over tp) "
                       "is not implemented")
    return out


__all__ = ["LayerSpec", "PARTITION_TYPES", "PRESETS", "PartitionConfig", "check_preset", "effective_partition_config",
           "parse_partition_config", "unsupported_specs"]
