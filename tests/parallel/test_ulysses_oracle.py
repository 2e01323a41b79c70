"""DeepSpeed 0.19.8's Ulysses (ALST) as the oracle for `sequence_parallel_size`, on 4 forked gloo ranks (DS_ACCELERATOR
=cpu), sp 2 x dp 2, the same Llama (sdpa), data and ds_config as tests/parallel/test_ulysses.py, ZeRO 1, 2 (GA 2) and 3.

DeepSpeed's side is its documented recipe: UlyssesSPAttentionHF.register_with_transformers (sdpa), the mpu it returns
passed to deepspeed.initialize, UlyssesSPDataLoaderAdapter over each rank's DistributedSampler DataLoader, and the
loss weighted by each rank's real tokens over the group. The HF Trainer's copy of that loss
(transformers.integrations.deepspeed.deepspeed_sp_compute_loss) cannot run here: torch.distributed.nn's all_gather
backward on gloo scatters by global rank and fails for the second sp group ("Global rank 0 is not part of group",
torch 2.13), so the same weighted sum is written out below with an all-gather whose backward is the all-reduce of
the ranks' gradients (what NCCL's reduce-scatter gives).

What matches: per-step losses (<= 1e-5; no clipping, so each run's own norm does not change its update). Grad
norms: equal at ZeRO 3; at ZeRO 1 and 2 DeepSpeed's is sp x the unsharded one, because its stage 1/2 reduction
divides the sum over the dp x sp group by dp only (stage_1_and_2.py: `dp_world_size / sequence_parallel_size`),
while fsdpzero's equals the unsharded run's at every stage (test_ulysses.py). Both facts are asserted.
"""
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from tests.engine.test_oracle_deepspeed import _deepspeed
from tests.multirank import run_distributed
from tests.parallel.test_ulysses import MICRO, SP, STEPS, WORLD, _train, dataset, ds_config, model, n_samples

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

# name -> (ZeRO stage, attention, GA, activation checkpointing, sp, tp): DeepSpeed refuses eager under Ulysses
CASES = {"z1": (1, "sdpa", 1, False, SP, 1), "z2": (2, "sdpa", 2, False, SP, 1), "z3": (3, "sdpa", 1, False, SP, 1)}
TOL = 1e-5


class _GatherSum(torch.autograd.Function):
    """all_gather whose backward all-reduces the gradients and keeps this rank's: the reduce-scatter adjoint."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _deepspeed_run(rank, world, cases):
    ds = _deepspeed()
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu_state
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ds.init_distributed("gloo")
    out = {}
    for name, (stage, attn, gas, ac, sp, _) in cases.items():
        m = model(attn)
        mpu = UlyssesSPAttentionHF.register_with_transformers(m, attn, sp, MICRO, seq_length_is_variable=True)
        engine = ds.initialize(model=m, model_parameters=m.parameters(), config=ds_config(stage, gas, ac, sp, 0.0),
                               mpu=mpu)[0]
        group = mpu.get_sequence_parallel_group()
        data = dataset(n_samples(gas, sp))
        loader = DataLoader(data, batch_size=MICRO, sampler=DistributedSampler(data, num_replicas=world, rank=rank))
        it = iter(UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
                                             sp_world_size=sp, device="cpu"))
        losses, norms = [], []
        for _ in range(STEPS):
            total = torch.zeros(())
            for _ in range(gas):
                # the adapter's slices are views on the CPU (its .cpu() copies only from a GPU), which transformers'
                # loss cannot .view(-1): contiguous copies, as a GPU run gets
                batch = {k: v.contiguous() for k, v in next(it).items()}
                shift = batch["shift_labels"]
                local = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=shift,
                               shift_labels=shift).loss
                good = (shift != -100).sum().float()
                losses_g, goods = _GatherSum.apply(local, group), _GatherSum.apply(good, group)
                loss = torch.where(goods > 0, losses_g, torch.zeros_like(losses_g)).mul(goods).sum() / goods.sum()
                engine.backward(loss)
                engine.step()
                total += loss.detach() / gas
            losses.append(total.item())
            norms.append(float(engine.get_global_grad_norm()))
        out[name] = {"losses": losses, "norms": norms}
        engine.destroy()
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa            # register_with_transformers replaced it process-wide
        mpu_state._release_sequence_parallel_groups()     # and its groups are module globals
    return out


def test_ulysses_matches_deepspeed():
    theirs = run_distributed(_deepspeed_run, WORLD, CASES, timeout=900)
    ours = run_distributed(_train, WORLD, CASES, 0.0, timeout=900)
    for name, (stage, *_) in CASES.items():
        for r in range(WORLD):
            t, o = theirs[r][name], ours[r][name]
            for s in range(STEPS):
                assert abs(t["losses"][s] - o["losses"][s]) <= TOL, (name, r, t["losses"], o["losses"])
                factor = 1 if stage == 3 else SP   # DeepSpeed's stage 1/2 average over dp only
                assert abs(t["norms"][s] - factor * o["norms"][s]) <= TOL * factor, (name, r, t["norms"], o["norms"])
