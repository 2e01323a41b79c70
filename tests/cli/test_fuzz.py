"""Issue 22's fuzz test, bounded for CI: mutated real configs and random CLI argument lists end either accepted
(validate exit 0/1, and the plan translates) or in exit 2 whose message names a key or a flag. No traceback, no
other exception, no hang (a hypothesis deadline per case, pytest-timeout for the whole). The counts of cases and
outcomes are printed (`pytest -s`)."""
from __future__ import annotations

import collections
import copy
import json
import math
import os
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fsdpzero.config import ConfigError, load_config
from fsdpzero.plan import Env
from fsdpzero.plan.translate import translate
from tests.cli.test_cli_errors import run_cli     # main() in-process, argparse's SystemExit as the exit status

ROOT = Path(__file__).resolve().parents[1]
CORPUS = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "ds_configs").glob("*.json"))}
ASSETS = ROOT / "assets" / "deepspeed_ckpts"
FUZZ = dict(deadline=timedelta(seconds=20), derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                   HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------- config mutations
ODD_NUMBERS = [0, -1, 1, -10**9, 2**31, 2**63 - 1, 2**63, 10**30, 10**4000, 1e40, -1e40, 0.5, 943718.4, 5e8,
               1e-300, math.inf, -math.inf, math.nan]
scalars = st.one_of(st.sampled_from(ODD_NUMBERS), st.integers(-5, 70), st.booleans(), st.none(),
                    st.sampled_from(["auto", "", "cpu", "nvme", "none", "bf16", "AdamW", "OneCycle", "1e3", "é"]),
                    st.floats(allow_nan=True, allow_infinity=True))


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


def _nest(value, depth: int, as_list: bool):
    for _ in range(depth):
        value = [value] if as_list else {"n": value}
    return value


def mutate(data, cfg: dict) -> dict:
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(cfg))
        kind = data.draw(st.sampled_from(["swap", "number", "auto", "unknown", "nest", "drop"]))
        if kind == "unknown" or not paths:
            parents = [cfg] + [v for p in paths if isinstance(v := _get(cfg, p), dict)]
            data.draw(st.sampled_from(parents))[data.draw(st.text(max_size=8))] = data.draw(scalars)
            continue
        path = data.draw(st.sampled_from(paths))
        parent, key = _get(cfg, path[:-1]), path[-1]
        old = parent[key]
        if kind == "swap":
            parent[key] = data.draw(st.sampled_from([[old], {"x": old}, str(old), True, None, 1.5]))
        elif kind == "number":
            parent[key] = data.draw(scalars)
        elif kind == "auto":
            parent[key] = "auto"
        elif kind == "nest":
            parent[key] = _nest(old, data.draw(st.integers(1, 45)), data.draw(st.booleans()))
        else:
            del parent[key]
    return cfg


def _get(cfg, path):
    for k in path:
        cfg = cfg[k]
    return cfg


def print_counts(title: str, counts: collections.Counter) -> None:
    print(f"\nfuzz {title}: {sum(counts.values())} cases")
    for outcome, n in sorted(counts.items()):
        print(f"  {n:4d}  {outcome}")


def test_fuzz_mutated_configs(tmp_path_factory):
    counts = collections.Counter()

    @settings(max_examples=200, **FUZZ)
    @given(st.data())
    def case(data):
        counts[config_case(tmp_path_factory, data)] += 1
    case()
    print_counts("mutated configs", counts)
    assert counts["accepted, runnable (exit 0)"] and counts["exit 2 naming a key"]    # both sides were reached


def config_case(tmp_path_factory, data) -> str:
    name = data.draw(st.sampled_from(sorted(CORPUS)))
    cfg = mutate(data, copy.deepcopy(CORPUS[name]))
    ctx = {"world_size": 8, "hidden_size": 64, "max_steps": 100} if data.draw(st.integers(0, 3)) else None
    try:
        loaded = load_config(cfg, context=ctx, hf_defaults=ctx is not None)
        plan = translate(loaded, Env(world_size=8))          # the pure plan of an accepted config must build
        outcome = "accepted, unsupported feature (exit 1)" if plan.unsupported else "accepted, runnable (exit 0)"
    except ConfigError as e:
        for p in e.problems:                                  # each problem names its key, on one short line
            assert p.key and "\n" not in str(p) and len(str(p)) < 2000, p   # (a list of valid keys is long)
        outcome = "exit 2 naming a key"
    # the same input through `fsdpzero validate` (as a file): the same verdict, no traceback
    path = tmp_path_factory.getbasetemp() / "fuzz_ds.json"
    path.write_text(json.dumps(cfg, allow_nan=True))
    argv = ["validate", str(path), "--world-size", "8"] + (["--hidden-size", "64", "--set", "max_steps=100",
                                                            "--hf-defaults"] if ctx else [])
    code, out, err = run_cli(argv)
    assert "Traceback" not in out + err
    assert code == {"exit 2 naming a key": 2}.get(outcome, 1 if "exit 1" in outcome else 0), (outcome, out, err)
    return outcome


# ---------------------------------------------------------------- CLI argument lists
NUMS = ["0", "-1", "1", "3", "8", "nan", "inf", "1e40", "abc", "", "5GB", "64K", "1M", "0B", "1,2", "4,x",
        "99999999999999999999", "-80", "0.5"]
FLAGS = {
    "migrate": ["--world-size", "--nodes", "--hidden-size", "--set", "--device", "--emit", "--strict", "--json",
                "--all", "--hf-defaults"],
    "validate": ["--world-size", "--nodes", "--hidden-size", "--set", "--strict", "--json"],
    "estimate": ["--gpus", "--nodes", "--gpu-memory", "--cpu-memory", "--dtype", "--buffer-factor", "--json"],
    "convert": ["--from", "--to", "--tag", "--out", "--dtype", "--max-shard-size", "--config"],
    "nvme-bench": ["--size", "--block-sizes", "--queue-depths", "--parallelism", "--repeat", "--backend", "--json"],
}
SWITCHES = {"--strict", "--json", "--all", "--hf-defaults", "--submit-modes"}
WORDS = {"--set": ["max_steps=10", "learning_rate=inf", "bogus=1", "max_steps", "bf16=maybe"],
         "--device": ["cpu", "tpu"], "--emit": ["yaml", "python", "xml"], "--dtype": ["bf16", "fp32", "int4"],
         "--from": ["deepspeed", "fsdpzero", "megatron"], "--to": ["safetensors", "fp32", "dcp", "onnx"],
         "--tag": ["global_step3", "../x", "latest", "nope", "a/b"], "--backend": ["python", "nope"]}


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, list[str]]:
    """Positional arguments per command: good ones and every kind of bad one."""
    base = tmp_path_factory.mktemp("fuzz_cli")
    good = base / "good.json"
    good.write_text(json.dumps(CORPUS["hf_transformers_zero2"]))           # "auto"s: needs --hf-defaults ...
    plain = base / "plain.json"
    plain.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}))
    (base / "utf16.json").write_bytes('{"a": 1}'.encode("utf-16"))
    (base / "latin1.json").write_bytes('{"a": "caf\xe9"}'.encode("latin-1"))
    (base / "deep.json").write_text("[" * 5000 + "]" * 5000)
    (base / "file").write_text("x")
    os.mkfifo(base / "fifo")
    ours = base / "ours"
    assert run_cli(["convert", str(ASSETS / "z1_fp32"), "--from", "deepspeed", "--to", "dcp", "--out",
                    str(ours)])[0] == 0
    bad = [str(base / n) for n in ("utf16.json", "latin1.json", "deep.json", "file", "fifo")] + [
        str(base), "/dev/zero", "/no/such/path", "/proc/fsdpzero"]
    scratch = base / "bench"
    return {"migrate": [str(good), str(plain)] + bad, "validate": [str(good), str(plain)] + bad,
            "estimate": ["gpt2", "tiny_llama", "no-such-model"] + bad,
            "convert": [str(ours), str(ASSETS / "z1_fp32")] + bad, "nvme-bench": [str(scratch)] + bad,
            "out": [str(base / "out"), str(base / "file"), "/proc/fsdpzero_out", str(base)],
            "config": [str(good), str(base / "utf16.json"), str(base / "file"), "/dev/zero", str(base / "fifo")]}


def _argv(data, places) -> list[str]:
    cmd = data.draw(st.sampled_from(sorted(FLAGS)))
    argv = [cmd]
    if data.draw(st.integers(0, 9)):                           # sometimes no positional at all
        argv.append(data.draw(st.sampled_from(places[cmd])))
    if cmd == "convert" and data.draw(st.booleans()):
        argv += ["--to", "fp32"]
    if cmd == "nvme-bench":                                    # small and pure-Python unless the fuzz says otherwise
        argv += ["--size", "64K", "--block-sizes", "64K", "--queue-depths", "1", "--parallelism", "1",
                 "--repeat", "1", "--backend", "python"]
    for _ in range(data.draw(st.integers(0, 3))):
        flag = data.draw(st.sampled_from(FLAGS[cmd] + ["--bogus"]))
        if flag in SWITCHES:
            argv.append(flag)
        elif flag == "--out":
            argv += [flag, data.draw(st.sampled_from(places["out"]))]
        elif flag == "--config" and cmd == "convert":
            argv += [flag, data.draw(st.sampled_from(places["config"]))]
        else:
            argv += [flag, data.draw(st.sampled_from(WORDS.get(flag, NUMS)))]
    return argv


@pytest.fixture(scope="module")
def warm():
    """Import transformers and build a meta model once, so the per-case deadline measures the case."""
    run_cli(["estimate", "gpt2"])


def test_fuzz_cli_arguments(places, warm):
    counts = collections.Counter()

    @settings(max_examples=150, **FUZZ)
    @given(st.data())
    def case(data):
        argv = _argv(data, places)
        counts[f"{argv[0]}: {cli_case(argv)}"] += 1
    case()
    print_counts("CLI argument lists", counts)
    assert sum(n for k, n in counts.items() if "exit 0" in k) and sum(n for k, n in counts.items() if "exit 2" in k)


def cli_case(argv: list[str]) -> str:
    code, out, err = run_cli(argv)
    assert "Traceback" not in out + err, (argv, err)
    assert code in (0, 1, 2), (argv, code, err)
    if code == 2:
        errors = [line for line in err.splitlines() if line.startswith(f"fsdpzero {argv[0]}: error: ")]
        if errors:                                             # a CLI-level error: exactly one line
            assert len(errors) == 1, (argv, err)
            outcome = "exit 2, one error line"
        elif "--json" in argv:                                 # migrate/validate --json: the errors, keyed
            result = json.loads(out)                           # (a whole-file problem names the file)
            assert result["errors"] and all(e["key"] or argv[1] in e["message"] for e in result["errors"]), (
                argv, out)
            outcome = "exit 2, config problems by key (json)"
        else:                                                  # migrate/validate: the config's problems, keyed
            assert "invalid DeepSpeed config" in out, (argv, out, err)
            keyed = [line for line in out.splitlines()[1:] if line.startswith("  ") and not
                     line.startswith("      fix:")]
            assert keyed and all(":" in line for line in keyed), (argv, out)
            outcome = "exit 2, config problems by key"
    else:
        outcome = f"exit {code}"
    return outcome
