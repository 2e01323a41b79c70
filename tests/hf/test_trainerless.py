"""The Hugging Face guide's Trainer-less path on 2 gloo ranks: its t0 inference script with only the imports changed
(HfDeepSpeedConfig kept alive, from_pretrained, initialize(config_params=...), generate(synced_gpus=True), ZeRO-3 +
CPU offload, ranks generating different lengths) against a plain single-process model; `zero.Init` builds against
plain builds with the same seed; `GatheredParameters` edits against the same edit on a plain model. One forked
pair of ranks runs every case (module fixture); each test checks one part of what it returned."""
from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import runpy
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, ByT5Tokenizer, LlamaConfig, T5Config

from fsdpzero.hf.zero3 import routing_installed
from tests.multirank import run_distributed

ROOT = Path(__file__).resolve().parents[2]
T0_SCRIPT = ROOT / "examples" / "zero_inference_t0.py"
TEXTS = ("Is this review positive or negative? Review: this is the best cast iron skillet you will ever buy",
         "Is this review positive or negative? Review: this is the worst restaurant ever")
OFFLOAD = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
LLAMA = dict(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


def _t5(path: Path) -> None:
    """A small T5 (the guide's T0 is one) with a byte tokenizer, saved as a local from_pretrained folder. Its
    generation config stops on a token rank 0's answer reaches early and rank 1's never does, so the two ranks
    generate different lengths and rank 0 must keep stepping forwards for rank 1."""
    cfg = T5Config(vocab_size=259, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, pad_token_id=0,
                   eos_token_id=1, decoder_start_token_id=0, initializer_factor=3.0)   # varied tokens, not all pad
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(cfg).eval()
    tok = ByT5Tokenizer()
    outs = [model.generate(tok.encode(t, return_tensors="pt"), max_new_tokens=19, do_sample=False)[0].tolist()
            for t in TEXTS]
    stop = next(t for t in outs[0][2:6] if t not in outs[1])
    model.generation_config.eos_token_id = stop
    model.save_pretrained(path)
    tok.save_pretrained(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainerless")
    _t5(root / "t5")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA)).save_pretrained(root / "llama")
    (root / "offload.json").write_text(json.dumps(OFFLOAD))
    return root


class Net(nn.Module):
    """A hand-written model whose __init__ re-initialises its children through apply (after they were built)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 50, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.05)

    def forward(self, x):
        return self.head(self.body(self.emb(x)) * self.scale)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _full(params) -> list[torch.Tensor]:
    from fsdpzero.zero import GatheredParameters
    out = []
    for p in params:
        with GatheredParameters(p):
            out.append(p.detach().clone())
    return out


def _t0(rank, world, folder):
    """The guide's script, run as a program on this rank."""
    os.environ["T0_MODEL"] = str(folder)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        g = runpy.run_path(str(T0_SCRIPT), run_name="__main__")
    res = {"outputs": g["outputs"].tolist(), "printed": printed.getvalue(),
           "local_share": sum(p.to_local().numel() for p in g["model"].parameters())
           / sum(p.numel() for p in g["model"].parameters())}
    del g
    gc.collect()            # the script's HfDeepSpeedConfig goes: from_pretrained is transformers' own again
    res["restored"] = not routing_installed()
    return res


def _offload_generate(rank, world, folder, config_path):
    """initialize(config_params=<path>) with offload_param and offload_optimizer on the CPU, a causal LM; the model
    from_pretrained returned holds no weights at all."""
    import fsdpzero as deepspeed
    from fsdpzero.hf import HfDeepSpeedConfig
    dschf = HfDeepSpeedConfig(config_path)
    model = AutoModelForCausalLM.from_pretrained(folder)
    meta = all(p.is_meta for p in model.parameters())
    engine = deepspeed.initialize(model=model, config_params=config_path)[0]
    engine.module.eval()
    prompt = torch.tensor([[5 + rank, 17, 42, 99 + rank][:3 + rank]])
    with torch.no_grad():
        out = engine.module.generate(prompt, synced_gpus=True, max_new_tokens=2 + 6 * rank, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
    try:
        engine.step()
        step_error = None
    except RuntimeError as e:
        step_error = str(e)
    del dschf
    return {"meta": meta, "prompt": prompt.tolist(), "out": out.tolist(), "step_error": step_error,
            "offload": type(engine.optimizer).__name__, "grad_path": type(engine.grad_path).__name__}


def _init_and_gather(rank, world):
    import fsdpzero as deepspeed
    from fsdpzero.zero import GatheredParameters
    from torch.distributed.tensor import DTensor
    res = {}
    x = torch.tensor([[5, 17, 3, 42, 4]])
    cases = (("llama", lambda: AutoModelForCausalLM.from_config(LlamaConfig(**{**LLAMA, "tie_word_embeddings":
                                                                                False})), 3),
             ("net", Net, 0))
    for name, build, stage in cases:
        torch.manual_seed(0)
        with deepspeed.zero.Init():
            model = build()
        torch.manual_seed(0)
        plain = build()
        held = [p.untyped_storage().nbytes() for p in model.parameters()]
        before = _full(model.parameters())
        plain_before = [p.detach().clone() for p in plain.parameters()]
        same = len(before) == len(plain_before) > 3 and all(torch.equal(a, b) for a, b in zip(before, plain_before))
        emb, plain_emb = ((m.get_input_embeddings() if name == "llama" else m.emb) for m in (model, plain))
        # an edit before initialize: rank 0 re-initialises row 3 (the other rank draws something else, unused)
        with GatheredParameters(emb.weight, modifier_rank=0):
            torch.manual_seed(100 + rank)
            emb.weight.data[3].normal_()
        torch.manual_seed(100)
        plain_emb.weight.data[3].normal_()
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine = deepspeed.initialize(model=model, config_params=config)[0]
        with torch.no_grad():
            fwd = (_logits(engine(x)) - _logits(plain(x))).abs().max().item()
        # an edit on the FSDP2 shards: a single parameter, then read back through a list
        emb = engine.module.get_input_embeddings() if name == "llama" else engine.module.emb
        with GatheredParameters(emb.weight, modifier_rank=0):
            if rank == 0:
                torch.manual_seed(7)
                emb.weight.data[4].normal_()
        sharded = isinstance(emb.weight, DTensor)     # after the context: the shards are registered again
        torch.manual_seed(7)
        plain_emb.weight.data[4].normal_()
        with GatheredParameters([emb.weight], modifier_rank=None):
            after = emb.weight.detach().clone()
            emb.weight.data.zero_()             # modifier_rank=None: dropped, the shards keep their values
        with torch.no_grad():
            fwd_after = (_logits(engine(x)) - _logits(plain(x))).abs().max().item()
        res[name] = {"held_bytes": max(held), "same_weights": same, "fwd": fwd, "row4": after[4].tolist(),
                     "edit_equal": torch.equal(after, plain_emb.weight), "fwd_after": fwd_after,
                     "sharded": sharded}
    # models whose init writes a child's parameter from the parent (GPT-2's c_proj, T5's attention): the plain
    # build's weights all the same (found by review: a RuntimeError on the held placeholders)
    from transformers import GPT2Config
    for name, build in (("gpt2", lambda: AutoModelForCausalLM.from_config(GPT2Config(
            vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16))),
            ("t5", lambda: AutoModelForSeq2SeqLM.from_config(T5Config(
                vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)))):
        torch.manual_seed(0)
        with deepspeed.zero.Init():
            model = build()
        torch.manual_seed(0)
        plain = build()
        got = _full(model.parameters())
        res[name] = len(got) > 3 and all(torch.equal(a, b) for a, b in zip(got, plain.parameters()))
    # parameters that are not sharded at all: read as they are; rank 0's edit is broadcast
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    with GatheredParameters([lin.weight, lin.bias], modifier_rank=0):
        if rank == 0:
            lin.bias.data.fill_(float(rank + 5))
    res["plain_bias"] = lin.bias.tolist()
    return res


def _ranks(rank, world, root):
    return {"t0": _t0(rank, world, root / "t5"),
            "offload": _offload_generate(rank, world, root / "llama", str(root / "offload.json")),
            "init": _init_and_gather(rank, world)}


@pytest.fixture(scope="module")
def ranks(saved):
    return run_distributed(_ranks, 2, saved, timeout=240)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")   # the guide sets no max_new_tokens
def test_guide_t0_script_matches_a_plain_model(saved, ranks):
    tok = ByT5Tokenizer()
    plain = AutoModelForSeq2SeqLM.from_pretrained(saved / "t5").eval()
    lengths = []
    for rank, r in enumerate(ranks):
        t0 = r["t0"]
        ref = plain.generate(tok.encode(TEXTS[rank], return_tensors="pt"))
        assert t0["outputs"] == ref.tolist(), (rank, t0["outputs"], ref.tolist())
        assert f"rank{rank}:\n   in={TEXTS[rank]}\n  out={tok.decode(ref[0], skip_special_tokens=True)}" \
            in t0["printed"]
        assert 0.4 < t0["local_share"] < 0.6            # each rank holds half of the model
        assert t0["restored"]
        lengths.append(len(t0["outputs"][0]))
    assert lengths[0] < lengths[1], lengths          # rank 0 finished first and kept stepping for rank 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")
def test_guide_t0_script_on_three_ranks(saved):
    """On more than 2 GPUs (4 or 8) the ranks past 1 take the second text, as rank 1 does (the guide's `elif rank ==
    1` left them without one: a NameError on rank 2 and up), and generate what a plain model does with it."""
    three = run_distributed(_t0, 3, saved / "t5", timeout=240)
    tok = ByT5Tokenizer()
    ref = AutoModelForSeq2SeqLM.from_pretrained(saved / "t5").eval().generate(tok.encode(TEXTS[1], return_tensors="pt"))
    for rank in (1, 2):
        assert three[rank]["outputs"] == ref.tolist(), (rank, three[rank]["outputs"], ref.tolist())
        assert f"rank{rank}:\n   in={TEXTS[1]}\n" in three[rank]["printed"]


@pytest.mark.slow
def test_offload_initialize_from_a_config_path_generates_as_a_plain_model(saved, ranks):
    plain = AutoModelForCausalLM.from_pretrained(saved / "llama")
    for rank, r in enumerate(ranks):
        o = r["offload"]
        assert o["meta"], "from_pretrained under HfDeepSpeedConfig materialised weights"
        ref = plain.generate(torch.tensor(o["prompt"]), max_new_tokens=2 + 6 * rank, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert o["out"] == ref.tolist()
        assert o["grad_path"] == "ForwardOnlyPath" and "without an optimizer" in o["step_error"]


@pytest.mark.slow
def test_zero_init_builds_the_plain_model(ranks):
    for r in ranks:
        for name in ("llama", "net"):
            case = r["init"][name]
            assert case["held_bytes"] <= 8, case["held_bytes"]          # placeholders: no full copy kept
            assert case["same_weights"], name     # gathered before initialize: the plain build's weights, exactly
            assert case["fwd"] < 1e-5, (name, case["fwd"])             # sharded forward = plain forward
        assert r["init"]["gpt2"] and r["init"]["t5"], r["init"]


@pytest.mark.slow
def test_gathered_parameters_edit_reaches_every_shard(ranks):
    for r in ranks:
        for name in ("llama", "net"):
            case = r["init"][name]
            assert case["sharded"]                       # the FSDP2 shards (DTensors) after initialize
            assert case["edit_equal"], name              # rank 0's re-initialised rows, on both ranks' shards
            assert case["fwd_after"] < 1e-5, (name, case["fwd_after"])
        assert r["init"]["plain_bias"] == [5.0, 5.0, 5.0]   # unsharded parameters: rank 0's values everywhere
    assert ranks[0]["init"]["llama"]["row4"] == ranks[1]["init"]["llama"]["row4"]


def test_unsupported_arguments_are_refused_with_the_fix(saved):
    import fsdpzero as deepspeed
    from fsdpzero.hf import HfDeepSpeedConfig
    with pytest.raises(ValueError, match=r"zero.Init\(mpu=.*not supported"):
        deepspeed.zero.Init(mpu=object())
    with pytest.raises(NotImplementedError, match="fwd_module"):
        deepspeed.zero.GatheredParameters(nn.Linear(2, 2).weight, fwd_module=nn.Linear(2, 2))
    original = transformers.PreTrainedModel.from_pretrained
    dschf = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert dschf.is_zero3() and not dschf.is_offload() and dschf.get_value("zero_optimization.stage") == 3
    with pytest.raises(ValueError, match=r"device_map=\.\.\.\) .*remove the argument"):
        AutoModelForCausalLM.from_pretrained(saved / "llama", device_map="cpu")
    del dschf
    gc.collect()
    assert transformers.PreTrainedModel.from_pretrained == original
    stage2 = HfDeepSpeedConfig({"zero_optimization": {"stage": 2}})      # not stage 3: transformers' own load
    assert not any(p.is_meta for p in AutoModelForCausalLM.from_pretrained(saved / "llama").parameters())
    del stage2
