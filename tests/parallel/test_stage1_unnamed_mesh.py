"""ZeRO stage 1 with a 2-D mesh the caller built without dimension names (wrap(mesh=init_device_mesh("cpu", (1, 2))),
as FSDP2's HSDP accepts one): the stage-1 optimizer shards over every data rank of the mesh, which torch flattens
only for a named mesh ("Cannot flatten a DeviceMesh without mesh_dim_names!" after the process group was up). An
unnamed mesh holds data dimensions only (check_user_mesh asks a "tp" dimension by name), so over the whole world its
flat group is the default one. 2 forked gloo ranks, tiny GPT-2: 2 steps with the unnamed mesh and with the same mesh
named ("replicate", "shard") against the unsharded torch run (AdamW + clip_grad_norm_): losses and final weights
within 1e-5 (two steps move the loss ~1e-2)."""
import transformers  # noqa: F401  imported before forking the ranks
import torch

from fsdpzero.api import wrap
from tests.engine_cases import batches, build_model, engine_losses, full_params, make_plan, reference_run
from tests.multirank import run_distributed

TOL = 1e-5


def _rank(rank, world, data):
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    for names in (None, ("replicate", "shard")):
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=names)
        engine = wrap(build_model("gpt2"), make_plan(stage=1, world=world), mesh=mesh)
        out[names] = engine_losses(engine, data, rank, world), full_params(engine.module)
    return out


def test_stage1_trains_on_a_two_dimensional_mesh_without_names():
    data = batches(2, 1, 2 * 2)
    ref_losses, ref_params = reference_run("gpt2", data, 1.0)
    assert abs(ref_losses[1] - ref_losses[0]) > 100 * TOL   # the steps move the loss far past the tolerance
    results = run_distributed(_rank, 2, data, timeout=240)
    for names, (losses, params) in results[0].items():
        assert losses == results[1][names][0], names
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL, (names, losses, ref_losses)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{names} {k}: {m}")
