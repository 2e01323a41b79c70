"""examples/hf_trainer_deepspeed.py honours `--resume_from_checkpoint`, through the user's path: `fsdpzero launch
--num_gpus 2` on 2 gloo ranks with the Hugging Face ZeRO-3 config. A run interrupted after its step-3 checkpoint and
resumed from it trains steps 4-6 only, leaves the checkpoint it resumed from as it was, and ends with the straight
run's losses and weights bit for bit."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]   # the console script


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [*FSDPZERO, "launch", "--num_gpus", "2", "examples/hf_trainer_deepspeed.py",
           "--deepspeed", "tests/ds_configs/hf_transformers_zero3.json", "--output_dir", str(out),
           "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "1", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env=dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false"))
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def _digests(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.mark.slow
def test_example_resumes_from_checkpoint(tmp_path):
    straight = _run(tmp_path / "a")
    interrupted = tmp_path / "b"
    shutil.copytree(tmp_path / "a" / "checkpoint-3", interrupted / "checkpoint-3")   # a run stopped after step 3
    before = _digests(interrupted / "checkpoint-3")
    resumed = _run(interrupted, "--resume_from_checkpoint", str(interrupted / "checkpoint-3"))
    logged = lambda p: [line for line in p.stdout.splitlines() if line.startswith("{'loss'")]  # noqa: E731
    assert len(logged(straight)) == 6 and len(logged(resumed)) == 3    # steps 4-6 only: it did resume
    assert "after 6 steps on 2 process(es)" in resumed.stdout
    assert _digests(interrupted / "checkpoint-3") == before            # what it resumed from is left alone
    history = [json.loads((d / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
               for d in (tmp_path / "a", interrupted)]
    assert [h.get("loss") for h in history[0]] == [h.get("loss") for h in history[1]]
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (tmp_path / "a", interrupted))
    assert all(torch.equal(a[k], b[k]) for k in a)
