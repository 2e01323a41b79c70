"""Ulysses sequence parallelism (`sequence_parallel_size`), DeepSpeed's ALST: fsdpzero/parallel/ulysses.py.

Parity: 4 forked gloo ranks, sp 2 x dp 2, a real transformers Llama (4 heads, 2 KV heads) in fp32, through
`fsdpzero.initialize(training_data=...)` (the engine's DataLoader: a DistributedSampler over the data replicas, then
the Ulysses adapter), ZeRO 0, 1 (eager attention), 2 (sdpa, GA 2) and 3 (sdpa, activation checkpointing); sp 4 x dp 1
at ZeRO 3 (the 2 KV heads replicated over 4 ranks, as DeepSpeed); sp 2 x tp 2 (AutoTP) at ZeRO 3. 3 optimizer steps
with clipping each, against the unsharded single-process torch run of the same global batch (AdamW +
clip_grad_norm_), whose samples have right padding, -100 prompt labels and micro-batches whose second half holds no
real label (a rank with no token to average, asserted to occur): per-step losses and pre-clip grad norms within 1e-5
(measured: <= 7.2e-7).
The batch and model checks run without ranks; the wrong-head error comes before any process group.
"""
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import fsdpzero
from fsdpzero.config import ConfigError
from fsdpzero.parallel import ulysses
from fsdpzero.plan.translate import build_plan
from fsdpzero.plan.types import Env, SequenceParallelPlan
from tests.engine_cases import ADAMW, SEQ, VOCAB, build_model
from tests.multirank import run_distributed

STEPS, MICRO, WORLD, SP = 3, 2, 4, 2
DP = WORLD // SP
TOL = 1e-5
# name -> (ZeRO stage, attention, gradient accumulation, activation checkpointing, sp, tp); sp 4 replicates the 2 KV
# heads; with tp 2 each tp rank holds 2 heads and 1 KV head, which sp 2 splits (the KV head replicated)
CASES = {"z0": (0, "sdpa", 1, False, SP, 1), "z1": (1, "eager", 1, False, SP, 1),
         "z2": (2, "sdpa", 2, False, SP, 1), "z3": (3, "sdpa", 1, True, SP, 1),
         "z3_sp4": (3, "sdpa", 1, False, 4, 1), "z3_tp2": (3, "sdpa", 2, False, SP, 2)}


def ds_config(stage: int, gas: int = 1, ac: bool = False, sp: int = SP, clip: float = 1.0, tp: int = 1) -> dict:
    """The triad counts world / sp ranks, as DeepSpeed 0.19.8's config (tp ranks counted, as for AutoTP alone)."""
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "train_batch_size": MICRO * gas * WORLD // sp, "gradient_clipping": clip, "steps_per_print": 10 ** 9,
           "sequence_parallel_size": sp,
           "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if ac:
        cfg["activation_checkpointing"] = {}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def model(attn: str = "sdpa"):
    m = build_model("llama")
    m.set_attn_implementation(attn)
    return m


def dataset(n: int, seed: int = 1234) -> list[dict]:
    """Samples of SEQ tokens: even ones real for their first 6 tokens then padding (labels -100: their second half
    has no label), odd ones a 5-token prompt (labels -100) then real tokens to a length of 11..16; global position
    ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        real = 6 if i % 2 == 0 else 11 + i % 6
        ids[real:] = 2
        labels[real:] = -100
        if i % 2:
            labels[:5] = -100
        out.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ)})
    return out


def n_samples(gas: int, sp: int = SP, tp: int = 1) -> int:
    return -(-STEPS * gas // sp) * MICRO * WORLD // tp   # a replica's loader feeds its group every sp micro-steps


# ---------------------------------------------------------------------------------------------------- pure checks
def test_plan_and_triad():
    plan = build_plan(ds_config(2), Env(world_size=WORLD))
    assert plan.sequence_parallel == SequenceParallelPlan(size=SP)
    assert plan.shard.mesh_shape == (WORLD,)          # ZeRO over dp x sp, as DeepSpeed's sequence-data group
    assert plan.batch.train_batch_size == MICRO * DP  # the triad counts world / sp
    fate = {d.key: d for d in plan.decisions}["sequence_parallel_size"]
    assert fate.status == "mapped"
    with pytest.raises(ConfigError, match=r"train_batch_size is not equal to .* 8 != 2 \* 1 \* 2"):
        build_plan({**ds_config(2), "train_batch_size": 8}, Env(world_size=WORLD))
    with pytest.raises(ConfigError, match="sequence_parallel_size: 3 does not divide the world size 4"):
        build_plan({**ds_config(2), "sequence_parallel_size": 3, "train_batch_size": None}, Env(world_size=WORLD))
    off = build_plan({**ds_config(2), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                     Env(world_size=WORLD))
    assert {d.key: d.status for d in off.decisions}["sequence_parallel_size"] == "unsupported"


def test_shard_batch_shifts_then_slices():
    sample = dataset(2)
    batch = {k: torch.stack([s[k] for s in sample]) for k in sample[0]}
    batch["note"] = "kept"
    parts = [ulysses.shard_batch(batch, r, 4) for r in range(4)]
    labels = torch.cat([p["shift_labels"] for p in parts], dim=1)
    assert torch.equal(labels[:, :-1], batch["labels"][:, 1:]) and (labels[:, -1] == -100).all()
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], dim=1), batch["position_ids"])   # global
    assert torch.equal(parts[1]["input_ids"], batch["input_ids"][:, 4:8])
    assert "labels" not in parts[0] and parts[3]["note"] == "kept"
    with pytest.raises(ValueError, match=r"sequence_parallel_size = 3 does not divide the batch's sequence length "
                                         r"16: pad .* e\.g\. 18"):
        ulysses.shard_batch(batch, 0, 3)
    with pytest.raises(ValueError, match="needs `position_ids` in every batch"):
        ulysses.shard_batch({k: v for k, v in batch.items() if k != "position_ids"}, 0, 2)


def test_unsplit_batch_refused():
    sp = ulysses.SequenceParallel(size=2, rank=0, group=None, key="k")
    batch = {k: torch.stack([s[k] for s in dataset(2)]) for k in ("input_ids", "labels", "position_ids")}
    with pytest.raises(ValueError, match="has `labels` but no `shift_labels`, so it was not split"):
        sp.model_inputs(batch)
    with pytest.raises(ValueError, match="called without position_ids"):
        sp.model_inputs({"input_ids": batch["input_ids"]})
    split = sp.model_inputs(ulysses.shard_batch(batch, 0, 2))
    assert split["labels"] is split["shift_labels"]   # transformers' loss reads shift_labels; labels makes it run


def test_model_checks():
    ulysses.check_model(model(), 2)
    ulysses.check_model(model(), 4)   # 2 KV heads replicated over 4 ranks, as DeepSpeed
    with pytest.raises(ValueError, match=r"sequence_parallel_size = 8 does not divide the model's 4 attention heads"):
        ulysses.check_model(model(), 8)
    m = model()
    m.config.num_key_value_heads = 3
    with pytest.raises(ValueError, match="3 KV heads .* neither divides the other"):
        ulysses.check_model(m, 2)
    with pytest.raises(ValueError, match="attn_implementation 'flex_attention'"):
        ulysses.check_model(model("flex_attention"), 2)
    with pytest.raises(ValueError, match="needs a transformers model"):
        ulysses.check_model(torch.nn.Linear(2, 2), 2)
    m = model()
    m._can_set_attn_implementation = lambda: False   # as transformers answers for a model with its own attention code
    with pytest.raises(ValueError, match="does not route its attention through transformers' AttentionInterface"):
        ulysses.check_model(m, 2)


def test_bad_heads_refused_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = {**ds_config(2, sp=8), "train_batch_size": MICRO}
    with pytest.raises(ValueError, match="sequence_parallel_size = 8 does not divide the model's 4 attention heads"):
        fsdpzero.initialize(model=model(), config=cfg)
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------------- parity
def reference(attn: str, gas: int, sp: int = SP, clip: float = 1.0, tp: int = 1) -> tuple[list[float], list[float]]:
    """The unsharded run of the global batches the engine's loader gives: data replica r's (rank r, or tp ranks
    with tp) DistributedSampler batches, each group training on its replicas' batches in order
    (UlyssesSPDataLoaderAdapter)."""
    data = dataset(n_samples(gas, sp, tp))
    replicas = WORLD // tp
    dp = replicas // sp
    per_rank = [list(DistributedSampler(data, num_replicas=replicas, rank=r)) for r in range(replicas)]
    m = model(attn)
    opt = torch.optim.AdamW(m.parameters(), **ADAMW)
    losses, norms, micro = [], [], 0
    for _ in range(STEPS):
        total = 0.0
        for _ in range(gas):
            for g in range(dp):
                src, b = g * sp + micro % sp, micro // sp
                rows = [data[i] for i in per_rank[src][b * MICRO:(b + 1) * MICRO]]
                batch = {k: torch.stack([s[k] for s in rows]) for k in rows[0]}
                loss = m(**batch).loss
                (loss / (gas * dp)).backward()
                total += loss.item() / (gas * dp)
            micro += 1
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def _train(rank, world, cases, clip=1.0):
    out = {}
    for name, (stage, attn, gas, ac, sp, tp) in cases.items():
        engine, _, loader, _ = fsdpzero.initialize(model=model(attn), config=ds_config(stage, gas, ac, sp, clip, tp),
                                                   training_data=dataset(n_samples(gas, sp, tp)))
        assert isinstance(loader, ulysses.UlyssesSPDataLoaderAdapter)
        it = iter(loader)
        losses, norms, empty = [], [], 0
        for _ in range(STEPS):
            total = torch.zeros(())
            for _ in range(gas):
                batch = next(it)
                empty += int((batch["shift_labels"] != -100).sum() == 0)
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                total += loss.detach() / gas
            losses.append(total.item())
            norms.append(float(engine.get_global_grad_norm()))
        out[name] = {"losses": losses, "norms": norms, "empty": empty}
        engine.destroy()
    return out


@pytest.mark.slow
def test_sp2_matches_unsharded():
    results = run_distributed(_train, WORLD, CASES, timeout=600)
    for name, (_, attn, gas, _, sp, tp) in CASES.items():
        ref_losses, ref_norms = reference(attn, gas, sp, tp=tp)
        ranks, span = [r[name] for r in results], sp * tp   # a group of sp replicas: sp x tp consecutive ranks
        for g in range(WORLD // span):   # every rank of a group (and its tp peers) holds its group's loss
            for r in range(g * span, (g + 1) * span):
                assert ranks[r]["losses"] == ranks[g * span]["losses"]
        losses = [sum(ranks[g * span]["losses"][s] for g in range(WORLD // span)) / (WORLD // span)
                  for s in range(STEPS)]
        for s in range(STEPS):
            assert abs(losses[s] - ref_losses[s]) <= TOL, (name, s, losses, ref_losses)
            for r in range(WORLD):
                assert abs(ranks[r]["norms"][s] - ref_norms[s]) <= TOL, (name, s, r, ranks[r]["norms"], ref_norms)
        assert sum(r["empty"] for r in ranks) > 0, "no rank met a slice without real labels"
        assert ref_norms[0] > 1.0   # clipping (1.0) acts: the norm is checked where it matters
