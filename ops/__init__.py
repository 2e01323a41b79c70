"""fsdpzero_ops: what FSDP2 lacks, as C++ ops with pure-torch reference paths.

Import as `fsdpzero.ops` (see fsdpzero/ops.py). Each op module exposes a reference implementation used by its tests
and as the fallback when no compiler is present.
"""
from .cpu_adam import CPUAdam, CPUAdamW  # noqa: E402,F401  (fsdpzero.ops.CPUAdam / CPUAdamW)
