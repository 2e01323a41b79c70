"""The GPU loss-parity cases shared by tests/generators/make_ds_golden.py (DeepSpeed writes the golden curves) and
tests/engine/test_gpu_golden.py (fsdpzero must follow them): a small Llama built from a config, fixed token batches, one
ds_config per case, and the DeepSpeed-shaped loop both engines run unchanged.

The data is a pool of POOL batches per rank cycled over the steps, so the model memorises it and the loss falls
far (a flat curve would agree with anything)."""
from __future__ import annotations

import torch
import torch.distributed as dist

STEPS, POOL, WORLD = 40, 2, 2
MICRO, SEQ, VOCAB = 4, 128, 2048
GOLDEN = "tests/assets/ds_golden_gpu.json"


def build_model(device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=688, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    with device:
        return LlamaForCausalLM(cfg).float()


def ds_config(stage: int, dtype: str, ga: int = 1, offload: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ga, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                     "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 5}},
           "zero_optimization": {"stage": stage}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return cfg


# name -> ds_config; fp32 runs with TF32 off on both sides
CASES = {f"z{s}_{d}": ds_config(s, d) for s in (1, 2, 3) for d in ("fp32", "bf16", "fp16")}
CASES["z2_bf16_ga4"] = ds_config(2, "bf16", ga=4)
CASES["z2_bf16_offload"] = ds_config(2, "bf16", offload=True)


def batches(rank: int, ga: int, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(77 + rank)
    return [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g).to(device) for _ in range(POOL * ga)]


def train(engine, rank: int, ga: int, device) -> dict:
    """STEPS optimizer steps of the DeepSpeed loop; per step the loss averaged over micro-steps and ranks, and the
    engine's global grad norm (None where the step overflowed)."""
    pool = batches(rank, ga, device)
    losses, norms = [], []
    for step in range(STEPS):
        acc = torch.zeros((), device=device)
        for micro in range(ga):
            x = pool[(step * ga + micro) % len(pool)]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            acc += loss.detach().float() / ga
        dist.all_reduce(acc, op=dist.ReduceOp.AVG)
        losses.append(acc.item())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    return {"losses": losses, "grad_norms": norms}
