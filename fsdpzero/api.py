"""Public entry points: `wrap(model, ds_config)` and the `deepspeed.initialize`-shaped `initialize(...)`.

Order matters and is fixed: translate the config and refuse what cannot run (no process group, no GPU memory
touched yet), join the process group, build the mesh, upcast to fp32 masters, broadcast rank 0's weights, shard,
materialise meta models, build the gradient path and its optimizer, the scheduler and the loss scaler.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable

import torch
from torch import nn

from fsdpzero import tuning as tuning_knobs
from fsdpzero.compile import check_compile
from fsdpzero.compile import with_knob as compile_knob
from fsdpzero.dist import broadcast_module, check_same_on_all_ranks, detect_device_type
from fsdpzero.dist import init_distributed as init_distributed_env
from fsdpzero.engine import Engine
from fsdpzero.log import log_startup, setup_logging
from fsdpzero.optim.muon import check_muon_model, tag_muon_params
from fsdpzero.optim import FSDPGradPath, GradPath, OptimizerFactory, check_optimizer, make_optimizer_factory
from fsdpzero.optim.grad_path import ForwardOnlyPath
from fsdpzero.parallel import check_user_mesh, data_mesh, data_rank_and_size, model_mesh
from fsdpzero.parallel.tensor_parallel import apply_tensor_parallel
from fsdpzero.parallel.tp_plan import resolve_tp_plan, style_counts
from fsdpzero.parallel.ulysses import apply_sequence_parallel
from fsdpzero.parallel.ulysses import check_model as check_sequence_parallel
from fsdpzero.plan import Env, Plan
from fsdpzero.plan.translate import build_plan
from fsdpzero.precision import make_scaler, mp_policy, upcast_to_master
from fsdpzero.sharding import build_mesh, find_blocks, is_meta, materialize, shard_home
from fsdpzero.zero import take_deferred


def launch_env(device_type: str | None = None) -> Env:
    """The Env the plan is built for, from torchrun's variables (read before any process group exists)."""
    def count(*names: str) -> int | None:   # the first of these variables set to a positive count
        for name in names:
            value = os.environ.get(name, "")
            if value.isdigit() and int(value) > 0:
                return int(value)
        return None

    world = count("WORLD_SIZE") or 1
    # torchrun's names, then DeepSpeed's own launcher's (`deepspeed` / deepspeed.launcher.launch sets LOCAL_SIZE and
    # CROSS_SIZE, not LOCAL_WORLD_SIZE / GROUP_WORLD_SIZE)
    per_node = count("LOCAL_WORLD_SIZE", "LOCAL_SIZE") or world
    # the node count itself, the same on every rank: nodes may run different numbers of ranks (`fsdpzero launch
    # --exclude node-b:3`), and then world // ranks per node differs from node to node
    nodes = count("GROUP_WORLD_SIZE", "CROSS_SIZE") or max(1, world // per_node)
    return Env(world_size=world, nodes=nodes, device_type=device_type or detect_device_type())


def make_plan(ds_config: Any, env: Env, context: dict | None = None) -> Plan:
    """A Plan as given, or translated from a ds_config (path, dict or JSON string) by the config layer."""
    if isinstance(ds_config, Plan):
        return ds_config
    return build_plan(ds_config, env, context=context or {}, strict=False)


def refuse_unsupported(plan: Plan) -> None:
    bad = plan.unsupported
    if bad:
        lines = "\n".join(f"  {d.key} = {d.value!r}: {d.detail}" for d in bad)
        raise ValueError(f"the config asks for {len(bad)} thing(s) fsdpzero cannot run; remove or change:\n{lines}")


def wrap(model: nn.Module, ds_config: Any, *, mesh=None, optimizer: Any = None, lr_scheduler: Any = None,
         model_parameters: Iterable | None = None, block_classes: Iterable[str | type] | None = None,
         block_predicate: Callable[[nn.Module], bool] | None = None, full_state_dict: dict | None = None,
         device_type: str | None = None, tuning: Any = None, allow_no_optimizer: bool = False,
         sequence_parallel: Any = None, **context: Any) -> Engine:
    """Shard `model` per the DeepSpeed config and return the training Engine.

    optimizer: a torch optimizer built over `model`'s parameters (rebound in place to the shards), or a callable
      `params -> optimizer`; None uses the config's `optimizer` section.
    lr_scheduler: a scheduler object (on that optimizer), or a callable `optimizer -> scheduler`; None uses the
      config's `scheduler` section.
    block_classes / block_predicate: which submodules are the transformer blocks (default: HF `_no_split_modules`).
    full_state_dict: weights for a model built on the meta device (rank 0's copy is broadcast).
    allow_no_optimizer: no optimizer section and none passed gives a forward-only engine (ZeRO inference, as
      `deepspeed.initialize` allows) instead of an error.
    sequence_parallel: Ulysses groups and attention already set up for `model` (a
      fsdpzero.parallel.ulysses.SequenceParallel of the config's sequence_parallel_size: the mpu that accelerate's
      DeepSpeed door gets from UlyssesSPAttentionHF.register_with_transformers); None builds them from the config.
    tuning: knobs (a dict or fsdpzero.tuning.Tuning) over the FSDPZERO_* environment; see fsdpzero/tuning.py.
    context: values for the config's "auto" entries (e.g. hidden_size=..., num_training_steps=...).
    """
    setup_logging()
    knobs = tuning_knobs.use(tuning)     # every channel validated before any process group exists
    env = launch_env(device_type)
    plan = make_plan(ds_config, env, context)
    refuse_unsupported(plan)
    forward_only = allow_no_optimizer and optimizer is None and plan.optimizer.type is None
    if not forward_only:
        check_optimizer(plan, optimizer)
    if plan.optimizer.type == "muon" and optimizer is None:
        check_muon_model(model)   # a 4-D Muon parameter (DeepSpeed cannot step it either), before any process group
    plan = compile_knob(plan, knobs.compile)
    check_compile(plan)
    tp_styles = resolve_tp_plan(model, plan.tensor_parallel)   # AutoTP: its errors before any process group
    if plan.sequence_parallel.size > 1:   # Ulysses: heads, KV heads and attention checked before any process group
        check_sequence_parallel(model, plan.sequence_parallel.size, plan.tensor_parallel.size)
    if sequence_parallel is not None and sequence_parallel.size != plan.sequence_parallel.size:
        raise ValueError(f"wrap(sequence_parallel=...) has {sequence_parallel.size} ranks a group but the config's "
                         f"sequence_parallel_size is {plan.sequence_parallel.size}: make them equal")
    if mesh is not None:   # the caller's mesh: its shape alone, so the same error on every rank, before any collective
        check_user_mesh(mesh, plan.tensor_parallel.size)
    info = init_distributed_env(env.device_type)
    # before the first collective: ranks started with different configs or models would otherwise meet in
    # mismatched collectives (a gloo abort or a hang) with nothing saying what differs
    check_same_on_all_ranks(run_facts(plan, model), "configs or models")
    mesh = mesh if mesh is not None else build_mesh(plan, info.world_size, info.device_type)

    if sequence_parallel is None:
        sequence_parallel = apply_sequence_parallel(model, plan)   # its groups, and the model's attention over them
    fill = take_deferred(model)   # zero.Init / HfDeepSpeedConfig: built without full weights; filled per shard
    meta = is_meta(model)
    if not meta:
        upcast_to_master(model, plan)   # logs what it cast; the startup block names the master dtype
        model.to(info.device)
        broadcast_module(model)
    original = [p for p in model.parameters() if p.requires_grad]
    if plan.optimizer.type == "muon" and optimizer is None:
        tag_muon_params(model)   # DeepSpeed's split is by name and layer shape: taken before sharding changes both
    groups = _param_groups(model_parameters)
    all_blocks = find_blocks(model, block_classes, block_predicate)
    apply_tensor_parallel(model, tp_styles, model_mesh(mesh, "tp"))   # before AC and fully_shard, as torchtitan
    path_type = grad_path_type(plan)
    model, blocks = path_type.lay_out(model, plan, data_mesh(mesh), mp_policy(plan), device_type=info.device_type,
                                      blocks=all_blocks)
    if meta:
        materialize(model, info.device, full_state_dict, param_device=shard_home(plan, info.device),
                    filled_later=fill is not None)
        if fill is not None:
            fill(model)
    if forward_only:
        path = ForwardOnlyPath(model)
    else:
        factory = make_optimizer_factory(plan, optimizer, device_type=info.device_type, original_params=original,
                                         param_groups=groups)
        path = build_grad_path(path_type, model, plan, factory, data_mesh(mesh), knobs)
        if isinstance(optimizer, torch.optim.Optimizer) and path.optimizer is not optimizer:
            share_param_groups(optimizer, path.optimizer)
    scheduler = _scheduler(plan, lr_scheduler, path.optimizer)
    engine = Engine(model, plan, path, lr_scheduler=scheduler, scaler=make_scaler(plan), device=info.device,
                    mesh=mesh, local_rank=info.local_rank, tuning=knobs, blocks=all_blocks)
    engine.sequence_parallel = sequence_parallel
    if plan.compile.enabled:   # after fully_shard: each block's forward, inside FSDP2's hooks (fsdpzero/compile.py)
        engine.compile(plan.compile.backend, plan.compile.kwargs)
    log_startup(plan, {"world_size": info.world_size, "mesh": str(mesh),
                       "grad_path": path_type.name if not forward_only else "none (forward only)",
                       "blocks_sharded": len(blocks), "master_weights": plan.precision.master_dtype,
                       **({"tensor_parallel": f"{plan.tensor_parallel.size} ranks: {style_counts(tp_styles)}"}
                          if tp_styles else {}),
                       **({"compile": f"{plan.compile.backend} per block ({plan.compile.source})"}
                          if plan.compile.enabled else {}),
                       "optimizer": type(path.optimizer).__name__ if path.optimizer is not None else "none"})
    return engine


RANK_LOCAL_PLAN_FIELDS = frozenset({"plan offload.optimizer_nvme_path", "plan offload.param_nvme_path"})


def run_facts(plan: Plan, model: nn.Module) -> dict[str, str]:
    """What every rank must agree on, as text: each plan field and each parameter's name, dtype, shape and
    trainability (check_same_on_all_ranks compares a digest of it across ranks). Left out: what may differ per
    rank without changing any collective (the NVMe swap paths, a node-local disk each). The monitors count: a
    monitored step averages the loss over the ranks (Engine._write_monitor), so every rank must agree on them."""
    facts = {}

    def flat(prefix: str, value: Any) -> None:
        if prefix in RANK_LOCAL_PLAN_FIELDS:
            return
        if isinstance(value, dict) and value:
            for k, v in value.items():
                flat(f"{prefix}.{k}", v)
        else:
            facts[prefix] = json.dumps(value, default=str, sort_keys=True)
    for key, value in plan.to_dict().items():
        flat(f"plan {key}", value)
    params = list(model.named_parameters())
    facts["model parameters"] = (f"{len(params)} tensors, {sum(p.numel() for _, p in params)} elements"
                                 + (" (meta)" if params and is_meta(model) else ""))
    for name, p in params:
        facts[f"model parameter {name}"] = (f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
                                            + ("" if p.requires_grad else " frozen"))
    return facts


def grad_path_type(plan: Plan) -> type[GradPath]:
    """The one place the gradient path is chosen (see fsdpzero.optim.grad_path for the contract): its type lays the
    model out (GradPath.lay_out) and builds the path from the plan (GradPath.build). Each branch imports its wing
    only when taken: a plain FSDP run never loads the offload or stage-1 code."""
    if plan.zenflow is not None:   # ZenFlow's own CPU offload (stages 1-3, laid out by FSDP2)
        from fsdpzero.optim.zenflow import ZenFlowGradPath
        return ZenFlowGradPath
    if plan.shard.stage == 1 and plan.tensor_parallel.size <= 1:   # with tp: FSDP2 over dp (fate: approximated)
        from fsdpzero.optim.stage1 import Stage1GradPath   # reduces gradients itself; offloads its own shards (cpu)
        return Stage1GradPath
    if plan.offload.optimizer_device == "cpu":
        from fsdpzero.offload.path import OffloadGradPath
        return OffloadGradPath
    if plan.offload.optimizer_device == "nvme":
        from fsdpzero.offload.nvme_path import NVMeGradPath
        return NVMeGradPath
    return FSDPGradPath


def build_grad_path(path_type: type[GradPath], model: nn.Module, plan: Plan, make_optimizer: OptimizerFactory,
                    mesh=None, tuning: tuning_knobs.Tuning | None = None) -> GradPath:
    """The path of `path_type` (grad_path_type(plan), after its lay_out ran), built from the plan; with Muon at
    ZeRO 1-3 wrapped so that the orthogonalized updates are what is clipped, as DeepSpeed clips them."""
    path = path_type.build(model, plan, make_optimizer, mesh, tuning=tuning)
    if plan.shard.stage >= 1 and hasattr(path.optimizer, "orthogonalize_grads"):
        from fsdpzero.optim.muon import MuonGradPath
        path = MuonGradPath(path)
    return path


def _param_groups(model_parameters) -> list[dict] | None:
    """DeepSpeed's model_parameters: an iterable of tensors or of param-group dicts."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    if items and isinstance(items[0], tuple):   # named_parameters()
        items = [p for _, p in items]
    return [{"params": items}]


def share_param_groups(client: torch.optim.Optimizer, stepped: torch.optim.Optimizer) -> None:
    """A client optimizer that the engine steps through another object (the offload paths' CPU/NVMe Adam over fp32
    masters) lends it its param-group dicts, holding `stepped`'s entries (its params, its hyperparameters) plus the
    client's own keys (a scheduler's initial_lr): a scheduler built on the client, or anything else setting the
    client's lr, then sets the learning rate that steps, as with DeepSpeed, whose ZeRO optimizer steps the client's
    own groups."""
    if len(client.param_groups) != len(stepped.param_groups):   # the paths build one group per client group
        raise RuntimeError(f"the client optimizer has {len(client.param_groups)} param groups, the engine's "
                           f"{len(stepped.param_groups)}: a scheduler on the client optimizer could not drive the "
                           "engine's learning rate")
    for i, (mine, theirs) in enumerate(zip(client.param_groups, stepped.param_groups)):
        mine.update(theirs)
        stepped.param_groups[i] = mine


def _scheduler(plan: Plan, client: Any, optimizer: torch.optim.Optimizer):
    if client is not None:
        return client if hasattr(client, "step") else client(optimizer)
    if plan.scheduler.type is None:
        return None
    from fsdpzero.optim.schedulers import build_scheduler
    return build_scheduler(plan.scheduler, optimizer)


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, config_params: Any = None, tuning: Any = None,
               **context: Any):
    """Drop-in for `deepspeed.initialize`: returns (engine, optimizer, training_dataloader, lr_scheduler).

    The config comes from `config`, `config_params` (dict or path, DeepSpeed's older name), or
    `args.deepspeed_config`, as with DeepSpeed. Without an optimizer (no section, none passed) the engine is
    forward-only: ZeRO inference, `engine.module.generate(..., synced_gpus=True)`. `mpu` (model parallelism) is
    not supported. `tuning`: fsdpzero's knobs (dict or fsdpzero.tuning.Tuning; see wrap)."""
    if model is None:
        raise ValueError("initialize(model=...) is required")
    if mpu is not None:
        raise ValueError("initialize(mpu=...): model/tensor parallel units are not supported by fsdpzero")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("no DeepSpeed config: pass config=<path|dict> or args with --deepspeed_config")
    if distributed_port is not None and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)
    engine = wrap(model, config, optimizer=optimizer, lr_scheduler=lr_scheduler,
                  model_parameters=model_parameters, tuning=tuning, allow_no_optimizer=True, **context)
    loader = None
    if training_data is not None:
        loader = make_dataloader(training_data, engine, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def make_dataloader(dataset, engine: Engine, collate_fn: Callable | None = None):
    """Like DeepSpeed's: micro-batch size per rank, a DistributedSampler over the data-parallel ranks."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler
    rank, replicas = (data_rank_and_size(engine.mesh) if engine.mesh is not None    # tp ranks read the same samples
                      else (dist.get_rank(), dist.get_world_size()))
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank)
    loader = DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                        collate_fn=collate_fn, drop_last=engine.plan.batch.dataloader_drop_last)
    # sequence parallelism: DeepSpeed's UlyssesSPDataLoaderAdapter over it (each group trains on its ranks' batches
    # one after another, each split along the sequence)
    return engine.sequence_parallel.dataloader(loader, engine.device) if engine.sequence_parallel else loader


def init_distributed(dist_backend: str | None = None, **_ignored: Any):
    """`deepspeed.init_distributed()`: join the process group from the launcher's environment. The backend follows
    the device (NCCL + gloo on GPU, gloo on CPU); DeepSpeed's other arguments (ports, MPI discovery) do not apply."""
    device_type = "cpu" if dist_backend == "gloo" else None
    return init_distributed_env(device_type)


def add_config_arguments(parser):
    """`deepspeed.add_config_arguments(parser)`: --deepspeed, --deepspeed_config (and the old deepscale names).
    --local_rank is tolerated by `init_distributed` whether the script declares it or not."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable the DeepSpeed config")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse_suppress())
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse_suppress())
    return parser


def argparse_suppress():
    import argparse
    return argparse.SUPPRESS


__all__ = ["wrap", "initialize", "init_distributed", "add_config_arguments", "make_dataloader"]
