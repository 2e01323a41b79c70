"""Day one on an 8-GPU node, on CPU: `fsdpzero launch --num_gpus 8` (8 gloo ranks) runs the unchanged Hugging Face
Trainer script (examples/hf_trainer_deepspeed.py) with the Hugging Face ZeRO-3 + CPU offload config, every batch
value "auto". Checked against a 1-rank run of the same script with gradient_accumulation_steps 8 (the same 32-sample
global batches): per-step loss, grad norm and logged learning rate (1e-5), and save_model's folder loaded by plain
transformers (weights within 1e-5; measured <= 6e-8). The 8-rank run's step-2 checkpoint, resumed on 4 ranks with
gradient_accumulation_steps 2, trains steps 3-4 only and ends at the 8-rank run's losses and weights (DCP reshards
8 -> 4). Also: the node count every rank plans with is torchrun's GROUP_WORLD_SIZE, so nodes of different sizes
(`--exclude node-b:3`: 4 + 3 ranks) agree on it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]   # the console script
TOL = 1e-5


def _launch(ranks: int, out: Path, *extra: str) -> subprocess.CompletedProcess:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    cmd = [*FSDPZERO, "launch", "--num_gpus", str(ranks), "examples/hf_trainer_deepspeed.py",
           "--deepspeed", "tests/ds_configs/hf_transformers_zero3.json", "--output_dir", str(out),
           "--max_steps", "4", "--logging_steps", "1", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env=dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false"))
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def _history(run: Path) -> list[dict]:
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    return [{k: h[k] for k in ("step", "loss", "grad_norm", "learning_rate")} for h in state["log_history"]
            if "loss" in h]


def _close(a: list[dict], b: list[dict]) -> None:
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert x[key] == pytest.approx(y[key], rel=TOL, abs=1e-7), (key, a, b)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()     # plain transformers reads the folder


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_unchanged_trainer_script_on_eight_ranks_matches_one_and_resumes_on_four(tmp_path):
    eight = _launch(8, tmp_path / "eight", "--save_strategy", "steps", "--save_steps", "2")
    assert "8 CPU processes (gloo) on this machine; world size 8" in eight.stderr
    assert "batch 32 = 4 x 1 x 8" in eight.stderr                 # "auto" resolved against 8 ranks
    assert "after 4 steps on 8 process(es)" in eight.stdout
    one = _launch(1, tmp_path / "one", "--gradient_accumulation_steps", "8", "--save_strategy", "steps",
                  "--save_steps", "4")
    assert "batch 32 = 4 x 8 x 1" in one.stderr
    straight = _history(tmp_path / "eight")
    assert len(straight) == 4 and straight[-1]["loss"] < straight[0]["loss"] - 0.1    # it trained
    _close(straight, _history(tmp_path / "one"))
    final = _weights(tmp_path / "eight" / "final")
    reference = _weights(tmp_path / "one" / "final")
    assert final.keys() == reference.keys() and len(final) >= 20
    for k in final:
        torch.testing.assert_close(final[k], reference[k], rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{k}: {m}")

    # a run stopped after its step-2 checkpoint, resumed on 4 ranks with the same 32-sample global batch
    resumed = tmp_path / "four"
    shutil.copytree(tmp_path / "eight" / "checkpoint-2", resumed / "checkpoint-2")
    four = _launch(4, resumed, "--gradient_accumulation_steps", "2", "--save_strategy", "steps", "--save_steps", "2",
                   "--resume_from_checkpoint", str(resumed / "checkpoint-2"))
    assert "world size 4" in four.stderr and "resuming at global step 2" in four.stderr
    logged = [line for line in four.stdout.splitlines() if line.lstrip().startswith("{'loss'")]
    assert len(logged) == 2, four.stdout[-2000:]                  # steps 3 and 4 only: it did resume
    _close(_history(resumed), straight)
    again = _weights(resumed / "final")
    for k in final:
        torch.testing.assert_close(again[k], final[k], rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("local_world, group_rank", [(4, 0), (3, 1)])
def test_nodes_of_different_sizes_plan_the_same_node_count(monkeypatch, local_world, group_rank):
    """`fsdpzero launch --hostfile h --exclude node-b:3` on 2 nodes of 4: node a runs 4 ranks, node b 3, world 7.
    Every rank must build the same plan; world // LOCAL_WORLD_SIZE gave node a 1 node and node b 2, and the ranks'
    config agreement stopped the job (RanksError: plan env.nodes)."""
    from fsdpzero.api import launch_env
    for k, v in {"WORLD_SIZE": "7", "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(group_rank),
                 "GROUP_WORLD_SIZE": "2"}.items():     # what torchrun gives each rank of that job
        monkeypatch.setenv(k, v)
    env = launch_env("cpu")
    assert (env.world_size, env.nodes) == (7, 2)


@pytest.mark.parametrize("variables, nodes", [
    ({"WORLD_SIZE": "8", "LOCAL_SIZE": "4", "CROSS_SIZE": "2"}, 2),   # DeepSpeed's own launcher, 2 nodes of 4
    ({"WORLD_SIZE": "8", "LOCAL_SIZE": "4"}, 2),                      # ... without CROSS_SIZE: 8 // 4
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "0"}, 1),   # a zero count is no count
])
def test_node_count_under_other_launchers(monkeypatch, variables, nodes):
    """`deepspeed --hostfile h train.py` (deepspeed.launcher.launch) names the ranks per node LOCAL_SIZE and the
    nodes CROSS_SIZE; read as one node of 8, the multi-node fates and accelerate's num_machines were wrong."""
    from fsdpzero.api import launch_env
    for k in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "LOCAL_SIZE", "CROSS_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in variables.items():
        monkeypatch.setenv(k, v)
    env = launch_env("cpu")
    assert (env.world_size, env.nodes) == (8, nodes)
