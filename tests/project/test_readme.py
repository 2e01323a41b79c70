"""README's commands are the contract with newcomers and with CI: keep them true.

The "Other things to try" block is run command by command from a fresh copy of the checkout, after README's first
(training) command, each checked to do what its comment says. To stay fast each recipe command gets
`trainer.max_steps=4` appended and the Trainer script `--max_steps 3`, and the `pip install -e '.[hf]' &&` part is
not run (the test environment has the extra); everything else runs exactly as written."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [b.split("```", 1)[0] for b in text.split("```bash")[1:]]


def _commands(block: str) -> list[str]:
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _readme_commands() -> list[str]:
    return _commands(_blocks()[0])


def _things_to_try() -> list[str]:
    text = (ROOT / "README.md").read_text()
    after = text.split("Other things to try", 1)[1]
    return _commands(after.split("```bash", 1)[1].split("```", 1)[0])


def test_ci_runs_readme_test_command_exactly():
    train, test = _readme_commands()[:2]
    assert "pytest" in test and "torchrun" in train
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in [ln.strip() for ln in ci], "CI must run README's test command verbatim"


def test_readme_train_recipe_exists():
    train = _readme_commands()[0]
    script = next(tok for tok in train.split() if tok.endswith(".py"))
    assert (ROOT / script).exists(), f"README's train command runs {script}, which is missing"


def _runnable(cmd: str) -> list[str]:
    """The part of a README command the test runs: after any `pip install ... &&`, split as the shell would."""
    return shlex.split(cmd.split("&&")[-1].strip())


def test_things_to_try_name_real_files_and_valid_arguments():
    """Fast and always run: every file a suggestion names exists, every recipe override composes, and the launcher's
    flags parse into a torchrun command."""
    import argparse
    sys.path.insert(0, str(ROOT / "recipes"))
    import recipe_utils
    from fsdpzero.cli import launch
    cmds = [_runnable(c) for c in _things_to_try()]
    assert len(cmds) == 5
    for argv in cmds:
        for tok in argv:
            if tok.endswith((".py", ".json")):
                path = tok.split("=", 1)[-1]
                assert (ROOT / path).is_file(), f"README names {path}, which is missing"
        if "recipes/train_lm.py" in argv:
            cwd = os.getcwd()
            os.chdir(ROOT)
            try:
                recipe_utils.compose("config", argv[argv.index("recipes/train_lm.py") + 1:] + ["resume=never"])
            finally:
                os.chdir(cwd)
        elif argv[1:2] == ["launch"]:
            p = argparse.ArgumentParser()
            launch.add_arguments(p)
            plan = launch.plan_launch(p.parse_args(argv[2:]), None, gpu_count=0, hostname="box")
            assert "--deepspeed" in plan.torchrun_args


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fresh_copy(dest: Path) -> None:
    """The files a clone has (tracked, plus new ones not ignored), and the test's .venv linked in."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    (dest / ".venv").symlink_to(Path(sys.prefix))


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(cwd))
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, (argv, p.stdout[-2000:], p.stderr[-3000:])
    return p


@pytest.mark.slow
def test_things_to_try_in_sequence_from_a_fresh_copy(tmp_path):
    if not (Path(sys.prefix) / "bin" / "torchrun").exists():
        pytest.skip("needs the test environment's venv (torchrun, fsdpzero console scripts)")
    _fresh_copy(tmp_path)
    short = ["trainer.max_steps=4"]
    first = _runnable(_readme_commands()[0])
    first = first[first.index(".venv/bin/torchrun"):] if ".venv/bin/torchrun" in first else first
    out = tmp_path / "outputs"

    p = _run(first + short, tmp_path)                                      # README's first command
    base = out / "train_lm"
    assert "done: 4 steps on 2 rank(s)" in p.stdout
    assert json.loads((base / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    kept = {f: _digest(base / f) for f in ("loss_curve.json", "hf_model/model.safetensors", "ds_config.json")}
    assert json.loads((base / "loss_curve.json").read_text())["train"]

    stage2, hf_auto, again, estimate, trainer = [_runnable(c) for c in _things_to_try()]

    p = _run(stage2 + short, tmp_path)                                     # zero=stage2 precision=bf16
    (new,) = [d for d in out.iterdir() if d.name.startswith("train_lm-")]
    ds = json.loads((new / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"]["enabled"] is True
    assert f"this run uses outputs/{new.name}" in p.stderr and "done: 4 steps" in p.stdout
    from safetensors import safe_open
    with safe_open(str(new / "hf_model" / "model.safetensors"), "pt") as f:
        assert str(f.get_tensor(next(iter(f.keys()))).dtype) == "torch.bfloat16"    # written in its compute dtype
    assert {f: _digest(base / f) for f in kept} == kept                    # the first run is untouched

    p = _run(hf_auto + short, tmp_path)                                    # the Hugging Face "auto" config
    (auto_dir,) = [d for d in out.iterdir() if d.name.startswith("train_lm-") and d != new]
    text = (auto_dir / "ds_config.json").read_text()
    assert '"auto"' not in text and json.loads(text)["train_micro_batch_size_per_gpu"] == 8
    assert "done: 4 steps" in p.stdout

    p = _run(again + short, tmp_path)                                      # the first command again
    assert "nothing to do: outputs/train_lm already holds this configuration's run at step 4" in p.stdout
    assert {f: _digest(base / f) for f in kept} == kept

    p = _run(estimate, tmp_path)
    assert "llama" in p.stdout.lower() and "stage" in p.stdout.lower()

    p = _run(trainer + ["--max_steps", "3"], tmp_path)                     # the unchanged Trainer script
    assert "after 3 steps on 2 process(es)" in p.stdout
    assert (tmp_path / "outputs" / "hf_trainer_deepspeed" / "final" / "config.json").is_file()
