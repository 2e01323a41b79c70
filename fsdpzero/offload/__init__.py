"""The offload wing: ZeRO-Offload and ZeRO-Infinity on FSDP2.

build.py turns the plan into a gradient path: OffloadGradPath (path.py; CPU masters and Adam states stepped by the
fused CPU Adam, pipelined per chunk, chunks.py) or NVMeGradPath (nvme_path.py; masters and moments on disk behind
NVMeAdam, nvme_adam.py). device_step.py steps the share kept on the accelerator (offload_optimizer.ratio < 1),
speculate.py steps during backward, timeline.py profiles the pipeline, param_swapper.py swaps parameter shards to disk
(offload_param nvme) in swap directories owned by swapdir.py. The hooks into FSDP2's private state these use live in
fsdpzero/fsdp2_internals.py, shared by the whole library.
"""
from fsdpzero.offload.build import build_offload_path  # noqa: F401
