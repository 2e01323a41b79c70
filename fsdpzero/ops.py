"""The C++ ops of ../ops (installed as `fsdpzero_ops`), importable as `fsdpzero.ops`.

In a source checkout the sibling ops/ folder wins, so tests always exercise the tree they sit in; an installed
wheel falls back to the installed `fsdpzero_ops` package.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def _load_fsdpzero_ops():
    local = Path(__file__).resolve().parent.parent / "ops" / "__init__.py"
    if local.exists():
        mod = sys.modules.get("fsdpzero_ops")
        if mod is None or Path(getattr(mod, "__file__", "")).resolve() != local:
            spec = importlib.util.spec_from_file_location(
                "fsdpzero_ops", local, submodule_search_locations=[str(local.parent)])
            mod = importlib.util.module_from_spec(spec)
            sys.modules["fsdpzero_ops"] = mod
            spec.loader.exec_module(mod)
        return mod
    return importlib.import_module("fsdpzero_ops")


_ops = _load_fsdpzero_ops()


def __getattr__(name):  # fsdpzero.ops.CPUAdam, fsdpzero.ops.stage1, ...
    try:
        return getattr(_ops, name)
    except AttributeError:
        return importlib.import_module(f"fsdpzero_ops.{name}")
