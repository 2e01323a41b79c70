"""What a user reads: one prefix per log line, the step line's loss averaged over ranks (the number the recipe and
the monitor show), a line for every checkpoint saved or loaded, counts that never read '0.0 M', the startup block
without a stale 'upcast_params', `validate` hints that name --hf-defaults, no deprecation warning from fsdpzero's own
module walk, and the recipes' loss_curve.png."""
from __future__ import annotations

import ast
import logging
import sys
import warnings
from pathlib import Path

import torch
import transformers  # noqa: F401  imported before forking the ranks

from fsdpzero.log import count
from tests.cli.test_cli_errors import run_cli
from tests.engine_cases import batches, build_model, engine_losses, make_plan
from tests.multirank import run_distributed

ROOT = Path(__file__).resolve().parents[2]
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}


def test_no_log_message_repeats_the_prefix():
    """The "fsdpzero" logger's handler prints "[fsdpzero] "; a message of its own starting "fsdpzero" doubles it."""
    doubled = []
    for path in sorted((ROOT / "fsdpzero").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LOG_METHODS and node.args):
                continue
            first = node.args[0]
            text = first.value if isinstance(first, ast.Constant) else (
                first.values[0].value if isinstance(first, ast.JoinedStr) and first.values
                and isinstance(first.values[0], ast.Constant) else None)
            if isinstance(text, str) and text.lower().startswith("fsdpzero"):
                doubled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:60]}")
    assert not doubled, doubled


def test_counts_read_at_a_glance():
    assert [count(n) for n in (0, 7104, 999_999, 3_420_000, 8_030_261_248)] == [
        "0", "7,104", "999,999", "3.42 M", "8.03 B"]


def test_finding_a_parameters_owner_leaves_deprecated_torch_objects_alone():
    """GatheredParameters finds a parameter's modules by walking the live objects; reading `__class__` of
    torch.distributed.reduce_op that way printed its FutureWarning on every rank at exit of the README command."""
    from fsdpzero import zero
    model = torch.nn.Linear(2, 2)
    assert torch.distributed.reduce_op is not None   # alive, as in every process that imported torch.distributed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert zero.owners(model.weight) == [(model, "weight")]
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]


def _logged_run(rank, world, save_dir):
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("fsdpzero").addHandler(handler)
    from fsdpzero.api import wrap
    plan = make_plan(stage=2, world=world, steps_per_print=1)
    data = batches(2, 1, 2 * world)                     # each rank its own rows: different losses per rank
    engine = wrap(build_model("llama"), plan)
    losses = engine_losses(engine, data, rank, world)  # per step, averaged over micro-steps and ranks
    engine.save_checkpoint(save_dir)
    fresh = wrap(build_model("llama", seed=3), plan)
    fresh.load_checkpoint(save_dir)
    fresh.load_checkpoint(save_dir, load_module_only=True)
    return {"records": records, "losses": losses}


def test_step_checkpoint_and_startup_lines(tmp_path):
    r0, r1 = run_distributed(_logged_run, 2, str(tmp_path), timeout=240)
    steps = [m for m in r0["records"] if m.startswith("step=")]
    assert len(steps) == 2
    for line, loss in zip(steps, r0["losses"]):   # the mean over ranks, not rank 0's own loss
        assert f"loss={loss:.6f}," in line, (line, r0["losses"])
    assert any(line.startswith(f"saved checkpoint {tmp_path / 'global_step2'} at global step 2")
               for line in r0["records"]), r0["records"]
    loads = [m for m in r0["records"] if m.startswith("loaded ")]
    where = tmp_path / "global_step2"
    assert loads == [f"loaded checkpoint {where}: resuming at global step 2", f"loaded the weights of checkpoint "
                     f"{where} (load_module_only: counters and optimizer left as they were)"], loads
    startup = [m for m in r0["records"] if "\nworld_size 2," in m]   # the startup block, its second line
    assert startup and "master_weights float32" in startup[0] and "upcast_params" not in startup[0]
    assert not [m for m in r1["records"] if not m.startswith("[")], r1["records"]   # rank 1 stays quiet


def test_validate_hints_name_hf_defaults():
    """An HF config full of "auto": each TrainingArguments value's fix offers --hf-defaults, which is what resolves
    it; the model's hidden size keeps its own flag. Following the hints validates the config."""
    cfg = str(ROOT / "tests" / "ds_configs" / "hf_transformers_zero3.json")
    code, out, err = run_cli(["validate", cfg])
    fixes = [line.strip() for line in (out + err).splitlines() if line.strip().startswith("fix:")]
    assert code == 2 and len(fixes) == 14
    assert sum("--hf-defaults" in f for f in fixes) == 11 and sum("--hidden-size H" in f for f in fixes) == 3
    code, out, err = run_cli(["validate", cfg, "--hf-defaults", "--hidden-size", "64"])
    assert code == 0, out + err


def test_loss_curve_is_drawn(tmp_path):
    """The recipes extra has matplotlib: loss_curve.png next to loss_curve.json, one line per curve."""
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import recipe_utils
    finally:
        sys.path.remove(str(ROOT / "recipes"))
    import matplotlib.image
    made = recipe_utils.write_loss_curve(tmp_path, {"train": [(1, 5.6), (2, 4.0), (3, 3.1)], "val": [(3, 3.3)]})
    assert made == tmp_path / "loss_curve.png" and (tmp_path / "loss_curve.json").is_file()
    image = matplotlib.image.imread(str(made))
    assert image.shape[0] > 200 and image.shape[1] > 300 and image.std() > 0.05   # a drawn figure, not blank
