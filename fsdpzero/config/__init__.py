"""The DeepSpeed config layer: load, validate, resolve "auto", check the batch triad. No torch imports.

    cfg = load_config(path | dict | json_str, context=None, hf_defaults=False, strict=False)  # -> DSConfig
"""
from fsdpzero.config.batch import resolve_batch
from fsdpzero.config.errors import ConfigError, Problem
from fsdpzero.config.load import load_config
from fsdpzero.config.schema import COMPAT_VERSION, DSConfig

__all__ = ["COMPAT_VERSION", "ConfigError", "DSConfig", "Problem", "load_config", "resolve_batch"]
