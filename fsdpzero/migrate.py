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
import sys
from typing import Any

from fsdpzero.config import COMPAT_VERSION, ConfigError, Problem, load_config
from fsdpzero.config.auto import CONTEXT_KEYS
from fsdpzero.plan import Env, Plan

SET_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
            "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "warmup_steps", "warmup_ratio",
            "max_steps", "num_training_steps", "bf16", "fp16")


def add_arguments(parser: argparse.ArgumentParser, name: str = "migrate") -> None:
    parser.add_argument("config", nargs="+", help="ds_config.json file(s) (JSON with optional comments); several "
                                                  "files are checked in one process, exit status = the worst")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="device type (default cuda)")
    parser.add_argument("--hidden-size", type=int, default=None, help="model hidden size, for the HF autos")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"TrainingArguments value for \"auto\" keys; KEY in {', '.join(SET_KEYS)}")
    parser.add_argument("--hf-defaults", action="store_true",
                        help="fill the other autos with transformers.TrainingArguments defaults")
    parser.add_argument("--strict", action="store_true", help="every unknown key and every unresolvable auto "
                                                              "is an error")
    parser.add_argument("--json", action="store_true", help="print one JSON object (see docs/migration.md)")
    if name == "migrate":
        parser.add_argument("--all", action="store_true", help="also list keys left at DeepSpeed's defaults")
        parser.add_argument("--emit", choices=("yaml", "python"), default=None,
                            help="print the Hydra experiment file (yaml) or a native FSDP2 snippet (python)")


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
                ctx[key] = int(num) if num.is_integer() and "." not in text and "e" not in low else num
            except ValueError:
                problems.append(Problem(f"--set {key}", f"{text!r} is not a number or true/false", ""))
    if problems:
        raise ConfigError(problems)
    return ctx


def evaluate(args: argparse.Namespace, path: str) -> tuple[int, dict]:
    """The migrate result as the --json object, and the exit status."""
    from fsdpzero.translate import translate
    result: dict[str, Any] = {"config": str(path), "ok": False, "errors": [], "decisions": [], "plan": None, "warnings": [],
                              "compat_version": COMPAT_VERSION}
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
        print("--emit takes one config", file=sys.stderr)
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
        from fsdpzero.emit import emit_python, emit_yaml
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
    _print_table(plan, show_all=args.all)
    counts = {s: sum(d.status == s for d in plan.decisions if d.explicit or args.all)
              for s in ("mapped", "approximated", "noop", "unsupported")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    print(f"\n{sum(counts.values())} keys: {summary}. ZeRO stage {plan.shard.stage} on mesh "
          f"{plan.shard.mesh_shape} {plan.shard.mesh_dim_names}, {plan.precision.param_dtype} params, batch "
          f"{plan.batch.train_batch_size} = {plan.batch.micro_batch_size} x {plan.batch.gradient_accumulation_steps}"
          f" x {args.world_size}.")
    if code == 1:
        print("NOT RUNNABLE as written: " + "; ".join(f"{d.key} ({d.detail})" for d in plan.unsupported))
    else:
        print("runnable as written.")


def _print_table(plan: Plan, show_all: bool) -> None:
    rows = [d for d in plan.decisions if d.explicit or show_all]
    def short(v):
        s = json.dumps(v, default=str)
        return s if len(s) <= 28 else s[:25] + "..."
    kw = max([len(d.key) for d in rows] + [3])
    vw = max([len(short(d.value)) for d in rows] + [5])
    print(f"{'key':<{kw}}  {'value':<{vw}}  {'fate':<12}  how")
    for d in rows:
        print(f"{d.key:<{kw}}  {short(d.value):<{vw}}  {d.status:<12}  {d.detail}"
              + ("" if d.explicit else "  (default)"))
