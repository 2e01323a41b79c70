"""`fsdpzero migrate` / `validate`: the whole corpus, exit codes, the --json contract, --set, --emit, docs sync."""
import contextlib
import io
import json
from pathlib import Path

import pytest

from fsdpzero.cli import main
from fsdpzero.cli.migrate import render_migration_doc

HERE = Path(__file__).resolve().parents[1]
CORPUS = sorted((HERE / "ds_configs").glob("*.json"))
MUST_SHOW = ["--hf-defaults", "--world-size", "8", "--hidden-size", "4096"]
# Rejected by DeepSpeed 0.19.8 itself (tests/config/test_config_oracle.py checks that DeepSpeed names the same key):
DS_REJECTS = {"axolotl_zero1_torch_compile": "compile.disable", "dsex_bing_bert_lamb_seq128": "sparse_attention",
              "dsex_bing_bert_pld_prescale": "progressive_layer_drop",
              "dsex_sglang_nvme_aio": "train_micro_batch_size_per_gpu"}   # train_batch_size 1 < 8 ranks
UNSUPPORTED: dict[str, str] = {}   # dsex_zenflow_stage2 runs since issue 36 (fsdpzero.optim.zenflow)
# AutoTP (tensor_parallel.autotp_size 4 of the 8 ranks) runs: tests/parallel/test_autotp.py


def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def test_whole_corpus_in_one_run():
    code, out, _ = cli("migrate", *CORPUS, *MUST_SHOW, "--json")
    results = {Path(r["config"]).stem: r for r in json.loads(out)}
    assert len(results) == len(CORPUS) == 25 and code == 2
    for name, r in results.items():
        if name in DS_REJECTS:
            assert not r["ok"] and r["plan"] is None
            assert DS_REJECTS[name] in [e["key"] for e in r["errors"]], r["errors"]
            assert all(e["message"] for e in r["errors"])
        elif name in UNSUPPORTED:
            assert not r["ok"] and not r["errors"]
            assert [d["key"] for d in r["decisions"] if d["status"] == "unsupported"] == [UNSUPPORTED[name]]
        else:
            assert r["ok"] and not r["errors"], (name, r["errors"])
            assert r["plan"]["batch"]["train_batch_size"] % 8 == 0


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_each_corpus_file_exit_code(path):
    code, out, _ = cli("migrate", path, *MUST_SHOW)
    assert code == (2 if path.stem in DS_REJECTS else 1 if path.stem in UNSUPPORTED else 0)
    assert ("runnable as written" in out) == (code == 0)
    if code == 1:
        assert UNSUPPORTED[path.stem] in out.split("NOT RUNNABLE")[1]
    if code == 2:
        assert DS_REJECTS[path.stem] in out


def test_json_contract(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 2}, "_comment": "x"}))
    code, out, _ = cli("migrate", p, "--world-size", "4", "--json")
    r = json.loads(out)
    assert code == 0 and set(r) == {"config", "ok", "errors", "decisions", "plan", "warnings", "compat_version"}
    assert r["ok"] is True and r["compat_version"] == "0.19.8"
    assert all(set(d) == {"key", "value", "status", "detail", "explicit"} for d in r["decisions"])
    assert r["plan"]["shard"]["stage"] == 2 and r["plan"]["batch"]["micro_batch_size"] == 4
    p.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 7, "bogus": 1}}))
    code, out, _ = cli("validate", p, "--json")
    r = json.loads(out)
    assert code == 2 and r["ok"] is False
    assert {e["key"] for e in r["errors"]} == {"zero_optimization.stage", "zero_optimization.bogus"}
    assert all(set(e) == {"key", "message", "suggestion"} for e in r["errors"])


def test_human_output_lists_errors_with_fixes(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text('{"train_batch_size": 8, "zero_optimisation": {"stage": 3}}')
    code, out, _ = cli("validate", p)
    assert code == 2 and "zero_optimisation" in out and "did you mean `zero_optimization`?" in out


def test_set_fills_autos_and_is_checked(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                             "bf16": {"enabled": "auto"},
                             "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    code, out, _ = cli("migrate", p, "--json", "--world-size", "2", "--set", "per_device_train_batch_size=3",
                       "--set", "gradient_accumulation_steps=5", "--set", "learning_rate=2e-4", "--set", "bf16=true")
    r = json.loads(out)
    assert code == 0, r["errors"]
    assert r["plan"]["batch"]["train_batch_size"] == 30 and r["plan"]["optimizer"]["params"]["lr"] == 2e-4
    assert r["plan"]["precision"]["param_dtype"] == "bfloat16"
    code, out, _ = cli("migrate", p, "--json", "--set", "learning_rat=1")
    assert code == 2 and "learning_rate" in json.loads(out)["errors"][0]["suggestion"]
    code, out, _ = cli("migrate", p, "--json")
    errs = {e["key"]: e for e in json.loads(out)["errors"]}
    assert code == 2 and "per_device_train_batch_size" in errs["train_micro_batch_size_per_gpu"]["message"]


def test_emit_yaml_is_a_hydra_experiment_carrying_the_config():
    omegaconf = pytest.importorskip("omegaconf")
    from fsdpzero.config import load_config
    path = HERE / "ds_configs" / "hf_transformers_zero3.json"
    code, out, _ = cli("migrate", path, *MUST_SHOW, "--emit", "yaml")
    assert code == 0 and out.startswith("# @package _global_")
    doc = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.create(out))
    assert "override /zero: stage0" in out and doc["data"]["micro_batch_size"] == 8
    want = dict(load_config(path, context={"world_size": 8, "hidden_size": 4096}, hf_defaults=True).raw)
    assert doc["sched"] == want.pop("scheduler")       # ds_config.scheduler is ${sched} in the recipes
    assert doc["ds_config"] == want                     # floats survive YAML (1.0e-08 style)
    # and the emitted config is itself valid, with nothing left to resolve
    code, _, _ = cli("validate", "--world-size", "8", _write({**doc["ds_config"], "scheduler": doc["sched"]}))
    assert code == 0


def _write(d) -> str:
    import tempfile
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(d, f)
    f.close()
    return f.name


def test_emit_python_is_valid_fsdp2_code():
    code, out, _ = cli("migrate", HERE / "ds_configs" / "dsex_bf16_master_weight_full.json", *MUST_SHOW,
                       "--emit", "python")
    assert code == 0
    compile(out, "<emitted>", "exec")
    assert "fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)" in out
    assert "param_dtype=torch.bfloat16" in out and "clip_grad_norm_(model.parameters(), 1.0)" in out


def test_docs_are_in_sync_with_the_fate_table():
    doc = (HERE.parent / "docs" / "migration.md").read_text()
    assert doc == render_migration_doc(), "regenerate: python -m fsdpzero.cli.migrate --write-docs"


@pytest.mark.parametrize("name", ["hf_transformers_zero2", "hf_transformers_zero3", "llava_zero3_offload",
                                  "dsex_bf16_master_weight_full", "llamafactory_ds_z3_offload"])
def test_emitted_experiment_composes_to_the_same_plan(tmp_path, name):
    """Compose the recipes' Hydra config with the emitted experiment: the ds_config it hands the engine must give
    the same plan as the original file."""
    hydra = pytest.importorskip("hydra")
    import shutil
    from omegaconf import OmegaConf
    from fsdpzero.plan import Env
    from fsdpzero.plan.translate import build_plan
    conf = tmp_path / "conf"
    shutil.copytree(HERE.parent / "conf", conf)
    path = HERE / "ds_configs" / f"{name}.json"
    args = ["--hf-defaults", "--world-size", "2", "--hidden-size", "64", "--set", "max_steps=100"]
    code, out, _ = cli("migrate", path, *args, "--emit", "yaml")
    assert code == 0
    (conf / "experiment" / f"{name}.yaml").write_text(out)
    with hydra.initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = hydra.compose(config_name="config", overrides=[f"experiment={name}"])
    composed = OmegaConf.to_container(cfg.ds_config, resolve=True)
    ctx = {"hidden_size": 64, "max_steps": 100}
    want = build_plan(path, Env(world_size=2), context=ctx, hf_defaults=True).to_dict()
    original = json.loads(path.read_text())
    if "scheduler" not in original:             # documented: the recipe's sched group supplies one
        ctx.pop("max_steps")
        want.pop("scheduler")
    got = build_plan(composed, Env(world_size=2), context=ctx, hf_defaults=True).to_dict()
    got.pop("scheduler") if "scheduler" not in original else None
    if "optimizer" not in original:             # documented: the recipe's AdamW
        assert got.pop("optimizer")["type"] == "adamw" and want.pop("optimizer")["type"] is None
    assert got == want


def test_startup_log_shows_the_same_fate_report_as_migrate():
    """One renderer (fsdpzero.plan.report): the engine's compact startup block carries migrate's summary line and,
    for every key the config set that is not simply mapped, migrate's row; the full table only at DEBUG."""
    import logging

    from fsdpzero.log import log_startup
    from fsdpzero.plan import Env
    from fsdpzero.plan.translate import build_plan
    path = HERE / "ds_configs" / "dsex_bing_bert_onebitadam_nccl.json"   # has approximated and noop keys
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["migrate", str(path), "--world-size", "2", "--device", "cpu"])
    table, summary = out.getvalue().split("\n\n")[:2]
    summary = summary.strip().splitlines()[0]

    def norm(line):
        return " ".join(line.split())

    logger, seen = logging.getLogger("fsdpzero"), io.StringIO()
    handler, level = logging.StreamHandler(seen), logger.level
    logger.addHandler(handler)
    try:
        plan = build_plan(str(path), Env(world_size=2, device_type="cpu"), strict=False)
        for lvl in (logging.INFO, logging.DEBUG):
            logger.setLevel(lvl)
            seen.seek(0)
            seen.truncate()
            log_startup(plan, {"world_size": 2})
            text = seen.getvalue()
            if lvl == logging.INFO:
                compact = text
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert summary in compact and " approximated" in summary
    shown = [norm(r) for r in compact.splitlines()[3:] if r.strip()]
    rows = {norm(r) for r in table.splitlines()[1:]}
    assert shown and set(shown) <= rows, set(shown) - rows
    assert not any(" mapped " in f" {r} " and r.split()[2] == "mapped" for r in shown)
    assert len(compact.splitlines()) < len(table.splitlines()) + 3           # compact: no JSON, no full table
    assert "effective plan:" in text and "every key DeepSpeed reads:" in text  # DEBUG adds them


def test_every_suggested_flag_is_one_migrate_accepts():
    """A fix that says `--set KEY=...` names a KEY that --set takes; other context keys get their own flags."""
    import re

    from fsdpzero.cli.migrate import SET_KEYS
    suggested = set()
    for path in sorted((HERE / "ds_configs").glob("*.json")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["validate", str(path), "--json"])
        for e in json.loads(out.getvalue())["errors"]:
            suggested |= set(re.findall(r"--set (\w+)=", e["suggestion"] or ""))
            assert "--set hidden_size" not in (e["suggestion"] or ""), e
    assert suggested and suggested <= set(SET_KEYS), suggested - set(SET_KEYS)
