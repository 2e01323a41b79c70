"""JIT-building of the C++ ops with torch.utils.cpp_extension + ninja, cached inside the project.

`load_op(name, sources)` returns the loaded library (ops registered through TORCH_LIBRARY become `torch.ops.<ns>`)
or None, warning once, when no compiler/ninja is usable: callers then take their pure-torch reference path.
`load_op(..., build=False)` forces the reference path (the library passes it for an engine with the `no_build` knob,
FSDPZERO_NO_BUILD=1). This package reads no fsdpzero environment and keeps no settings: its values come as arguments.
"""
from __future__ import annotations

import os
import warnings
from functools import lru_cache
from pathlib import Path

# In a source checkout the C++ sources sit beside this package (ops/csrc, reached through the ops/fsdpzero_ops/csrc
# link that the wheel resolves into a copy); in an installed wheel, inside it (fsdpzero_ops/csrc).
_HERE = Path(__file__).resolve().parent
CSRC = next((p.resolve() for p in (_HERE / "csrc", _HERE.parent / "csrc") if p.is_dir()), _HERE / "csrc")
def extensions_dir() -> Path:
    """Build cache: $TORCH_EXTENSIONS_DIR; else, in a source checkout, <repo>/.torch_extensions (not ~/.cache, shared
    between venvs); else (an installed wheel) a per-user cache tagged with the Python and torch versions, since a
    library built against one torch must not be loaded by another."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        root = Path(env)
    else:
        repo = CSRC.parents[1]   # <repo>/ops/csrc in a checkout
        if (repo / "pyproject.toml").is_file():
            root = repo / ".torch_extensions"
        else:
            import sys

            import torch
            cache = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"))
            tag = f"py{sys.version_info[0]}{sys.version_info[1]}_torch{torch.__version__}"
            root = cache / "torch_extensions" / "fsdpzero" / tag
    root.mkdir(parents=True, exist_ok=True)
    return root


def load_op(name: str, sources: tuple[str, ...], extra_cflags: tuple[str, ...] = (),
            extra_ldflags: tuple[str, ...] = (), *, build: bool = True):
    """build=False: never compile (the caller's no_build setting); None, and callers take their reference path."""
    if not build:
        return None
    return _load(name, sources, extra_cflags, extra_ldflags)


@lru_cache(maxsize=None)
def _load(name: str, sources: tuple[str, ...], extra_cflags: tuple[str, ...], extra_ldflags: tuple[str, ...]):
    try:
        from torch.utils import cpp_extension
        build_dir = extensions_dir() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(CSRC / s) for s in sources],
                           extra_cflags=["-O3", *extra_cflags], extra_ldflags=list(extra_ldflags),
                           build_directory=str(build_dir), is_python_module=False, verbose=False)
        return name
    except Exception as exc:  # no compiler, no ninja, failed build: fall back loudly, once
        warnings.warn(f"fsdpzero: could not build the C++ op {name!r} ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}); using the pure-torch reference path",
                      RuntimeWarning, stacklevel=2)
        return None
