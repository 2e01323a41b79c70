"""Stage 1 in the engine: fsdpzero.optim's GradPath over ops/fsdpzero_ops/stage1/optimizer.py's Stage1Optimizer.

`zero_optimization.stage: 1` routes here (fsdpzero.api.grad_path_type). The model stays unwrapped: parameters are
replicated, and the stage-1 optimizer reduce-scatters gradients at the boundary, steps its shard and all-gathers.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fsdpzero_ops import CPUAdam
from fsdpzero_ops.stage1 import Stage1Optimizer
from fsdpzero.host import place_cpu_step
from fsdpzero.optim.factory import AdamNoBiasCorrection
from fsdpzero.optim.grad_path import UNSTEPPED, GradPath, MASTER, drop_unstepped_state, skips_on_device
from fsdpzero.parallel.mesh import flat_group
from fsdpzero.precision import DTYPES, cast_forward_inputs
from fsdpzero.sharding import checkpoint_activations, find_blocks
from fsdpzero.tuning import Tuning, env_name, or_defaults


# The optimizers whose update of an element needs only that element (and its state): a flat shard per rank gives
# them what whole tensors give. AdamW is an Adam; CPUAdamW (and the compat DeepSpeedCPUAdam) a CPUAdam.
ELEMENTWISE = (torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, AdamNoBiasCorrection, CPUAdam)


# Speed-ups, the stage1_* knobs of fsdpzero.tuning (A/B runs: bench/stage1.py's *_legacy configs turn them off). All
# keep the result within float rounding of the plain schedule (the stage-0 parity tests hold either way; see
# docs/stage1.md). forward_allgather is off by default: after step() returns, parameters read directly (p.norm(),
# model.weight.clone(), a DeepSpeed-oracle comparison) would be stale until the next forward or wait_for_params();
# DeepSpeed's stage 1 returns with them updated. Worth ~1% on 2x H200 (BENCHMARKS.md).
KNOBS = {key: env_name("stage1_" + key) for key in ("ramp_buckets", "fold_grad_scale", "pipeline_step",
                                                     "forward_allgather")}


def stage1_knobs(tuning: Tuning) -> dict[str, bool]:
    return {key: getattr(tuning, "stage1_" + key) for key in KNOBS}


class Stage1GradPath(GradPath):
    """fsdpzero.optim.GradPath over a Stage1Optimizer: the engine drives the reduce / norm / scale / update steps
    (clipping, loss scaling and the skip decision stay in the engine)."""

    name = "stage1"

    def __init__(self, stage1: Stage1Optimizer):
        self.stage1, self.optimizer = stage1, stage1.optimizer
        self.refresh_on_load = True   # off while a checkpoint with masters loads (keep_masters_on_load)
        self.state_copies = False     # on around an async save's state_dict() (async_save)

    @classmethod
    def lay_out(cls, model: nn.Module, plan, mesh, mp_policy, *, device_type: str = "cpu",
                blocks: list[nn.Module] | None = None) -> tuple[nn.Module, list[nn.Module]]:
        """Stage 1 leaves the module unwrapped (replicated plain tensors): only activation checkpointing is
        applied; Stage1Optimizer reduces the gradients and shards the optimizer state itself."""
        checkpoint_activations(model, plan, blocks if blocks is not None else find_blocks(model))
        return model, []

    @classmethod
    def build(cls, model: nn.Module, plan, make_optimizer: Callable, mesh=None, *,
              tuning: Tuning | None = None) -> "Stage1GradPath":
        """`zero_optimization.stage: 1`: the engine's optimizer (config section or client) over the whole parameters,
        then sharded by Stage1Optimizer.wrap. The model stays unwrapped; its parameters are cast to the plan's
        param_dtype after the fp32 masters are taken."""
        if plan.offload.optimizer_device not in ("none", "cpu"):
            raise ValueError(f"zero_optimization.offload_optimizer.device = {plan.offload.optimizer_device!r} with "
                             "stage 1 is not supported: use \"cpu\", or stage 2/3 for NVMe offload")
        if plan.offload.optimizer_device == "cpu" and plan.offload.ratio < 1.0:   # a Plan built by hand (the
            raise ValueError(f"zero_optimization.offload_optimizer.ratio = {plan.offload.ratio} with stage 1: "
                             "partial offload needs stage 2 or 3 (set ratio to 1.0)")   # config refuses it first)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dtype = DTYPES[plan.precision.param_dtype]
        for p in model.parameters():   # frozen weights compute in the same dtype (DeepSpeed casts the whole module)
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(dtype)
        optimizer = make_optimizer([p for _, p in named])
        if not isinstance(optimizer, ELEMENTWISE) and not hasattr(optimizer, "bind_flat_shards") \
                and (not dist.is_initialized() or dist.get_rank() == 0):
            logging.getLogger("fsdpzero").warning(
                "ZeRO stage 1 gives %s one flat tensor per param group and rank, as DeepSpeed's ZeRO 1/2 do; "
                "per-tensor quantities (LAMB trust ratios, ...) are then taken over that flat shard and results "
                "differ from stage 0", type(optimizer).__name__)
        shard, precision, offload = plan.shard, plan.precision, plan.offload
        if offload.optimizer_device == "cpu":   # the CPU step's threads and cores, as the offload path's (torchrun's
            place_cpu_step(or_defaults(tuning))   # OMP_NUM_THREADS=1 left it one thread); before the masters exist
        knobs = stage1_knobs(or_defaults(tuning))
        forward_allgather = knobs.pop("forward_allgather")
        stage1 = Stage1Optimizer.wrap(
            optimizer, {id(p): n for n, p in named}, process_group=flat_group(mesh) if mesh is not None else None,
            param_dtype=dtype, reduce_dtype=DTYPES[precision.reduce_dtype],
            reduce_bucket_size=shard.reduce_bucket_size, allgather_bucket_size=shard.allgather_bucket_size,
            overlap_comm=bool(shard.overlap_comm),
            master_device="cpu" if offload.optimizer_device == "cpu" else None, **knobs)
        if hasattr(optimizer, "bind_flat_shards"):   # Muon (fsdpzero.optim.muon): where each matrix lies in shards
            optimizer.bind_flat_shards(stage1.flat_groups, stage1.group)
        cast_forward_inputs(model, plan)   # fp32 inputs meet fp16/bf16 weights, as at stages 0/2/3 (fp16.auto_cast)
        if forward_allgather:   # the model's forward pre-hooks wait for their buckets; saving and loading wait
            stage1.defer_allgather_to_forward(model)
        # weights loaded without the optimizer (load_module_only, load_optimizer_states=False) become the masters;
        # a checkpoint with masters keeps the ones DCP read (keep_masters_on_load)
        path = cls(stage1)
        model.register_load_state_dict_post_hook(lambda *_: path.refresh_masters())
        return path

    def refresh_masters(self) -> None:
        """The model's load_state_dict post-hook: weights loaded without the optimizer become the masters."""
        if self.refresh_on_load:
            self.stage1.refresh_masters()

    @contextlib.contextmanager
    def keep_masters_on_load(self):
        """Loading an engine checkpoint that has the fp32 masters: DCP reads them in place, into the views of the
        flat master shards that state_dict() handed out, and the model's weights load next. Refreshing the masters
        from those 16-bit weights would round what DCP just read to fp16/bf16 (a stage-1 fp16 resume then drifted
        in the 5th digit)."""
        self.refresh_on_load = False
        try:
            yield
        finally:
            self.refresh_on_load = True

    @contextlib.contextmanager
    def async_save(self):
        """The state_dict() views of the flat shards become copies: DCP's async staging deep-copies CPU DTensors,
        which fails on a view at a storage offset (and would copy the whole flat shard per view)."""
        self.state_copies = True
        try:
            yield
        finally:
            self.state_copies = False

    def set_sync(self, sync: bool) -> None:
        self.stage1.set_gradient_sync(sync)

    def finish_gradients(self) -> None:
        self.stage1.reduce_gradients()

    def grad_norm(self) -> torch.Tensor:
        return self.stage1.grad_norm()

    def scale_grads_(self, factor) -> None:
        if not (isinstance(factor, float) and factor == 1.0):
            self.stage1.scale_grads_(factor)

    def can_skip_on_device(self) -> bool:
        return skips_on_device(self.optimizer)

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        # on a device-side skip the masters stay as they were, so the all-gather rewrites the same parameters
        if found_inf is not None:
            self.optimizer.found_inf = found_inf
        try:
            self.stage1.update_params()
        finally:
            if found_inf is not None:
                del self.optimizer.found_inf

    def zero_grad(self) -> None:
        self.stage1.zero_grad()

    def wait(self) -> None:
        """The model's parameters hold the last step's values (the all-gather may still be in flight after step())."""
        self.stage1.wait_for_params()

    def state_dict(self, streaming: bool = False) -> dict[str, Any]:
        # a never-stepped inner optimizer gets its state from a zero-gradient step at lr 0 (ensure_state), which
        # must not reach training: see drop_unstepped_state (the masters, views of the live flat shards, stay)
        unstepped = not any(fg.master in self.optimizer.state for fg in self.stage1.flat_groups)
        state = self.stage1.state_dict(copies=self.state_copies)
        if not unstepped:
            return state
        masters = {name: entry.pop(MASTER) for name, entry in state["state"].items()}
        state = drop_unstepped_state(self.optimizer, state)
        for name, entry in state["state"].items():
            entry[MASTER] = masters[name]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        unstepped = state.pop(UNSTEPPED, False)
        self.stage1.load_state_dict(state)
        if unstepped:   # saved before its first step: the inner optimizer is as new
            self.optimizer.state.clear()
