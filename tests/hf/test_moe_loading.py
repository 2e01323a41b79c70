"""Sharded loading of MoE models whose checkpoints transformers 5 converts while loading (per-expert w1/w2/w3 or
gate/up/down weights fused into one (experts, ...) tensor): HfDeepSpeedConfig(stage 3) + from_pretrained, and
zero.Init + from_pretrained, then initialize, give the same weights as a plain from_pretrained, bit for bit
(torch.equal on every parameter, gathered from the shards). Tiny local Mixtral (3 experts: an uneven split over 2
ranks) and Qwen3-MoE (tied embeddings) configs, random init saved with save_pretrained; 1 rank and 2 gloo ranks.
Also the base model (MixtralModel, Qwen3MoeModel) from the *ForCausalLM checkpoint: its `model.` prefix dropped.
Before fsdpzero.hf.zero3.load_converted_safetensors, the HfDeepSpeedConfig path stopped with a KeyError naming the
fused tensors (docs/inference.md's former limit)."""
from __future__ import annotations

import pytest
import torch
import transformers

from tests.multirank import run_distributed

MODELS = {
    "mixtral": (transformers.MixtralConfig, "MixtralForCausalLM", dict(num_local_experts=3, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                       head_dim=8, tie_word_embeddings=True)),
}
ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _save(root, name):
    config_cls, cls_name, extra = MODELS[name]
    cfg = config_cls(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    getattr(transformers, cls_name)(cfg).save_pretrained(root / name)
    return root / name


def _job(rank, world, paths):
    import fsdpzero
    import fsdpzero.hf
    from torch.distributed.tensor import DTensor

    from fsdpzero.hf import HfDeepSpeedConfig
    out = {}
    for name, path in paths.items():
        cls = getattr(transformers, MODELS[name][1])
        for mode in ("hf", "zero_init"):
            if mode == "hf":
                dschf = HfDeepSpeedConfig(ZERO3)   # noqa: F841  alive while from_pretrained runs
                model = cls.from_pretrained(path)
                del dschf
            else:
                with fsdpzero.zero.Init():
                    model = cls.from_pretrained(path)
            engine = fsdpzero.initialize(model=model, config_params=ZERO3)[0]
            out[name, mode] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                               for n, p in engine.module.named_parameters()}
        # fsdpzero.hf.from_pretrained (meta build, wrap, each rank reads its shard): the same conversion
        engine = fsdpzero.hf.from_pretrained(path, {**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}},
                                             model_class=cls)
        out[name, "engine"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                               for n, p in engine.module.named_parameters()}
        # the base model from the *ForCausalLM checkpoint: the `model.` prefix dropped, as transformers does
        dschf = HfDeepSpeedConfig(ZERO3)   # noqa: F841
        model = getattr(transformers, MODELS[name][1].replace("ForCausalLM", "Model")).from_pretrained(path)
        del dschf
        engine = fsdpzero.initialize(model=model, config_params=ZERO3)[0]
        out[name, "base"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                             for n, p in engine.module.named_parameters()}
    return out


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_moe_sharded_loading_equals_plain_load(tmp_path, world):
    paths = {name: str(_save(tmp_path, name)) for name in MODELS}
    got = run_distributed(_job, world, paths, timeout=300)
    for name, path in paths.items():
        plain = getattr(transformers, MODELS[name][1]).from_pretrained(path)
        base = getattr(transformers, MODELS[name][1].replace("ForCausalLM", "Model")).from_pretrained(path)
        assert any(p.dim() == 3 for p in plain.parameters())   # the fused (experts, ...) tensors are there
        for rank_result in got:
            for mode in ("hf", "zero_init", "engine", "base"):
                ref = dict((base if mode == "base" else plain).named_parameters())
                loaded = rank_result[name, mode]
                assert set(loaded) == set(ref), (name, mode, set(loaded) ^ set(ref))
                unequal = [n for n in ref if not torch.equal(ref[n].detach(), loaded[n])]
                assert not unequal, (name, mode, unequal)


# ---- expert_parallel (DeepSpeed 0.19.8's AutoEP): an honest `unsupported` when enabled ---------------------------

def _autoep_job(rank, world, path):
    import torch.distributed as dist

    import fsdpzero
    model = transformers.MixtralForCausalLM.from_pretrained(path)
    cfg = {**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}}
    try:
        fsdpzero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        refused = None
    except ValueError as e:
        refused = str(e)
    touched = dist.is_initialized()   # the refusal comes before any process group
    off = {**cfg, "expert_parallel": {"enabled": False, "autoep_size": 2}}   # DeepSpeed reads nothing else then
    engine = fsdpzero.initialize(model=model, model_parameters=model.parameters(), config=off)[0]
    ids = torch.randint(0, 64, (1, 8))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return refused, touched, float(loss)


def test_autoep_enabled_is_unsupported_with_the_reason(tmp_path):
    from fsdpzero.plan import Env
    from fsdpzero.plan.translate import build_plan
    on = build_plan({**ZERO3, "expert_parallel": {"enabled": True, "autoep_size": 2}}, Env(world_size=2, nodes=1))
    (fate,) = [d for d in on.decisions if d.key == "expert_parallel"]
    assert fate.status == "unsupported" and "all-to-all" in fate.detail and "enabled false" in fate.detail
    off = build_plan({**ZERO3, "expert_parallel": {"enabled": False, "autoep_size": 2}}, Env(world_size=2, nodes=1))
    (fate,) = [d for d in off.decisions if d.key == "expert_parallel"]
    assert fate.status == "noop" and not off.unsupported
    refused, touched, loss = run_distributed(_autoep_job, 1, str(_save(tmp_path, "mixtral")), init_pg=False,
                                             timeout=300)[0]
    assert refused is not None and "expert_parallel" in refused and "AutoEP" in refused and not touched
    assert loss == loss   # the same model and config with enabled false trains


def _wrong_experts_job(rank, world, path):
    import fsdpzero
    from fsdpzero.hf import HfDeepSpeedConfig
    dschf = HfDeepSpeedConfig(ZERO3)   # noqa: F841
    model = transformers.MixtralForCausalLM.from_pretrained(path)
    try:
        fsdpzero.initialize(model=model, config_params=ZERO3)
    except ValueError as e:
        return str(e)
    return None


def test_moe_checkpoint_missing_an_expert_is_one_line(tmp_path):
    """A checkpoint whose files lack expert 2 of 3 (the router still says 3): one ValueError naming the fused tensor
    and both shapes, on every rank (each rank reads only its experts, so the count is checked against the model's,
    not left to a short read on the rank that holds expert 2)."""
    from safetensors.torch import load_file, save_file
    path = _save(tmp_path, "mixtral")
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".experts.2." not in k}, path / "model.safetensors",
              metadata={"format": "pt"})
    errors = run_distributed(_wrong_experts_job, 2, str(path), timeout=300)
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert "size mismatch for model.layers.0.mlp.experts" in errors[0] and "\n" not in errors[0], errors[0]
    assert "(2, " in errors[0] and "(3, " in errors[0], errors[0]
