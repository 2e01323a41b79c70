"""`fsdpzero migrate` / `fsdpzero validate`: what a ds_config.json becomes under FSDP2, key by key.

Exit status: 0 runnable as written; 1 valid DeepSpeed config that asks for something fsdpzero does not support
(listed); 2 invalid config (every error listed). `--json` prints one object (the stable contract):
    {"ok": bool, "errors": [{"key", "message", "suggestion"}],
     "decisions": [{"key", "value", "status", "detail", "explicit"}], "plan": {...} | null,
     "warnings": [str], "compat_version": "0.19.8"}
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from fsdpzero.cli.args import positive_int
from fsdpzero.config import COMPAT_VERSION, ConfigError, Problem, load_config
from fsdpzero.plan import Env, Plan
from fsdpzero.plan.report import fate_table, summary_line

SET_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
            "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "warmup_steps", "warmup_ratio",
            "max_steps", "num_training_steps", "bf16", "fp16")


def add_arguments(parser: argparse.ArgumentParser, name: str = "migrate") -> None:
    parser.add_argument("config", nargs="+", help="ds_config.json file(s) (JSON with optional comments); several "
                                                  "files are checked in one process, exit status = the worst")
    parser.add_argument("--world-size", type=positive_int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="device type (default cuda)")
    parser.add_argument("--hidden-size", type=positive_int, default=None,
                        help="model hidden size, for the HF autos")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"TrainingArguments value for \"auto\" keys; KEY in {', '.join(SET_KEYS)}")
    parser.add_argument("--hf-defaults", action="store_true",
                        help="fill the other autos with transformers.TrainingArguments defaults")
    parser.add_argument("--strict", action="store_true", help="every unknown key and every unresolvable auto "
                                                              "is an error")
    parser.add_argument("--json", action="store_true", help="print one JSON object (see docs/migration.md)")
    if name == "migrate":
        parser.add_argument("--all", action="store_true", help="also list keys left at DeepSpeed's defaults")
        parser.add_argument("--emit", choices=("yaml", "python", "accelerate"), default=None,
                            help="print the Hydra experiment file (yaml), a native FSDP2 snippet (python) or "
                                 "accelerate's FSDP2 launch config (accelerate)")


def _parse_set(items: list[str]) -> dict[str, Any]:
    ctx: dict[str, Any] = {}
    problems = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in SET_KEYS:
            from fsdpzero.config.errors import did_you_mean
            problems.append(Problem(f"--set {key}", "expected KEY=VALUE with a TrainingArguments name",
                                    did_you_mean(key, SET_KEYS) or f"KEY in {', '.join(SET_KEYS)}"))
            continue
        low = text.strip().lower()
        if low in ("true", "false"):
            ctx[key] = low == "true"
        else:
            try:
                num = float(text)
            except ValueError:
                problems.append(Problem(f"--set {key}", f"{text!r} is not a number or true/false", ""))
                continue
            if not (math.isfinite(num) and abs(num) < 2**63):
                problems.append(Problem(f"--set {key}", f"{text!r}: must be a finite number below 2**63",
                                        "e.g. 1e-4"))
                continue
            ctx[key] = int(text.strip()) if num.is_integer() and "." not in text and "e" not in low else num
    if problems:
        raise ConfigError(problems)
    return ctx


def evaluate(args: argparse.Namespace, path: str) -> tuple[int, dict]:
    """The migrate result as the --json object, and the exit status."""
    from fsdpzero.plan.translate import translate
    result: dict[str, Any] = {"config": str(path), "ok": False, "errors": [], "decisions": [], "plan": None,
                              "warnings": [], "compat_version": COMPAT_VERSION}
    env = Env(world_size=args.world_size, nodes=args.nodes, device_type=args.device)
    try:
        ctx = _parse_set(args.set)
        ctx["world_size"] = args.world_size
        if args.hidden_size is not None:
            ctx["hidden_size"] = args.hidden_size
        cfg = load_config(path, context=ctx, hf_defaults=args.hf_defaults, strict=args.strict)
        result["warnings"] = cfg.warnings
        plan = translate(cfg, env)
    except ConfigError as e:
        result["errors"] = e.to_list()
        return 2, result
    result["decisions"] = [{"key": d.key, "value": d.value, "status": d.status, "detail": d.detail,
                            "explicit": d.explicit} for d in plan.decisions]
    result["plan"] = plan.to_dict()
    result["ok"] = not plan.unsupported
    result["_plan"] = plan
    result["_cfg"] = cfg
    return (1 if plan.unsupported else 0), result


def run(args: argparse.Namespace) -> int:
    if getattr(args, "emit", None) and len(args.config) > 1:
        print(f"fsdpzero {args.command}: error: --emit takes one config", file=sys.stderr)
        return 2
    if args.world_size % args.nodes:
        print(f"fsdpzero {args.command}: error: --world-size {args.world_size} is not a multiple of --nodes "
              f"{args.nodes} (every node runs the same number of ranks)", file=sys.stderr)
        return 2
    codes, results = [], []
    for path in args.config:
        code, result = evaluate(args, path)
        codes.append(code)
        if args.json:
            result.pop("_plan", None)
            result.pop("_cfg", None)
            if args.command == "validate":
                result = {k: result[k] for k in ("config", "ok", "errors", "warnings", "compat_version")}
                result["ok"] = code != 2
            results.append(result)
        else:
            if len(args.config) > 1:
                print(f"== {path}")
            _print_human(args, path, code, result)
    if args.json:
        json.dump(results[0] if len(results) == 1 else results, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return max(codes)


def _print_human(args: argparse.Namespace, path: str, code: int, result: dict) -> None:
    plan: Plan | None = result.pop("_plan", None)
    cfg = result.pop("_cfg", None)
    if getattr(args, "emit", None) and plan is not None:
        from fsdpzero.cli.emit import emit_accelerate, emit_python, emit_yaml
        if args.emit == "accelerate":
            text, notes = emit_accelerate(plan)
            for note in notes:     # also comments in the file; said here so that a redirected run still shows them
                print(f"fsdpzero migrate: not expressible in accelerate's FSDP2 config: {note}", file=sys.stderr)
            sys.stdout.write(text)
            return
        sys.stdout.write(emit_yaml(cfg, plan, path) if args.emit == "yaml" else emit_python(plan))
        return
    for w in result["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    if code == 2:
        print(f"{path}: invalid DeepSpeed config ({len(result['errors'])} problem(s)):")
        for e in result["errors"]:
            print(f"  {e['key'] or '<config>'}: {e['message']}" + (f"\n      fix: {e['suggestion']}"
                                                                 if e["suggestion"] else ""))
        return
    if args.command == "validate":
        print(f"{path}: valid (DeepSpeed {COMPAT_VERSION} semantics)"
              + (f"; {len(plan.unsupported)} unsupported feature(s), see `fsdpzero migrate`" if code else ""))
        return
    print(fate_table(plan, show_all=args.all))
    print("\n" + summary_line(plan, show_all=args.all))
    if code == 1:
        print("NOT RUNNABLE as written: " + "; ".join(f"{d.key} ({d.detail})" for d in plan.unsupported))
    else:
        print("runnable as written.")


# ---------------------------------------------------------------- docs/migration.md
GUIDE = """# Migrating a DeepSpeed config to fsdpzero

<!-- Generated by `python -m fsdpzero.cli.migrate --write-docs`; tests/cli/test_migrate.py keeps it in sync. -->

fsdpzero reads your `ds_config.json` with the semantics of **DeepSpeed {version}** (the one place this is stated
is `fsdpzero.config.COMPAT_VERSION`) and runs it on native PyTorch FSDP2.

## 1. Check the config

    fsdpzero validate ds_config.json            # errors only
    fsdpzero migrate ds_config.json --world-size 8 --hidden-size 4096 --hf-defaults

`migrate` prints one row per key you wrote (`--all` adds the keys left at DeepSpeed's defaults): its value, its
fate, and the FSDP2 API or fsdpzero component that carries it. Exit status: **0** runnable as written; **1** a
valid DeepSpeed config that asks for a feature fsdpzero does not support (listed); **2** an invalid config (every
problem listed, each with its key path and a fix). Several files can be given at once.

Fates: **mapped** (same behaviour), **approximated** (same training result, different mechanics or memory),
**noop** (no effect under FSDP2, or the value is off), **unsupported** (the run is refused).

## 2. What is stricter than DeepSpeed

- Unknown keys in the sections DeepSpeed validates (zero_optimization, fp16, bf16, monitors, compile, ...) are
  errors, as in DeepSpeed, with the nearest valid key: `zero_optimization.stage3_prefetch_bucket_sise` -> did you
  mean `stage3_prefetch_bucket_size`?
- At the top level and in lenient sections DeepSpeed ignores unknown keys silently. fsdpzero makes a near-miss of a
  real key an error (`zero_optimisation`, `gradient_acumulation_steps`); any other unknown key (`_comment`,
  another tool's section) is a warning with the fate noop. `--strict` makes every unknown key an error.
- Wrong types and out-of-range values, fp16 and bf16 both enabled, `offload_param` below stage 3, optimizer offload
  at stage 0, NVMe without `nvme_path`, optimizer or scheduler parameters the class does not take, and
  `optimizer.params.max_grad_norm` (DeepSpeed raises at initialize) are errors before any GPU is touched.
- So are a whole section written as `"auto"` (`"bf16": "auto"`) and `"stage": "auto"`, values that size memory,
  threads or loops out of range (`fp16.initial_scale_power` above 127, `hysteresis: 0`, `aio.intra_op_parallelism`
  above 256, a non-finite `lr`), and files that are not UTF-8 JSON objects (a FIFO, a device, more than 32 levels
  deep); near-integer floats in size keys (`0.9 * d_model**2`) are rounded, noted in the table. The full list is in
  docs/deepspeed_differences.md.
- Keys DeepSpeed 0.19.8 removed (`sparse_attention`, `progressive_layer_drop`, `amp`, `elasticity`,
  `curriculum_learning`, `compression_training`, `quantize_training`, `eigenvalue`, `sparse_gradients`,
  `graph_harvesting`, `nebula`, `zero_optimization.zeropp_loco_param`) are rejected as DeepSpeed rejects them.
  `zero_optimization.mics_shard_size` (MiCS, removed there too) is still accepted: it becomes an HSDP mesh.
- Deprecated names are renamed with a warning: `bfloat16` -> `bf16`, `zero_optimization: true` -> stage 1,
  `cpu_offload` / `cpu_offload_param` -> `offload_optimizer` / `offload_param` with device cpu,
  `cpu_offload_use_pin_memory` (ignored, as in DeepSpeed), `stage3_gather_fp16_weights_on_model_save`,
  `aio.thread_count` -> `intra_op_parallelism`, `seq_parallel_comm_data_type`.

## 3. "auto"

`"auto"` values are filled as the Hugging Face Trainer fills them, from what you pass: `--set KEY=VALUE` with
TrainingArguments names (`per_device_train_batch_size`, `gradient_accumulation_steps`, `learning_rate`,
`weight_decay`, `adam_beta1`, `adam_beta2`, `adam_epsilon`, `max_grad_norm`, `warmup_steps`, `max_steps`, `bf16`,
`fp16`), `--world-size`, `--hidden-size` (for `reduce_bucket_size` = h*h and, at stage 3,
`stage3_prefetch_bucket_size` = int(0.9*h*h), `stage3_param_persistence_threshold` = 10*h), and with
`--hf-defaults` the TrainingArguments defaults for the rest. An explicit value that disagrees with a value you
passed is an error (the Trainer's mismatch check). `scheduler.params.total_num_steps` (and a ratio-based
`warmup_num_steps`) need the number of training steps: with `--hf-defaults` and no `max_steps` they are left to
the trainer (listed as such). An `"auto"` nothing resolves is an error naming the TrainingArguments field; inside
the sections DeepSpeed validates, an `"auto"` no resolver fills takes DeepSpeed's default with a warning (DeepSpeed
drops it silently), or is an error with `--strict`.

## 4. Leaving fsdpzero

`fsdpzero migrate CONFIG --emit yaml` prints a Hydra experiment file for `recipes/train_lm.py`: save it as
`conf/experiment/NAME.yaml` and run `python recipes/train_lm.py experiment=NAME`. It is a `# @package _global_`
file that points the recipes' zero/precision/monitor groups at neutral choices, replaces the optim/ and sched/
groups with your optimizer and scheduler, and sets `ds_config:` to the rest of your resolved config, so the
composed `ds_config` gives the same plan as your file (a test composes it with Hydra and compares). Written into
the file when they apply: without a scheduler or optimizer the recipe's are used; optimizers other than
Adam/AdamW also receive the recipe's betas/eps (use `recipes/train_lm.py ds_config=FILE` for those).
`--emit python` prints a short native FSDP2 script (`fully_shard`, `MixedPrecisionPolicy`, accumulation with
`set_requires_gradient_sync`, clipping): the way off fsdpzero, too. `--emit accelerate` prints accelerate's FSDP2
launch config (`fsdp_version: 2`, reshard, offload, mixed precision, state-dict type) for
`accelerate launch --config_file FILE train.py`; what accelerate's FSDP2 cannot express (ZeRO-1, optimizer-only or
NVMe offload, DeepSpeed's loss scaler) is said in the file's comments and on stderr.

## 5. `--json`

One object per config (a list for several configs), a stable contract:

    {{"config": str, "ok": bool, "errors": [{{"key", "message", "suggestion"}}],
     "decisions": [{{"key", "value", "status", "detail", "explicit"}}], "plan": {{...}} | null,
     "warnings": [str], "compat_version": "{version}"}}

`ok` is true when the config is runnable as written (exit 0). `plan` is `fsdpzero.plan.Plan.to_dict()`.

## 6. Every key

Both tables below are printed from the one rule table that decides every fate (`fsdpzero.plan.fate_table.RULES`):
a key's fate is the first of its conditional rules (6.2, tried in order) whose condition holds, else its default
(6.1). `fsdpzero migrate` shows the fate a given config gets. Defaults are DeepSpeed {version}'s.

### 6.1 Default fate of each key

| key | DeepSpeed default | fate | how | conditional rules |
|---|---|---|---|---|
"""


def render_migration_doc() -> str:
    from pydantic import BaseModel

    from fsdpzero.config.load import default_at
    from fnmatch import fnmatchcase

    from fsdpzero.plan.fates import CONDITIONAL, FATES

    def default(key: str) -> str:
        d = default_at(tuple(key.split(".")))
        return "" if isinstance(d, (BaseModel, dict, list)) else f"`{json.dumps(d)}`"

    def cell(text: str) -> str:
        return text.replace("|", "/")

    def refs(key: str) -> str:
        return ", ".join(str(i) for i, r in enumerate(CONDITIONAL, 1) if fnmatchcase(key, r.pattern))

    rows = [f"| `{k}` | {default(k)} | {s} | {cell(d)} | {refs(k)} |" for k, (s, d) in sorted(FATES.items())]
    rules = [f"| {i} | `{r.pattern}` | {cell(r.when.text)} | {r.status} | {cell(r.how)} |"
             for i, r in enumerate(CONDITIONAL, 1)]
    return (GUIDE.format(version=COMPAT_VERSION) + "\n".join(rows) + "\n\n### 6.2 Conditional rules, in the order "
            "they are tried\n\n`{value}` and the like stand for the key's value and the config's settings.\n\n"
            "| # | key | when | fate | how |\n|---|---|---|---|---|\n" + "\n".join(rules) + "\n")


# ---------------------------------------------------------------- key lists in other docs, from the schema
def section_keys_markdown(section: str) -> str:
    """The bullet list of a ds_config section's keys, defaults and meanings, as the schema declares them (the
    model's field descriptions): docs print it between `<!-- keys of SECTION -->` markers, never by hand."""
    import textwrap
    from typing import get_args

    from pydantic import BaseModel

    from fsdpzero.config.schema import DSConfig

    declared = DSConfig.model_fields[section].annotation   # Optional[Model]
    model = next(t for t in (declared, *get_args(declared)) if isinstance(t, type) and issubclass(t, BaseModel))
    return "".join(textwrap.fill(f"- `{key}` (default `{json.dumps(f.default)}`): {f.description}.", 120,
                                 subsequent_indent="  ", break_on_hyphens=False) + "\n"
                   for key, f in model.model_fields.items())


def with_section_keys(doc: str) -> str:
    """`doc` with each marked key list re-printed from the schema."""
    import re

    pattern = re.compile(r"(<!-- keys of (\w+): printed from the schema[^>]*-->\n)(.*?)(<!-- end of keys -->)", re.S)
    return pattern.sub(lambda m: m.group(1) + section_keys_markdown(m.group(2)) + m.group(4), doc)


DOCS_WITH_KEYS = ("nvme.md",)


if __name__ == "__main__":       # python -m fsdpzero.cli.migrate --write-docs
    if sys.argv[1:] == ["--write-docs"]:
        from pathlib import Path
        docs = Path(__file__).resolve().parents[2].joinpath("docs")
        docs.joinpath("migration.md").write_text(render_migration_doc())
        for name in DOCS_WITH_KEYS:
            docs.joinpath(name).write_text(with_section_keys(docs.joinpath(name).read_text()))
