"""What `import deepspeed` gives a script started by `fsdpzero launch` (see fsdpzero/compat/shim.py): DeepSpeed's
training entry points, run by fsdpzero. `deepspeed.zero` is `fsdpzero.zero` and `deepspeed.comm` is
torch.distributed (plus `get_local_rank`, `init_distributed`); both are imported on first use. The submodules
accelerate uses (runtime.lr_schedules, checkpoint.utils, ops.adam, utils) come from fsdpzero/compat/submodules.py.
Anything else (deepspeed.moe, deepspeed.inference, ...) is not provided: the import fails naming the module;
`fsdpzero launch --no_shim` runs the script with the real DeepSpeed."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from fsdpzero import api
from fsdpzero.api import add_config_arguments, init_distributed
from fsdpzero.compat.shim import STAND_IN_VERSION as __version__  # noqa: F401
from fsdpzero.engine import Engine


class DeepSpeedEngine(Engine):
    """fsdpzero's Engine plus the DeepSpeed engine methods accelerate calls by name (`get_state_dict`,
    `save_model`): nothing else differs. `deepspeed.initialize` returns one."""

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.plan.shard.gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The whole model's weights in the compute dtype on rank 0, None on the other ranks (DeepSpeed's
        contract). Collective: every rank calls it."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from fsdpzero.checkpoint.export import full_tensor
        from fsdpzero.precision import DTYPES
        self.wait_for_params()
        dtype = DTYPES[self.plan.precision.param_dtype]
        swapper = self.grad_path.param_swapper
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        out: dict[str, torch.Tensor] | None = {} if rank0 else None
        # NVMe-swapped params (offload_param nvme) are read from their files, as the export does
        with swapper.lazy() if swapper is not None else contextlib.nullcontext():
            for name, t in get_model_state_dict(self.module).items():
                if exclude_frozen_parameters and name in frozen:
                    continue
                full = full_tensor(t, swapper)          # every rank joins each gather, in the same order
                if rank0:
                    out[name] = (full.to(dtype) if full.is_floating_point() else full).detach().cpu().clone()
        return out

    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict   # DeepSpeed's AutoTP name


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, *rest: Any, **kwargs: Any):
    """`deepspeed.initialize`: fsdpzero.initialize, whose engine is a DeepSpeedEngine (above). A scheduler built on
    a client optimizer drives the engine's learning rate on every path (fsdpzero.api.share_param_groups)."""
    mpu = kwargs.pop("mpu", None)
    if mpu is not None:
        kwargs = with_sequence_parallel(mpu, args, kwargs)
    engine, engine_optimizer, loader, scheduler = api.initialize(args, model, optimizer, *rest, **kwargs)
    engine.__class__ = DeepSpeedEngine          # methods only: the object and its state are fsdpzero's Engine
    if engine.sequence_parallel is not None:   # deepspeed.utils.groups reads it, as DeepSpeed's engine sets groups.mpu
        from fsdpzero.compat import sequence_parallel
        sequence_parallel.mpu = engine.sequence_parallel
    return engine, engine_optimizer, loader, scheduler


def with_sequence_parallel(mpu: Any, args: Any, kwargs: dict) -> dict:
    """`deepspeed.initialize(mpu=...)`: the mpu of this stand-in's UlyssesSPAttentionHF.register_with_transformers
    (accelerate's ALST door) runs: its groups and attention go to wrap, its size into the config. Any other mpu
    (Megatron-style model parallel units) is refused, before any process group or memory is touched."""
    import os

    import torch.distributed as dist

    from fsdpzero.compat.sequence_parallel import check_batch_triad, engine_config
    from fsdpzero.config.load import read_source
    from fsdpzero.parallel.ulysses import SequenceParallel
    if not isinstance(mpu, SequenceParallel):
        raise ValueError(f"deepspeed.initialize(mpu={type(mpu).__name__}): fsdpzero runs only the mpu of "
                         "UlyssesSPAttentionHF.register_with_transformers (sequence parallelism); model/tensor "
                         "parallel units are not supported -> use tensor_parallel.autotp_size in the DeepSpeed config")
    name = "config" if kwargs.get("config") is not None else "config_params"
    config = kwargs.get(name)
    if config is None and args is not None:
        config, name = getattr(args, "deepspeed_config", None), "config"
    if config is None:
        return kwargs      # api.initialize says what is missing
    config = engine_config(dict(read_source(config)), mpu)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    check_batch_triad(config, world, mpu.size)
    return {**{k: v for k, v in kwargs.items() if k not in ("config", "config_params")}, name: config,
            "sequence_parallel": mpu}


__all__ = ["DeepSpeedEngine", "add_config_arguments", "init_distributed", "initialize"]
