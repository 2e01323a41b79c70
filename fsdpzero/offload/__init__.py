"""The offload wing: ZeRO-Offload and ZeRO-Infinity on FSDP2.

Two gradient paths (contract: fsdpzero.optim.GradPath): OffloadGradPath (path.py; CPU masters and Adam states stepped
by the fused CPU Adam, pipelined per chunk, chunks.py) and NVMeGradPath (nvme_path.py; masters and moments on disk
behind NVMeAdam, nvme_adam.py). OffloadGradPath.build turns the plan into either, in the named steps of prepare.py;
build.py does the same for callers that hold a plan and a sharded model. device_step.py steps the share kept on the
accelerator (offload_optimizer.ratio < 1), speculate.py steps during backward, timeline.py profiles the pipeline,
access.py makes reads of the weights wait for an overlapped step, param_swapper.py swaps parameter shards to disk
(offload_param nvme) in swap directories owned by swapdir.py. The hooks into FSDP2's private state these use live in
fsdpzero/fsdp2_internals.py, shared by the whole library.
"""
