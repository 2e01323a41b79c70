"""README's commands are the contract with newcomers and with CI: keep them true."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_ci_runs_readme_test_command_exactly():
    train, test = _readme_commands()[:2]
    assert "pytest" in test and "torchrun" in train
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in [ln.strip() for ln in ci], "CI must run README's test command verbatim"


def test_readme_train_recipe_exists():
    train = _readme_commands()[0]
    script = next(tok for tok in train.split() if tok.endswith(".py"))
    assert (ROOT / script).exists(), f"README's train command runs {script}, which is missing"
