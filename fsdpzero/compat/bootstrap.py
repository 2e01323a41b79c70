"""Per-rank entry point of `fsdpzero launch` (torchrun runs `python -m fsdpzero.compat.bootstrap [-m] TARGET ARGS`):
install the shim (fsdpzero/compat/shim.py), say so once (rank 0), then run TARGET as `__main__` with sys.argv and
sys.path[0] as `python TARGET ARGS` (or `python -m TARGET ARGS`) would have them."""
from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    module_mode = bool(argv) and argv[0] == "-m"
    if module_mode:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m fsdpzero.compat.bootstrap [-m] SCRIPT_OR_MODULE [ARGS...]")
    from fsdpzero.compat import shim
    shim.install()
    if os.environ.get("RANK", "0") == "0":
        print(shim.NOTICE, file=sys.stderr, flush=True)
    target, sys.argv = argv[0], list(argv)
    if module_mode:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))   # where `python SCRIPT` would look first
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
