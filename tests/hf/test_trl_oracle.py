"""TRL's SFTTrainer and DPOTrainer on fsdpzero against the same trainers on transformers + real DeepSpeed 0.19.8
(DS_ACCELERATOR=cpu, gloo), 2 ranks, fp32, `deepspeed=` in the TRL config, the same model folder, data and seed: per
step loss, grad norm and learning rate within 1e-5, and the final weights within 1e-5. fsdpzero's ranks run TRL as
`fsdpzero launch` does (the shim installed before TRL is imported); DeepSpeed's run TRL as it is. DPO's reference
model is the model folder loaded again; at ZeRO-3 both shard it on a forward-only engine (TRL prepares it with
deepspeed.initialize and an inference config under DeepSpeed; fsdpzero.hf.Trainer's prepare_model under fsdpzero)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import transformers  # noqa: F401  imported before forking ranks

from tests.multirank import run_distributed

pytestmark = [pytest.mark.oracle, pytest.mark.slow]
if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("trl") is None:
    pytest.skip("needs the [oracle] extra (DeepSpeed) and TRL (the [test] extra)", allow_module_level=True)

STEPS = 4
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": False},
           "offload_param": {"device": "cpu", "pin_memory": False}}
CASES = {   # name -> (trainer, zero_optimization)
    "sft_stage2": ("sft", {"stage": 2}),
    "sft_stage3_cpu_offload": ("sft", {"stage": 3, **OFFLOAD}),
    "dpo_stage3": ("dpo", {"stage": 3}),
}


def _rows(kind: str) -> list[dict]:
    if kind == "sft":
        return [{"text": " ".join(WORDS[(i + j) % 8] for j in range(6))} for i in range(32)]
    return [{"prompt": WORDS[i % 8] + " ", "chosen": WORDS[(i + 1) % 8], "rejected": WORDS[(i + 3) % 8]}
            for i in range(32)]


def _trainer(case: str, model: str, out: str):
    import trl
    from datasets import Dataset
    kind, zero = CASES[case]
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "zero_optimization": {**zero, "stage3_gather_16bit_weights_on_model_save": True}}
    common = dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  learning_rate=1e-3, max_grad_norm=0.5, logging_steps=1, report_to=[], save_strategy="no",
                  use_cpu=True, bf16=False, disable_tqdm=True, seed=0, deepspeed=ds, max_length=64,
                  adam_epsilon=1e-6, dataloader_num_workers=0)
    data = Dataset.from_list(_rows(kind))
    if kind == "sft":
        return trl.SFTTrainer(model=model, args=trl.SFTConfig(**common), train_dataset=data)
    return trl.DPOTrainer(model=model, args=trl.DPOConfig(**common), train_dataset=data)


def _history(trainer) -> list[dict]:
    return [{k: h[k] for k in ("loss", "grad_norm", "learning_rate")} for h in trainer.state.log_history
            if "loss" in h]


def _deepspeed(rank, world, case, model, out):
    os.environ["DS_ACCELERATOR"] = "cpu"
    trainer = _trainer(case, model, out)
    trainer.train()
    engine = trainer.model_wrapped
    if CASES[case][1]["stage"] == 3:
        full = engine._zero3_consolidated_16bit_state_dict()
        weights = {k: v.float().clone() for k, v in full.items()} if rank == 0 else None
    else:
        weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {"history": _history(trainer), "weights": weights}


def _ours(rank, world, case, model, out):
    # as `fsdpzero launch` runs a script: the shim first, then TRL (fresh, whatever the test process imported)
    for name in [n for n in sys.modules if n.split(".")[0] in ("deepspeed", "trl")]:
        del sys.modules[name]
    from fsdpzero.compat import shim
    shim.install()
    from torch.distributed.tensor import DTensor
    trainer = _trainer(case, model, out)
    import fsdpzero.hf
    assert isinstance(trainer, fsdpzero.hf.Trainer)
    if CASES[case][0] == "dpo":   # the reference model is sharded like the trained one, as DeepSpeed's is
        assert all(isinstance(p, DTensor) for p in trainer.ref_model.parameters())
    trainer.train()
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
               for n, p in trainer.engine.module.named_parameters()}
    return {"history": _history(trainer), "weights": weights}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tests.hf.test_trl import save_byte_llama
    where = tmp_path_factory.mktemp("trl_model")
    save_byte_llama(where)
    return str(where)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_trl_trainer_matches_deepspeed(tmp_path, model_dir, case):
    theirs = run_distributed(_deepspeed, 2, case, model_dir, str(tmp_path / "ds"), timeout=600, init_pg=False)[0]
    ours = run_distributed(_ours, 2, case, model_dir, str(tmp_path / "ours"), timeout=600, init_pg=False)[0]
    assert len(ours["history"]) == len(theirs["history"]) == STEPS
    for a, b in zip(ours["history"], theirs["history"]):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, ours["history"], theirs["history"])
    assert len(theirs["weights"]) >= 20
    for name, w in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], w, rtol=1e-5, atol=1e-5, msg=name)
