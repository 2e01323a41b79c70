"""Shared pieces of the engine tests: tiny HF models from configs, deterministic token batches, hand-built plans,
and the unsharded single-process reference loop (plain torch: AdamW + clip_grad_norm_)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from fsdpzero.plan import (ActivationCheckpointPlan, BatchPlan, LossScalePlan, OptimizerPlan, Plan, PrecisionPlan,
                           ShardPlan)

SEQ = 16
VOCAB = 128
LR = 5e-4   # Adam moves a weight by ~lr whatever its grad size: at 1e-3 one near-zero-grad element drifted 1.05e-5
ADAMW = {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def build_model(kind: str, seed: int = 0, device: str | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    ctx = torch.device(device) if device else torch.device("cpu")
    with ctx:
        if kind == "llama":
            cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                              bos_token_id=0, eos_token_id=1, pad_token_id=2)
            cfg._attn_implementation = "eager"
            return LlamaForCausalLM(cfg)
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
        cfg._attn_implementation = "eager"
        return GPT2LMHeadModel(cfg)


def batches(steps: int, gas: int, global_micro: int, seed: int = 1234) -> torch.Tensor:
    """[steps, gas, global_micro, SEQ] token ids; rank r of w takes rows r*m:(r+1)*m of each micro-step."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (steps, gas, global_micro, SEQ), generator=g)


def make_plan(stage: int = 3, dtype: str = "float32", gas: int = 1, world: int = 2, micro: int = 2,
              mesh: tuple[int, ...] | None = None, hpz: int | None = None, clip: float = 1.0,
              reduce_dtype: str = "float32", fp16: LossScalePlan | None = None, opt: str = "adamw",
              opt_params: dict | None = None, ac: bool = False, ac_cpu: bool = False, **batch_extra) -> Plan:
    raf: bool | int = (hpz if hpz else True) if stage == 3 else False
    shard = ShardPlan(stage=stage, reshard_after_forward=raf, mesh_shape=mesh or (world,),
                      mesh_dim_names=("replicate", "shard") if mesh else ("dp",), param_persistence_threshold=0)
    precision = PrecisionPlan(param_dtype=dtype, reduce_dtype=reduce_dtype, loss_scale=fp16,
                              check_grad_overflow=dtype == "bfloat16")
    return Plan(shard=shard, precision=precision,
                activation_checkpointing=ActivationCheckpointPlan(enabled=ac, cpu_checkpointing=ac_cpu),
                optimizer=OptimizerPlan(type=opt, params=dict(ADAMW if opt_params is None else opt_params)),
                batch=BatchPlan(train_batch_size=micro * gas * world, micro_batch_size=micro,
                                gradient_accumulation_steps=gas, gradient_clipping=clip, **batch_extra))


REFERENCE_OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}


def reference_trace(kind: str, data: torch.Tensor, clip: float, opt: str = "adamw",
                    opt_params: dict | None = None) -> dict:
    """Unsharded, one process, the whole global micro-batch at once: plain torch (the torch optimizer `opt` with
    make_plan's hyperparameters, clip_grad_norm_), sharing no code with fsdpzero. Per step: the mean loss and the
    pre-clip global norm; at the end: the parameters and the optimizer's state by parameter name (flattened fp32)."""
    model = build_model(kind)
    fused = {"fused": True} if opt == "adamw" else {}
    opt = REFERENCE_OPTIMIZERS[opt](model.parameters(), **dict(ADAMW if opt_params is None else opt_params), **fused)
    losses, norms = [], []
    gas = data.shape[1]
    for step in data:
        total = 0.0
        for micro in step:
            loss = model(input_ids=micro, labels=micro).loss
            (loss / gas).backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(total / gas)
    names = {p: n for n, p in model.named_parameters()}
    state = {names[p]: {k: v.detach().float().reshape(-1).clone() for k, v in st.items() if k != "step"}
             for p, st in opt.state.items()}
    return {"losses": losses, "norms": norms, "state": state,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def reference_run(kind: str, data: torch.Tensor, clip: float) -> tuple[list[float], dict]:
    """reference_trace's losses and final parameters."""
    ref = reference_trace(kind, data, clip)
    return ref["losses"], ref["params"]


def engine_losses(engine, data: torch.Tensor, rank: int, world: int, norms: list | None = None) -> list[float]:
    """Run the DeepSpeed-style loop; per optimizer step, the loss averaged over micro-steps and ranks (and, into
    `norms` when given, the engine's reported pre-clip global grad norm)."""
    m = data.shape[2] // world
    losses = []
    for step in data:
        acc = torch.zeros(())
        for micro in step:
            x = micro[rank * m:(rank + 1) * m]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            acc += loss.detach().float().cpu()
        acc /= data.shape[1]
        dist.all_reduce(acc, op=dist.ReduceOp.AVG)
        losses.append(acc.item())
        if norms is not None:
            norms.append(engine.get_global_grad_norm())
    return losses


def optimizer_state(engine) -> dict:
    """The engine's optimizer state by parameter name, each entry (exp_avg, exp_avg_sq, and the fp32 master where
    the path keeps one apart from the model) gathered whole and flattened to fp32 on CPU (collective)."""
    out = {}
    for name, st in engine.grad_path.state_dict()["state"].items():
        out[name] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu().reshape(-1)
                     for k, v in st.items() if k != "step" and torch.is_tensor(v)}
    return out


def state_diffs(got: dict, ref: dict, keys=("exp_avg", "exp_avg_sq")) -> dict:
    """Per parameter and moment: max |got - ref| relative to max |ref| (Adam's moments scale with the gradient, so a
    gradient-scale bug shows as a relative error of order 1)."""
    assert set(got) == set(ref), set(got) ^ set(ref)
    out = {}
    for name in ref:
        for k in keys:
            a, b = got[name][k], ref[name][k]
            out[f"{name}.{k}"] = ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
    return out


def full_params(model) -> dict:
    """Every rank's copy of the full (unsharded) fp32 parameters, on CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu().clone()
            for k, v in sd.items()}
