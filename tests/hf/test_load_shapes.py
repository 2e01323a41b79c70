"""Issue 32 item 4: the sharded safetensors loads compare each tensor's shape with the model's, as torch's
load_state_dict and transformers' from_pretrained do. Each rank read the rows it holds (`get_slice(...)[box]`) with
no shape check: a larger embedding was silently truncated to the model's rows, a 1-row tensor broadcast over all of
them, a GPT-2 Conv1D weight (in, out) read into a model expecting (out, in) cut to a square. Now every path
(`fsdpzero.hf.from_pretrained`, and transformers' `from_pretrained` under a ZeRO-3 `HfDeepSpeedConfig`) raises one
line naming the tensor and both shapes, on every rank, before any weight is copied. Two gloo ranks, one spawn."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from tests.multirank import run_distributed

STAGE3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
N_EMBD, VOCAB = 32, 96

# checkpoint key -> how the saved tensor is changed, and the shapes the error must name (checkpoint, model)
CASES = {
    "larger_embedding": ("transformer.wte.weight", lambda t: torch.cat([t, t[:8]]), (VOCAB + 8, N_EMBD),
                         (VOCAB, N_EMBD)),
    "one_row": ("transformer.wpe.weight", lambda t: t[:1].clone(), (1, N_EMBD), (64, N_EMBD)),
    "conv1d_as_linear": ("transformer.h.0.mlp.c_fc.weight", lambda t: t.t().contiguous(), (4 * N_EMBD, N_EMBD),
                         (N_EMBD, 4 * N_EMBD)),
}


def _save_variants(root: Path) -> dict[str, str]:
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=N_EMBD, n_layer=2, n_head=4)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(root / "base", safe_serialization=True)
    out = {}
    for name, (key, change, _, _) in CASES.items():
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text((root / "base" / "config.json").read_text())
        sd = load_file(str(root / "base" / "model.safetensors"))
        sd[key] = change(sd[key])
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        out[name] = str(folder)
    return out


def _load_all(rank, world, folders):
    import fsdpzero
    import fsdpzero.hf
    from fsdpzero.hf import HfDeepSpeedConfig
    from transformers import AutoModelForCausalLM
    out = {}
    for name, folder in folders.items():
        try:
            fsdpzero.hf.from_pretrained(folder, STAGE3)
            out[("engine", name)] = "loaded"
        except Exception as e:
            out[("engine", name)] = f"{type(e).__name__}: {e}"
        dschf = HfDeepSpeedConfig(STAGE3)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder)
            fsdpzero.initialize(model=model, config_params=STAGE3)
            out[("hf_zero3", name)] = "loaded"
        except Exception as e:
            out[("hf_zero3", name)] = f"{type(e).__name__}: {e}"
        del dschf
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folders = _save_variants(tmp_path_factory.mktemp("shapes"))
    return run_distributed(_load_all, 2, folders, timeout=300)


@pytest.mark.parametrize("path", ["engine", "hf_zero3"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_shape_mismatch_is_one_line_naming_the_tensor_and_both_shapes(results, path, case):
    key, _, saved, live = CASES[case]
    messages = [r[(path, case)] for r in results]
    assert messages[0] == messages[1], messages              # the same error on every rank
    text = messages[0]
    assert text.startswith("ValueError: ") and "\n" not in text, text
    assert key in text and str(saved) in text and str(live) in text, text
    if case == "conv1d_as_linear":
        assert "the transpose" in text, text
