"""fsdpzero: DeepSpeed-format training configs, run on native PyTorch FSDP2.

Public API (imported lazily, so `fsdpzero migrate` and the config layer never pay for torch):
    wrap(model, ds_config, ...) -> Engine
    initialize(model=..., config=..., ...) -> (engine, optimizer, dataloader, lr_scheduler)   # deepspeed-shaped
    zero.Init(), zero.GatheredParameters(params, modifier_rank=0)                              # deepspeed.zero
    load_config(path | dict | json_str, ...) -> validated config
    translate(config, env) -> Plan
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "wrap": "fsdpzero.api",
    "initialize": "fsdpzero.api",
    "init_distributed": "fsdpzero.api",
    "add_config_arguments": "fsdpzero.api",
    "Engine": "fsdpzero.engine",
    "load_config": "fsdpzero.config",
    "ConfigError": "fsdpzero.config",
    "translate": "fsdpzero.plan.translate",
    "Plan": "fsdpzero.plan",
    "Env": "fsdpzero.plan",
}

__all__ = sorted(_EXPORTS)


# submodules reached as attributes, as `import deepspeed; deepspeed.zero.Init()` does (`import fsdpzero as deepspeed`)
_SUBMODULES = ("zero",)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"fsdpzero.{name}")
    raise AttributeError(f"module 'fsdpzero' has no attribute {name!r}")
