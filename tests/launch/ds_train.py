"""A DeepSpeed training script, the same file for both libraries: under `fsdpzero launch` its `import deepspeed` is
fsdpzero (the shim), under `fsdpzero launch --no_shim` it is DeepSpeed 0.19.8 itself (DS_ACCELERATOR=cpu). Each rank
writes out/rank<RANK>.json: its launcher environment, the per-step global mean losses and grad norms, and the ranks
of its ZeRO++ hpZ / MiCS shard group (tests/launch/test_multinode.py)."""
import argparse
import json
import os

import torch
import torch.distributed as dist
import transformers

import deepspeed
import fsdpzero.dist  # noqa: F401  the exit hand-over of the GIL to gloo's workers, for DeepSpeed's run too

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)     # DeepSpeed's launchers pass it
p.add_argument("--deepspeed_config", required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=5)
args = p.parse_args()

real = not deepspeed.__version__.endswith("+fsdpzero")
if real:   # DeepSpeed JIT-builds a shared-memory all-reduce for inference on CPU at init (~40 s); training needs none
    import importlib
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
with open(args.deepspeed_config) as f:
    config = json.load(f)

torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

micro = config["train_micro_batch_size_per_gpu"]
g = torch.Generator().manual_seed(1234)
data = [torch.randint(0, 128, (micro, 16), generator=g) for _ in range(args.steps * world)]
losses, norms = [], []
for step in range(args.steps):
    x = data[step * world + rank]                 # rank r: micro-batch r of each global batch, either library
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    losses.append(total.item() / world)
    norms.append(float(engine.get_global_grad_norm()))

groups = {}
if real:
    from deepspeed.utils import groups as ds_groups
    hpz = ds_groups._get_zero_param_intra_parallel_group()
    if hpz is not None:
        groups["hpz"] = dist.get_process_group_ranks(hpz)
else:
    from fsdpzero import fsdp2_internals
    if "shard" in (engine.mesh.mesh_dim_names or ()):
        groups["shard"] = dist.get_process_group_ranks(engine.mesh["shard"].get_group())
    block = type(engine.module.model.layers[0])
    posts = [g.post_forward_mesh_info for unit in fsdp2_internals.fsdp_units(engine.module)
             if isinstance(unit, block) for g in fsdp2_internals.param_groups(unit)]
    hpz = {tuple(dist.get_process_group_ranks(p.shard_process_group)) for p in posts if p is not None}
    assert posts and len(hpz) <= 1, hpz       # every block reshards to the same group after forward
    if hpz:
        groups["hpz"] = list(hpz.pop())
env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                      "MASTER_ADDR", "MASTER_PORT", "TEST_NODE")}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"env": env, "argv_local_rank": args.local_rank, "losses": losses, "norms": norms, "groups": groups,
               "library": "deepspeed" if real else "fsdpzero"}, f)
dist.destroy_process_group()
