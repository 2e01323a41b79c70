"""What `import deepspeed` gives a script started by `fsdpzero launch` (see fsdpzero/compat/shim.py): DeepSpeed's
training entry points, run by fsdpzero. `deepspeed.zero` is `fsdpzero.zero` and `deepspeed.comm` is
torch.distributed (plus `get_local_rank`); both are imported on first use. Anything else (deepspeed.ops,
deepspeed.utils, ...) is not provided: the import fails naming the module; `fsdpzero launch --no_shim` runs the
script with the real DeepSpeed."""
from __future__ import annotations

from fsdpzero.api import add_config_arguments, init_distributed, initialize
from fsdpzero.engine import Engine as DeepSpeedEngine

# the DeepSpeed release whose config surface fsdpzero follows; the local part says what this really is
__version__ = "0.19.8+fsdpzero"

__all__ = ["DeepSpeedEngine", "add_config_arguments", "init_distributed", "initialize"]
