"""World size 8, as on one 8-GPU node: 8 forked gloo ranks on CPU, one spawned job for many modes.

No other CPU test runs more than 4 ranks. Here one 8-rank job runs, through `fsdpzero.initialize` with ds_config
dicts, a tiny fp32 Llama (8 heads, 4 KV heads; 8 KV heads for tp 8) in the modes a DeepSpeed user of an 8-GPU node
sets: ZeRO 1/2/3, hpZ 2/4/8, MiCS 2/4/8 (stage 1 too), CPU offload beside them, `tensor_parallel.autotp_size` 2/4/8
(dp = 8 / tp), `sequence_parallel_size` 2/4/8 and sp x tp. Each mode takes 2 optimizer steps of GA 2 with clipping on
batches with padding and -100 labels (an sp slice can hold no real label); per step the loss (the mean over data
groups of each group's mean over its real tokens) and the pre-clip grad norm are within 1e-5 of the unsharded
single-process torch run (AdamW + clip_grad_norm_) of the same batches, and equal on every rank (measured: <= 1.2e-6).

Checkpoints reshard 8 -> 4 -> 2 and 2 -> 4 -> 8 across layouts (stage-1 flat shards, FSDP2 shards, tp DTensors,
hpZ, MiCS, sp, offload; async saves from the config), one step per world size, and the losses continue the
uninterrupted run's.

Bad input at world 8 (sizes that do not divide 8, heads that sp x tp does not divide, sp x tp beyond the world):
the same one-problem error on all 8 ranks, naming the key, the value and the fix, before any process group exists.
The 8-rank job builds its process group itself (file://) after those checks.

Regressions found here: stage 1 with mics_shard_size crashed (DeviceMesh.get_group() on the 2-D mesh), a
stage-1 checkpoint did not resume under AutoTP (its flat optimizer state could not be cut into FSDP2-over-tp
_StridedShard DTensors), and a stage-1 async save asked by the config (checkpoint.writer.decoupled) failed.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import transformers

import fsdpzero
import fsdpzero.api  # noqa: F401  these before forking: 8 ranks importing them each cost ~10 s of the 2 cores
import fsdpzero.checkpoint.engine_state  # noqa: F401
import fsdpzero.optim.stage1  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
from fsdpzero.parallel import data_rank_and_size
from fsdpzero.parallel.ulysses import shard_batch
from tests.multirank import run_distributed

SEQ, VOCAB, ROWS, GAS, STEPS = 16, 128, 8, 2, 2   # ROWS: rows of one micro-step over all data groups
TOL = 1e-5
ADAMW = {"lr": 5e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}

# name -> ds_config keys of the mode at world 8 (kv: the model's KV heads, 4 unless given)
MODES = {
    "z1": dict(stage=1),
    "z2 offload": dict(stage=2, offload_optimizer=True),
    "z3 hpz2": dict(stage=3, hpz=2),
    "z3 hpz4 offload": dict(stage=3, hpz=4, offload_optimizer=True),
    "z3 hpz8": dict(stage=3, hpz=8),
    "z1 mics4": dict(stage=1, mics=4),
    "z2 mics2": dict(stage=2, mics=2),
    "z3 mics8 offload all": dict(stage=3, mics=8, offload_optimizer=True, offload_param=True),
    "z1 tp2": dict(stage=1, tp=2),
    "z2 tp4": dict(stage=2, tp=4),
    "z3 tp8": dict(stage=3, tp=8, kv=8),
    "z2 sp8": dict(stage=2, sp=8),
    "z3 sp4": dict(stage=3, sp=4),
    "z3 sp4 x tp2 ac": dict(stage=3, sp=4, tp=2, ac=True),
    "z1 sp2 x tp4": dict(stage=1, sp=2, tp=4),
}
# resharding chains: (world, keys) for steps 1, 2, 3; each saves after its step and the next loads that
CHAINS = {
    "8 -> 4 -> 2": [(8, dict(stage=1, mics=4, async_save=True)), (4, dict(stage=3, tp=2, async_save=True)),
                    (2, dict(stage=2, offload_optimizer=True))],
    "8 -> 4 -> 2 (tp, sp)": [(8, dict(stage=3, sp=2, tp=2)), (4, dict(stage=1, mics=2)), (2, dict(stage=3, hpz=2))],
    "2 -> 4 -> 8": [(2, dict(stage=1)), (4, dict(stage=3, tp=4)), (8, dict(stage=3, mics=4))],
}
# bad input at world 8: keys, model KV heads -> what the one error line names (key, value, fix)
BAD = [
    (dict(stage=3, hpz=3), "zero_optimization.zero_hpz_partition_size: 3 does not divide the world size 8",
     "-> use the GPUs per node (8) or 1"),
    (dict(stage=3, mics=3), "zero_optimization.mics_shard_size: 3 does not divide the world size 8",
     "-> use a divisor of the world size"),
    (dict(stage=2, tp=3), "tensor_parallel.autotp_size: 3 does not divide the world size 8",
     "-> use a divisor of the world size"),
    (dict(stage=2, sp=3), "sequence_parallel_size: 3 does not divide the world size 8", "-> use a divisor of 8"),
    (dict(stage=2, sp=4, tp=4), "sequence_parallel_size: 4 does not divide the world size 8 / "
                                "tensor_parallel.autotp_size 4", "-> use a divisor of 2"),
    (dict(stage=2, sp=4, tp=2, heads=4, kv=2), "sequence_parallel_size = 4 x tensor_parallel.autotp_size 2 does not "
                                               "divide the model's 4 attention heads", "use a divisor of 2"),
    (dict(stage=2, tp=8), "tensor_parallel.autotp_size = 8: LlamaForCausalLM has 4 num key value heads",
     "-> use an autotp_size that divides 4"),
]


def model(heads: int = 8, kv: int = 4, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=VOCAB,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg)


def model_of(keys: dict, seed: int = 0) -> torch.nn.Module:
    return model(keys.get("heads", 8), keys.get("kv", 4), seed)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """ids and labels [STEPS + 1, GAS, ROWS, SEQ]: rows real for 5..16 tokens, then padding (-100 labels); odd rows
    a 3-token prompt (-100)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, VOCAB, (STEPS + 1, GAS, ROWS, SEQ), generator=g)
    real = torch.randint(5, SEQ + 1, (STEPS + 1, GAS, ROWS, 1), generator=g)
    pad = torch.arange(SEQ) >= real
    ids = ids.masked_fill(pad, 2)
    labels = ids.masked_fill(pad, -100)
    labels[..., 1::2, :3] = -100
    return ids, labels


def groups_of(world: int, keys: dict) -> int:
    """Data groups: ranks sharing one micro-batch (tp ranks, sp ranks) form one."""
    return max(1, world // (keys.get("tp", 1) * keys.get("sp", 1)))


def ds_config(world: int, keys: dict) -> dict:
    z = {"stage": keys["stage"], "stage3_param_persistence_threshold": 0}
    if keys.get("hpz"):
        z["zero_hpz_partition_size"] = keys["hpz"]
    if keys.get("mics"):
        z["mics_shard_size"] = keys["mics"]
    if keys.get("offload_optimizer"):
        z["offload_optimizer"] = {"device": "cpu"}
    if keys.get("offload_param"):
        z["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": ROWS // groups_of(world, keys), "gradient_accumulation_steps": GAS,
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "zero_optimization": z,
           "optimizer": {"type": "AdamW", "params": dict(ADAMW)}}
    if keys.get("tp", 1) > 1:
        cfg["tensor_parallel"] = {"autotp_size": keys["tp"]}
    if keys.get("sp", 1) > 1:
        cfg["sequence_parallel_size"] = keys["sp"]
    if keys.get("ac"):
        cfg["activation_checkpointing"] = {}
    if keys.get("async_save"):   # written in the background; engine.destroy() completes it
        cfg["checkpoint"] = {"writer": {"decoupled": True}}
    return cfg


def train(engine, keys: dict, steps: range) -> tuple[list[float], list[float]]:
    """Data group g (ranks of one tp / sp group share it) takes rows [g*R, (g+1)*R) of each micro-step; an sp group
    splits them along the sequence (shard_batch, as UlyssesSPDataLoaderAdapter). Per step: the mean over groups of
    the group's loss, and the engine's pre-clip grad norm."""
    ids, labels = data()
    sp, world = keys.get("sp", 1), dist.get_world_size()
    replica = data_rank_and_size(engine.mesh)[0]
    group, rows = replica // sp, ROWS // groups_of(world, keys)
    losses, norms = [], []
    for s in steps:
        total = torch.zeros(())
        for m in range(GAS):
            batch = {"input_ids": ids[s, m, group * rows:(group + 1) * rows],
                     "labels": labels[s, m, group * rows:(group + 1) * rows]}
            if sp > 1:
                batch = shard_batch({**batch, "position_ids": torch.arange(SEQ).expand(rows, SEQ)}, replica % sp, sp)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (GAS * world))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def reference(keys: dict, groupings: list[int]) -> tuple[list[float], list[float]]:
    """The unsharded run: at step s the mean of the groupings[s] groups' mean losses, AdamW + clip_grad_norm_."""
    ids, labels = data()
    m = model_of(keys)
    opt = torch.optim.AdamW(m.parameters(), **{**ADAMW, "betas": tuple(ADAMW["betas"])})
    losses, norms = [], []
    for s, groups in enumerate(groupings):
        total, rows = 0.0, ROWS // groups
        for micro in range(GAS):
            for g in range(groups):
                part = slice(g * rows, (g + 1) * rows)
                loss = m(input_ids=ids[s, micro, part], labels=labels[s, micro, part]).loss / (GAS * groups)
                loss.backward()
                total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def _chain_step(rank, world, ckpt, index, names):
    """Step `index` of the chains `names` (run at this world size): load the previous step's checkpoint, train,
    save."""
    out = {}
    for name in names:
        keys = CHAINS[name][index][1]
        engine = fsdpzero.initialize(model=model_of(keys, seed=index), config=ds_config(world, keys))[0]
        if index:
            engine.load_checkpoint(f"{ckpt}/{name}", tag=f"step{index}")
        out[name] = train(engine, keys, range(index, index + 1))
        engine.save_checkpoint(f"{ckpt}/{name}", tag=f"step{index + 1}")
        engine.destroy()
    return out


def _world8(rank, world, ckpt, rendezvous):
    out = {"bad": []}
    for keys, _, _ in BAD:   # before any process group: the launcher's environment only
        try:
            fsdpzero.initialize(model=model_of(keys), config=ds_config(world, keys))
            out["bad"].append("no error")
        except Exception as e:   # noqa: BLE001  whatever it is, the assertions below say what was wrong
            out["bad"].append(f"{type(e).__name__}: {e}")
        out["bad"].append(dist.is_initialized())
        if dist.is_initialized():   # the error came after fsdpzero joined the group (env://): leave it for the next
            dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    for name, keys in MODES.items():
        engine = fsdpzero.initialize(model=model_of(keys), config=ds_config(world, keys))[0]
        out[name] = train(engine, keys, range(STEPS))
        engine.destroy()
    for index in range(3):   # the chain steps that run at world 8
        names = [name for name, links in CHAINS.items() if links[index][0] == world]
        out.update({f"{name} step {index}": v for name, v in _chain_step(rank, world, ckpt, index, names).items()})
    return out


def test_world_8(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    chained = {name: [None] * 3 for name in CHAINS}

    def run_chain_steps(world, index, direction):
        names = [name for name, links in CHAINS.items() if links[index][0] == world and
                 (links[0][0] < links[-1][0]) == (direction == "up")]
        for name, v in run_distributed(_chain_step, world, ckpt, index, names, timeout=300)[0].items():
            chained[name][index] = v

    run_chain_steps(2, 0, "up")   # 2 -> 4 -> 8 starts
    run_chain_steps(4, 1, "up")
    results = run_distributed(_world8, 8, ckpt, str(tmp_path / "rendezvous"), timeout=600, init_pg=False)
    for name in CHAINS:
        for index in range(3):
            if f"{name} step {index}" in results[0]:
                chained[name][index] = results[0][f"{name} step {index}"]
    run_chain_steps(4, 1, "down")   # 8 -> 4 -> 2 goes on
    run_chain_steps(2, 2, "down")

    # bad input: the same one-problem error on every rank, key, value and fix named, no process group
    for r in results:
        assert r["bad"] == results[0]["bad"], "ranks disagree on the bad-input errors"
    for (keys, what, fix), (message, pg) in zip(BAD, zip(results[0]["bad"][::2], results[0]["bad"][1::2])):
        assert not pg, (keys, "a process group existed after the error")
        assert message.startswith(("ConfigError: ", "ValueError: ")), (keys, message)
        problem = [line for line in message.splitlines() if what in line]
        assert len(problem) == 1 and fix in problem[0], (keys, message)
        assert len(message.splitlines()) <= 2, message   # "invalid DeepSpeed config (1 problem):" + the problem

    report = {}
    for name, keys in MODES.items():
        for r in results:   # every rank holds the same losses and norms
            assert r[name] == results[0][name], (name, "ranks differ")
        ref = reference(keys, [groups_of(8, keys)] * STEPS)
        losses, norms = results[0][name]
        report[name] = (max(abs(a - b) for a, b in zip(losses, ref[0])),
                        max(abs(a - b) for a, b in zip(norms, ref[1])))
    for name, links in CHAINS.items():
        got = chained[name]
        assert all(step is not None for step in got), (name, got)
        ref = reference(links[0][1], [groups_of(w, keys) for w, keys in links])
        report[name] = (max(abs(got[i][0][0] - ref[0][i]) for i in range(3)),
                        max(abs(got[i][1][0] - ref[1][i]) for i in range(3)))
    print(report)
    bad = {name: d for name, d in report.items() if max(d) > TOL}
    assert not bad, bad
    assert reference(MODES["z1"], [8])[1][0] > 1.0   # clipping (1.0) acts: the norm is checked where it matters
