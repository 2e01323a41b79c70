"""`bf16.bf16_optimizer_states` (with the bf16_master_weights_and_grads it requires): bf16 Adam moments, against
DeepSpeed itself on the same run (CPU oracle, 2 gloo ranks, ZeRO 2): the moments are bf16 on both sides and take the
same bytes per rank (half of fp32 moments), and losses and final parameters agree within bf16 tolerance."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.engine.test_oracle_deepspeed import MICRO, SCHEDULERS, SEQ, VOCAB, WORLD, _config, _deepspeed, oracle_engine
from tests.multirank import run_distributed

pytestmark = [pytest.mark.oracle, pytest.mark.slow]
STEPS = 6
# Both sides keep bf16 weights and moments; DeepSpeed steps torch's foreach AdamW, fsdpzero the fused kernel (fp32
# math inside, one rounding per tensor), so parameters may differ by an ulp of bf16 (2^-8 relative) and losses by
# what that moves.
LOSS_TOL, PARAM_TOL = 5e-4, 2e-3     # seen: 7.4e-5 and 4.9e-4 (6 steps, tiny Llama)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _train(rank, world, library, config):
    engine = oracle_engine(library, config)
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(STEPS * world)]
    losses = []
    for step in range(STEPS):
        x = data[step * world + rank]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    inner = engine.optimizer.optimizer if library == "deepspeed" else engine.optimizer
    moments = [_local(v) for s in inner.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
              for n, p in engine.module.named_parameters()}
    return dict(losses=losses, dtypes={str(m.dtype) for m in moments},
                state_bytes=sum(m.numel() * m.element_size() for m in moments),
                state_numel=sum(m.numel() for m in moments), params=params)


def test_bf16_optimizer_states_match_deepspeed():
    _deepspeed()
    cfg = _config(2, 1, SCHEDULERS["WarmupLR"], clip=1.0,
                  bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True})
    ds = run_distributed(_train, WORLD, "deepspeed", cfg, timeout=300)
    ours = run_distributed(_train, WORLD, "fsdpzero", cfg, timeout=300)
    for r in range(WORLD):
        assert ours[r]["dtypes"] == ds[r]["dtypes"] == {"torch.bfloat16"}
        # bytes of Adam moments on this rank: 2 bytes an element, both sides (fp32 moments would be twice this)
        assert ours[r]["state_bytes"] == 2 * ours[r]["state_numel"]
    n_params = sum(p.numel() for p in ours[0]["params"].values())
    # each side's moments, summed over ranks, cover the model once: 2 moments x 2 bytes x parameters (DeepSpeed pads
    # its flat partition to an alignment, so it may hold a few more elements)
    ours_total, ds_total = sum(o["state_bytes"] for o in ours), sum(d["state_bytes"] for d in ds)
    assert ours_total == 2 * 2 * n_params
    assert 0 <= ds_total - ours_total <= 2 * 2 * 64 * WORLD, (ds_total, ours_total)
    for step, (a, b) in enumerate(zip(ds[0]["losses"], ours[0]["losses"])):
        assert abs(a - b) <= LOSS_TOL, f"step {step}: deepspeed {a} vs fsdpzero {b}"
    worst = max((ds[0]["params"][n] - ours[0]["params"][n]).abs().max().item() for n in ds[0]["params"])
    assert worst <= PARAM_TOL, worst
    print(f"\nbf16 moments per run: fsdpzero {ours_total} B, DeepSpeed {ds_total} B (fp32 would be "
          f"{2 * ours_total} B); worst param diff {worst:.2e}, losses {ours[0]['losses']} vs {ds[0]['losses']}")
