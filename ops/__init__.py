"""fsdpzero_ops: what FSDP2 lacks, as C++ ops with pure-torch reference paths.

Import as `fsdpzero.ops` (see fsdpzero/ops.py). Each op module exposes a reference implementation used by its tests
and as the fallback when no compiler is present.
"""
