"""A device mesh the caller builds (wrap(mesh=...) / initialize(mesh=...)) must agree with
`tensor_parallel.autotp_size`: a mesh without a "tp" dimension used to train silently without tensor parallelism,
and a "tp" dimension the config did not ask for left its ranks unsynchronized replicas. Now one line naming the key,
the value and the fix, from the mesh's shape alone: the same on every rank, before any collective.

2 forked gloo ranks, a real transformers Llama. Both ranks meet each bad mesh (a mesh not refused fails at once), then
each rank alone in turn (rank 0 while rank 1 waits at a barrier, then the reverse): an error raised only after a
collective would leave the lone rank in it, and the job fails at the gloo timeout. A mesh that agrees still trains, and its first
loss equals the one of the mesh fsdpzero builds itself.
"""
import torch.distributed as dist

import fsdpzero
from fsdpzero.parallel import build_parallel_mesh
from tests.engine_cases import ADAMW, batches, build_model
from tests.multirank import run_distributed

MICRO, WORLD = 2, 2


def ds_config(tp: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "train_batch_size": MICRO * WORLD, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
           "zero_optimization": {"stage": 2}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def _first_loss(engine) -> float:
    x = batches(1, 1, MICRO)[0, 0]   # one data replica (dp 1): both tp ranks read the same rows
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _user_meshes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    bad = {   # every rank builds every mesh (a mesh's sub-groups are made collectively), then meets wrap alone
        "no tp dimension": (2, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))),
        "tp of size 1": (2, init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))),
        "tp the config does not ask for": (1, init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))),
    }
    errors = {}
    for name, (tp, mesh) in bad.items():   # both ranks at once: a mesh that is not refused fails here, fast
        try:
            fsdpzero.wrap(build_model("llama"), ds_config(tp), mesh=mesh)
            raise AssertionError(f"{name}: wrap(mesh=...) was not refused")
        except ValueError as e:
            errors[name] = str(e)
    for name, (tp, mesh) in bad.items():   # then each rank alone: the error comes before any collective
        for turn in range(world):
            if rank == turn:
                try:
                    fsdpzero.wrap(build_model("llama"), ds_config(tp), mesh=mesh)
                    raise AssertionError(f"{name}: wrap(mesh=...) was not refused on rank {rank} alone")
                except ValueError as e:
                    assert str(e) == errors[name]
            dist.barrier()
    good = build_parallel_mesh("cpu", (1,), ("dp",), tp=WORLD)
    engine = fsdpzero.initialize(model=build_model("llama"), config=ds_config(WORLD), mesh=good)[0]   # the other door
    q = engine.module.model.layers[0].self_attn.q_proj.weight
    sharded = (type(q).__name__, q.device_mesh.mesh_dim_names, engine.mesh is good)
    given = _first_loss(engine)
    built = _first_loss(fsdpzero.wrap(build_model("llama"), ds_config(WORLD)))
    return errors, sharded, given, built


def test_user_mesh_must_match_autotp_size():
    results = run_distributed(_user_meshes, WORLD, timeout=240)
    errors = results[0][0]
    assert results[1][0] == errors   # the same line on every rank
    assert errors["no tp dimension"] == (
        "tensor_parallel.autotp_size = 2 but the mesh passed in (mesh=...) has no 'tp' dimension ({'dp': 2}): add a "
        "'tp' dimension of size 2 innermost (fsdpzero.parallel.build_parallel_mesh(..., tp=2)) or leave mesh= out "
        "and fsdpzero builds it")
    assert errors["tp of size 1"].startswith(
        "tensor_parallel.autotp_size = 2 but the mesh passed in (mesh=...) has a 'tp' dimension of size 1 "
        "({'dp': 2, 'tp': 1}): give the mesh a 'tp' dimension of size 2")
    assert errors["tp the config does not ask for"].startswith(
        "tensor_parallel.autotp_size = 1 (or absent) but the mesh passed in (mesh=...) has a 'tp' dimension of size "
        "2 ({'dp': 1, 'tp': 2}): set tensor_parallel.autotp_size to 2")
    assert all("\n" not in e for e in errors.values())
    for _, sharded, given, built in results:
        assert sharded == ("DTensor", ("dp", "tp"), True)
        assert abs(given - built) < 1e-6   # the caller's mesh is the one fsdpzero builds
