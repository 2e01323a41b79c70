"""The checkpoint wing: DeepSpeed's layout (`global_stepN/`, `latest`) written as sharded, atomic DCP.

dcp.py saves and loads state through DCP; files.py owns the on-disk layout (tags, manifest, atomic finalize);
trust.py is what is trusted and checked on load (DCP's index through an allowlisted unpickler, CRC-32 checksums);
agree.py makes an error on one rank the same error on every rank;
stream.py lets on-disk optimizer states and parameter shards stream through DCP a tensor at a time; engine_state.py
is the Engine's state (model, optimizer, counters) and DeepSpeed checkpoints loaded directly; deepspeed_reader.py
and deepspeed.py read DeepSpeed's files (allowlisted unpickling), universal.py DeepSpeed's universal checkpoints;
convert.py and export.py write consolidated safetensors.
"""
from fsdpzero.checkpoint.convert import dcp_to_safetensors, deepspeed_to_ours  # noqa: F401
from fsdpzero.checkpoint.dcp import (  # noqa: F401
    ModelOptimizer, PendingSave, load_checkpoint, save_checkpoint, wait_for_pending_save,
)
from fsdpzero.checkpoint.export import save_16bit_model, save_state_dict  # noqa: F401
from fsdpzero.checkpoint.agree import CheckpointError  # noqa: F401
from fsdpzero.checkpoint.files import check_tag, checkpoint_problems, resolve_tag  # noqa: F401
from fsdpzero.checkpoint.trust import UnsafeCheckpointError, read_dcp_metadata  # noqa: F401
