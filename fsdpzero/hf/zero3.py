"""`HfDeepSpeedConfig` on fsdpzero: the Trainer-less ZeRO-3 loading of the Hugging Face DeepSpeed guide.

    dschf = HfDeepSpeedConfig(ds_config)        # keep this object alive
    model = AutoModelForSeq2SeqLM.from_pretrained(name)            # no full copy on any rank
    engine = fsdpzero.initialize(model=model, config_params=ds_config)[0]

While an `HfDeepSpeedConfig` whose config is ZeRO stage 3 is alive, `from_pretrained` of any transformers model
builds it on the meta device (shapes, config, generation config, tied weights; no weights) and marks it so that
`initialize`/`wrap` shards it per the config and then has each rank read only its rows of each tensor from the
safetensors files (`fsdpzero.hf.load_sharded_safetensors`). Host memory per rank: ~1/N of the checkpoint.

How: `PreTrainedModel.from_pretrained` (a classmethod every transformers model and Auto class reaches) is wrapped
once, when the first HfDeepSpeedConfig is made, and the wrapper routes here only while a live stage-3 config exists
(found through a weak reference, as transformers finds its own); otherwise it calls transformers' own. transformers'
DeepSpeed path (`is_deepspeed_zero3_enabled`) stays off, so DeepSpeed is never imported. The wrapper is removed
when the last HfDeepSpeedConfig is collected.

Checkpoint keys are renamed and tensors converted as transformers' from_pretrained does (its conversion mapping:
Mixtral's and Qwen-MoE's per-expert weights fused into one tensor, legacy names, the base model's prefix), by
load_converted_safetensors.

Limits: safetensors checkpoints only (a local folder, or a Hub id fetched with huggingface_hub's snapshot_download);
no device_map, quantisation, tensor-parallel plans or custom positional model arguments (refused with the
argument's name); the model computes only after initialize (its parameters are meta until then).
"""
from __future__ import annotations

import copy
import functools
import os
import weakref
from pathlib import Path
from typing import Any

import transformers
from torch import nn

from fsdpzero.config.load import read_source
from fsdpzero.zero import defer_weights

_live: weakref.ref | None = None
_original: Any = None         # transformers' from_pretrained (the classmethod object) while ours is installed

# transformers' from_pretrained arguments that only locate files (passed to the config and to the download)
_HUB_KEYS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder",
             "trust_remote_code", "resume_download", "use_auth_token", "_from_auto", "_from_pipeline", "_commit_hash")
# ... that change nothing here (weights always come from safetensors, a shard at a time)
_IGNORED_KEYS = ("low_cpu_mem_usage", "use_safetensors", "weights_only", "variant")
# ... that this path cannot honour (ignore_mismatched_sizes=True: a mismatched tensor is an error naming it, shapes
# are compared as transformers does; re-initialising it instead is not done here)
_REFUSED_KEYS = ("device_map", "quantization_config", "load_in_8bit", "load_in_4bit", "tp_plan", "tp_size",
                 "device_mesh", "gguf_file", "from_tf", "from_flax", "state_dict", "max_memory", "offload_folder",
                 "key_mapping", "ignore_mismatched_sizes")


class HfDeepSpeedConfig:
    """`transformers.integrations.HfDeepSpeedConfig(config_file_or_dict)`: a dict, a path or JSON/base64 text.
    Keep the object alive (a module-level variable) from before `from_pretrained` until after `initialize`."""

    def __init__(self, config_file_or_dict: Any):
        global _live
        self.config = copy.deepcopy(read_source(config_file_or_dict))
        self._stage = self.get_value("zero_optimization.stage", -1)
        devices = {self.get_value("zero_optimization.offload_optimizer.device"),
                   self.get_value("zero_optimization.offload_param.device")}
        self._offload = self._stage in (2, 3) and bool(devices & {"cpu", "nvme"})
        _live = weakref.ref(self)
        _install()
        weakref.finalize(self, _release)

    def find_config_node(self, ds_key_long: str):
        config = self.config
        nodes = ds_key_long.split(".")
        key = nodes.pop()
        for node in nodes:
            config = config.get(node)
            if config is None:
                return None, key
        return config, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        config, key = self.find_config_node(ds_key_long)
        return default if config is None else config.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        config, parent = self.config, None
        nodes = ds_key_long.split(".")
        for node in nodes:
            parent, config = config, config.get(node)
            if config is None:
                if must_exist:
                    raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
                return
        if parent is not None:
            parent.pop(nodes[-1])

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload


def live_config() -> HfDeepSpeedConfig | None:
    return _live() if _live is not None else None


def is_deepspeed_zero3_enabled() -> bool:
    """transformers' function of the same name, for fsdpzero's HfDeepSpeedConfig."""
    config = live_config()
    return config is not None and config.is_zero3()


def deepspeed_config() -> dict | None:
    config = live_config()
    return config.config if config is not None else None


def routing_installed() -> bool:
    """Whether transformers' from_pretrained is wrapped (some HfDeepSpeedConfig is, or was until collected, alive)."""
    return _original is not None


def _install() -> None:
    global _original
    if _original is not None:
        return
    original = transformers.PreTrainedModel.__dict__["from_pretrained"]

    @functools.wraps(original.__func__)
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if is_deepspeed_zero3_enabled():
            return sharded_from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        return original.__func__(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    _original = original
    transformers.PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _release() -> None:
    """The last HfDeepSpeedConfig is gone: transformers' own from_pretrained again."""
    global _original
    if live_config() is None and _original is not None:
        transformers.PreTrainedModel.from_pretrained = _original
        _original = None


def _folder(name: str | os.PathLike, hub: dict) -> Path:
    subfolder = hub.get("subfolder") or ""
    if os.path.isdir(name):
        return Path(name) / subfolder
    from huggingface_hub import snapshot_download   # a Hub id: the configs and safetensors files only
    where = snapshot_download(str(name), revision=hub.get("revision"), cache_dir=hub.get("cache_dir"),
                              token=hub.get("token"), local_files_only=bool(hub.get("local_files_only")),
                              allow_patterns=[f"{subfolder}/*.json" if subfolder else "*.json",
                                              f"{subfolder}/*.safetensors" if subfolder else "*.safetensors"])
    return Path(where) / subfolder


def sharded_from_pretrained(cls, name: str | os.PathLike, *model_args: Any, **kwargs: Any) -> nn.Module:
    """`cls.from_pretrained(name, ...)` as a meta-device model whose weights initialize/wrap loads shard by shard."""
    import torch
    if model_args:
        raise ValueError(f"{cls.__name__}.from_pretrained under fsdpzero's HfDeepSpeedConfig: positional model "
                         "arguments are not supported; pass them through the config")
    refused = sorted(k for k in _REFUSED_KEYS if kwargs.get(k) not in (None, False))
    if refused:
        raise ValueError(f"{cls.__name__}.from_pretrained({', '.join(f'{k}=...' for k in refused)}) under "
                         "fsdpzero's HfDeepSpeedConfig: not supported (the model is loaded sharded per the "
                         "DeepSpeed config); remove the argument")
    hub = {k: kwargs.pop(k) for k in _HUB_KEYS if k in kwargs}
    for k in _IGNORED_KEYS:
        kwargs.pop(k, None)
    if (kwargs.pop("adapter_kwargs", None) or {}).get("_adapter_model_path"):   # the Auto class found an adapter
        raise ValueError(f"{cls.__name__}.from_pretrained: PEFT adapters are not loaded under fsdpzero's "
                         "HfDeepSpeedConfig; load the base model, then the adapter with PEFT")
    kwargs.pop("adapter_name", None)
    want_info = kwargs.pop("output_loading_info", False)
    dtype = kwargs.pop("dtype", None)
    dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype
    attn = kwargs.pop("attn_implementation", None)
    config = kwargs.pop("config", None)
    if not isinstance(config, transformers.PretrainedConfig):
        config, kwargs = cls.config_class.from_pretrained(config if config is not None else name,
                                                          return_unused_kwargs=True, **hub, **kwargs)
    if kwargs:
        raise ValueError(f"{cls.__name__}.from_pretrained: {sorted(kwargs)} are neither config attributes nor "
                         "arguments fsdpzero's sharded loading takes")
    folder = _folder(name, hub)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    build: dict[str, Any] = {} if attn is None else {"attn_implementation": attn}
    if dtype is not None:
        build["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = dtype
    with torch.device("meta"):
        model = cls._from_config(config, **build)
    model.config._name_or_path = str(name)
    if model.can_generate() and (folder / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(folder))
    model.eval()                       # as from_pretrained returns it
    # transformers' conversion mapping, taken before sharding: fully_shard's FSDP<Model> class reads as custom code
    transforms = conversion_mapping(model)
    defer_weights(model, lambda _model: functools.partial(load_converted_safetensors, path=folder,
                                                          transforms=transforms))
    if want_info:
        return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    return model


def checkpoint_keys(folder: Path) -> dict[str, Path]:
    """Checkpoint key -> safetensors file (one file, or model.safetensors.index.json's weight map)."""
    import json

    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors "
                                f"checkpoints load sharded; convert .bin files with save_pretrained first)")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _read(where: dict[str, Path], key: str, box=None):
    """One checkpoint tensor, whole or the rows `box`; one open per read (safetensors maps the file, and touched
    pages count as this process's memory until it is closed)."""
    from safetensors import safe_open
    with safe_open(str(where[key]), framework="pt", device="cpu") as f:
        return f.get_tensor(key) if box is None else f.get_slice(key)[box]


def local_box(t):
    """(the tensor this rank writes, the slice of the full tensor it holds)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(t, DTensor):
        return t.data, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _mismatch(folder: Path, key: str, saved: tuple, live: tuple) -> ValueError:
    hint = (" (the transpose: a Conv1D (in, out) weight for a Linear (out, in), or the reverse?)"
            if len(live) == 2 and saved == live[::-1] else "")
    return ValueError(f"{folder}: size mismatch for {key}: the checkpoint has shape {saved}, the model {live}{hint}; "
                      f"is it the same architecture and config?")


def conversion_mapping(model: nn.Module) -> list:
    """transformers' weight renamings and converters for `model` (what its from_pretrained applies)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    return get_model_conversion_mapping(model) if isinstance(model, transformers.PreTrainedModel) else []


def _expert_rows(converter, target) -> slice | None:
    """The rows of dim 0 this rank holds of `target`, when its converter stacks one source tensor per row
    (MergeModulelist over dim 0, then at most concatenations along later dims, one target): Mixtral's and Qwen-MoE's
    fused experts. None for any other converter (built whole instead)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist
    ops = getattr(converter, "operations", None) or []
    if target is None or len(converter.target_patterns) != 1 or not ops or not isinstance(ops[0], MergeModulelist) \
            or ops[0].dim != 0 or not all(isinstance(op, Concatenate) and op.dim >= 1 for op in ops[1:]):
        return None
    return local_box(target)[1][0]


def _load_expert_rows(folder: Path, where: dict[str, Path], converter, first: str, target, rows: slice,
                      model: nn.Module) -> None:
    """Read only the source tensors of this rank's rows (experts), convert them, copy them in."""
    local, box = local_box(target)
    for pattern, keys in list(converter.collected_tensors.items()):
        if len(keys) != target.shape[0]:   # one source per row, or it is not the checkpoint of this model
            raise _mismatch(folder, first, (len(keys),) + tuple(target.shape[1:]), tuple(target.shape))
        converter.collected_tensors[pattern] = [_read(where, k) for k in keys[rows]]
    if not local.numel():
        return
    (value,) = converter.convert(first, model=model, config=getattr(model, "config", None)).values()
    value = value[0] if isinstance(value, list) else value
    if tuple(value.shape) != (rows.stop - rows.start,) + tuple(target.shape[1:]):
        raise _mismatch(folder, first, (target.shape[0],) + tuple(value.shape[1:]), tuple(target.shape))
    local.copy_(value[(slice(None),) + tuple(box[1:])].to(dtype=local.dtype))


def load_converted_safetensors(model: nn.Module, path: str | os.PathLike, transforms: list | None = None) -> None:
    """Fill a sharded (or plain) transformers model in place from its safetensors checkpoint as transformers'
    from_pretrained would: checkpoint keys renamed and tensors converted by transformers' own conversion mapping
    (`get_model_conversion_mapping`: Mixtral's and Qwen-MoE's per-expert weights fused into one (experts, ...)
    tensor, legacy renamings, the base model's prefix added or dropped). A tensor that is only renamed is read as
    this rank's rows alone (safetensors' get_slice). Fused experts (one source tensor per row of dim 0, the dim
    FSDP2 shards) are built from the sources of this rank's experts only. Any other converted tensor is built whole
    from its sources by the converter's operations, one target at a time, and this rank's rows of it are copied (so
    host memory per rank peaks at one such tensor). Every shape is compared with the model's (one
    ValueError naming the tensor), and every parameter and persistent buffer must be filled (KeyError naming the
    missing ones), the same on every rank. transforms: transformers' mapping for the model as built, before
    sharding (default: taken from `model` now)."""
    import copy as _copy

    import torch
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    from fsdpzero.dist import clean_fqn
    folder = Path(path)
    where = checkpoint_keys(folder)
    tensors = {clean_fqn(n): p for n, p in model.named_parameters()}
    persistent = {clean_fqn(k) for k in model.state_dict().keys()}
    tensors.update({clean_fqn(n): b for n, b in model.named_buffers() if clean_fqn(n) in persistent})
    transforms = conversion_mapping(model) if transforms is None else transforms
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    known = dict.fromkeys(tensors, True)
    direct: dict[str, str] = {}                  # model key -> checkpoint key (renamed at most)
    converted: dict[str, WeightConverter] = {}   # first target key -> its converter, holding its source keys
    for key in sorted(where, key=dot_natural_key):   # transformers' order: experts 0, 1, ..., 10
        target, pattern = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                            known)
        if target not in known and key in known:
            target, pattern = key, None
        if target not in known:
            continue   # a checkpoint tensor the model does not have: unexpected, as transformers leaves it
        if pattern is None:
            direct[target] = key
        else:
            converted.setdefault(target, _copy.deepcopy(by_pattern[pattern])).add_tensor(target, key, pattern, key)
    wrong = []
    for target, key in direct.items():   # shapes first, from the files' headers, before anything is copied
        from safetensors import safe_open
        with safe_open(str(where[key]), framework="pt", device="cpu") as f:
            saved = tuple(f.get_slice(key).get_shape())
        if saved != tuple(tensors[target].shape):
            wrong.append((target, saved, tuple(tensors[target].shape)))
    if wrong:
        raise _mismatch(folder, *wrong[0])
    filled = set()
    with torch.no_grad():
        for target, key in direct.items():
            local, box = local_box(tensors[target])
            if local.numel():
                local.copy_(_read(where, key, box if local.dim() else None).to(dtype=local.dtype))
            filled.add(target)
        for first, converter in converted.items():
            rows = _expert_rows(converter, tensors.get(first))
            if rows is not None:   # this rank's experts only (MergeModulelist over dim 0, the dim FSDP2 shards)
                _load_expert_rows(folder, where, converter, first, tensors[first], rows, model)
                filled.add(first)
                continue
            for pattern, keys in list(converter.collected_tensors.items()):   # the source keys -> their tensors
                converter.collected_tensors[pattern] = [_read(where, k) for k in keys]
            for name, value in converter.convert(first, model=model, config=getattr(model, "config", None)).items():
                value = value[0] if isinstance(value, list) else value
                if name not in tensors:
                    continue
                if tuple(value.shape) != tuple(tensors[name].shape):
                    raise _mismatch(folder, name, tuple(value.shape), tuple(tensors[name].shape))
                local, box = local_box(tensors[name])
                if local.numel():
                    local.copy_(value[box].to(dtype=local.dtype))
                filled.add(name)
    missing = [k for k in tensors if k not in filled]
    if missing:
        raise KeyError(f"{folder}: {len(missing)} tensor(s) of the model are not in the checkpoint, e.g. "
                       f"{missing[:3]} (is it the same architecture and config?)")


__all__ = ["HfDeepSpeedConfig", "load_converted_safetensors", "is_deepspeed_zero3_enabled", "deepspeed_config",
           "sharded_from_pretrained", "live_config", "routing_installed"]
