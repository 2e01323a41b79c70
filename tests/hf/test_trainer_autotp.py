"""The Hugging Face Trainer door with AutoTP: DeepSpeedExamples' own Trainer config for AutoTP
(tests/ds_configs/dsex_autotp_stage2_warmupdecay.json, autotp_size 4 -> 2) with the unchanged Trainer script
(examples/hf_trainer_deepspeed.py) under `fsdpzero launch` on 4 gloo ranks: tp 2 x dp 2. accelerate shards the
Trainer's loader over every rank; fsdpzero's Trainer shards it over the 2 data replicas, the 2 ranks of a tp group
reading the same batches, as accelerate does under DeepSpeed AutoTP. Reference: the same script and config without
tensor_parallel on 2 ranks (dp 2, the same 2 replicas' batches): per-step losses and grad norms within 1e-5 (fp32;
measured 0.0 and 2.4e-7), the same epoch fraction per step, the schedule's "auto" total steps counted over dp
(--num_train_epochs: counted over every rank it would be 2, not 4, and the learning rates would differ), and the
Trainer's "Total train batch size" counting dp (8, not 16)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]   # the console script
TOL = 1e-5


def _launch(tmp: Path, name: str, ranks: int, config: dict) -> tuple[list[dict], str]:
    (tmp / f"{name}.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    out = tmp / name
    cmd = [*FSDPZERO, "launch", "--num_gpus", str(ranks), "examples/hf_trainer_deepspeed.py", "--deepspeed",
           str(tmp / f"{name}.json"), "--output_dir", str(out), "--max_steps", "-1", "--num_train_epochs", "0.0625",
           "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "4", "--log_level", "info"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500,
                       env=dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false"))
    assert p.returncode == 0, p.stderr[-4000:]
    history = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    return [h for h in history if "loss" in h], p.stdout + p.stderr


@pytest.mark.slow
def test_unchanged_trainer_script_tp2_dp2_matches_dp2(tmp_path):
    config = json.loads((ROOT / "tests/ds_configs/dsex_autotp_stage2_warmupdecay.json").read_text())
    config["tensor_parallel"]["autotp_size"] = 2
    tp, tp_log = _launch(tmp_path, "tp2", 4, config)
    del config["tensor_parallel"]
    dp, _ = _launch(tmp_path, "dp2", 2, config)
    assert "tensor parallelism over 2 ranks" in tp_log and "after 4 steps on 4 process(es)" in tp_log
    assert "Total train batch size (w. parallel, distributed & accumulation) = 8" in tp_log
    assert len(tp) == len(dp) == 4   # 0.0625 of an epoch of 512 windows / (4 per micro-batch x 2 replicas)
    for a, b in zip(tp, dp):
        assert a["epoch"] == b["epoch"] and a["learning_rate"] == b["learning_rate"], (a, b)
        assert abs(a["loss"] - b["loss"]) <= TOL and abs(a["grad_norm"] - b["grad_norm"]) <= TOL, (a, b)
    assert max(h["learning_rate"] for h in tp) > 0 and tp[-1]["learning_rate"] < max(h["learning_rate"] for h in tp)


def _loaders(rank, world):
    """accelerate's prepare_data_loader after shard_loaders_over_data_replicas on a (dp 2, tp 2) mesh: each rank's
    batches of a map-style loader, and the error for an iterable one (dispatched by default)."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, IterableDataset

    from fsdpzero.hf.trainer import shard_loaders_over_data_replicas
    from fsdpzero.parallel import build_parallel_mesh
    accelerator = Accelerator(cpu=True)
    shard_loaders_over_data_replicas(accelerator, build_parallel_mesh("cpu", (2,), ("dp",), tp=2))
    batches = [b.tolist() for b in accelerator.prepare_data_loader(DataLoader(torch.arange(16), batch_size=2))]

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))
    try:
        accelerator.prepare_data_loader(DataLoader(Stream(), batch_size=2))
        error = None
    except ValueError as e:
        error = str(e)
    return batches, error


def test_loaders_shard_over_data_replicas():
    """Ranks 0-1 (replica 0) read batches 0, 2, 4, 6 of the loader and ranks 2-3 (replica 1) batches 1, 3, 5, 7, as
    accelerate's own DeepSpeed AutoTP sharding gives them; a dispatched loader is refused with the key and the fix."""
    import accelerate  # noqa: F401  imported before the ranks fork

    from tests.multirank import run_distributed
    out = run_distributed(_loaders, 4, timeout=120)
    whole = [[2 * i, 2 * i + 1] for i in range(8)]
    assert [batches for batches, _ in out] == [whole[0::2], whole[0::2], whole[1::2], whole[1::2]]
    assert all("accelerator_config={\"dispatch_batches\": False}" in error for _, error in out), out[0][1]


def _initial_llama(where: Path) -> str:
    """tests/hf/test_accelerate_oracle.py's model with a vocabulary of 256 (its 259 does not split over tp 2)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(where)
    return str(where)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_accelerate_door_tp2_dp2_matches_deepspeed_autotp(tmp_path):
    """accelerate's own door, `Accelerator(deepspeed_plugin=...)` (tests/hf/accelerate_loop.py, unchanged), on 4
    gloo ranks with tensor_parallel.autotp_size 2 at ZeRO 2 and the config's optimizer and scheduler: accelerate
    shards the loader over num_processes // tp for DeepSpeed AutoTP (its ds_device_mesh), which fsdpzero's shim
    keeps; against accelerate + real DeepSpeed 0.19.8's AutoTP on the same ranks: per-step losses, grad norms and
    learning rates within 1e-5 (measured 4.8e-7 / 1.2e-7 / 0), and the final whole weights within 1e-5."""
    pytest.importorskip("deepspeed")
    import torch

    from tests.hf import test_accelerate_oracle as oracle
    from tests.multirank import run_distributed
    oracle.CASES["autotp2_stage2"] = ({**oracle._file({"stage": 2}, oracle.SECTIONS),
                                       "tensor_parallel": {"autotp_size": 2}}, [])
    model = _initial_llama(tmp_path / "initial")
    runs = {}
    for side, fn in (("deepspeed", oracle._deepspeed), ("ours", oracle._ours)):
        out = str(tmp_path / side)
        runs[side] = run_distributed(fn, 4, "autotp2_stage2", model, out, [], timeout=600, init_pg=False)[0]
    ours, theirs = runs["ours"], runs["deepspeed"]
    assert ours["world"] == theirs["world"] == 4 and len(ours["history"]) == len(theirs["history"]) == 6
    for a, b in zip(ours["history"], theirs["history"]):
        for key in ("loss", "grad_norm", "lr"):
            assert abs(a[key] - b[key]) <= TOL, (key, ours["history"], theirs["history"])
    assert ours["weights"].keys() == theirs["weights"].keys()
    for name, w in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], w, rtol=0, atol=TOL, msg=name)
