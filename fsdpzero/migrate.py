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
    parser.add_argument("config", help="path to ds_config.json (JSON with optional comments)")
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


def evaluate(args: argparse.Namespace) -> tuple[int, dict]:
    """The migrate result as the --json object, and the exit status."""
    from fsdpzero.translate import translate
    result: dict[str, Any] = {"ok": False, "errors": [], "decisions": [], "plan": None, "warnings": [],
                              "compat_version": COMPAT_VERSION}
    env = Env(world_size=args.world_size, nodes=args.nodes, device_type=args.device)
    try:
        ctx = _parse_set(args.set)
        ctx["world_size"] = args.world_size
        if args.hidden_size is not None:
            ctx["hidden_size"] = args.hidden_size
        cfg = load_config(args.config, context=ctx, hf_defaults=args.hf_defaults, strict=args.strict)
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
    code, result = evaluate(args)
    plan: Plan | None = result.pop("_plan", None)
    cfg = result.pop("_cfg", None)
    out = sys.stdout
    if args.json:
        if args.command == "validate":
            result = {"ok": code != 2, "errors": result["errors"], "warnings": result["warnings"],
                      "compat_version": COMPAT_VERSION}
        json.dump(result, out, indent=2, default=str)
        out.write("\n")
        return code
    if getattr(args, "emit", None) and plan is not None:
        from fsdpzero.emit import emit_python, emit_yaml
        out.write(emit_yaml(cfg, plan, args.config) if args.emit == "yaml" else emit_python(plan))
        return code
    for w in result["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    if code == 2:
        print(f"{args.config}: invalid DeepSpeed config ({len(result['errors'])} problem(s)):")
        for e in result["errors"]:
            print(f"  {e['key'] or '<config>'}: {e['message']}" + (f"\n      fix: {e['suggestion']}"
                                                                 if e["suggestion"] else ""))
        return 2
    if args.command == "validate":
        print(f"{args.config}: valid (DeepSpeed {COMPAT_VERSION} semantics)"
              + (f"; {len(plan.unsupported)} unsupported feature(s), see `fsdpzero migrate`" if code else ""))
        return code
    _print_table(plan, show_all=args.all)
    counts = {s: sum(d.status == s for d in plan.decisions if d.explicit or args.all)
              for s in ("mapped", "approximated", "noop", "unsupported")}
    shown = sum(counts.values())
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    print(f"\n{shown} keys: {summary}. ZeRO stage {plan.shard.stage} on mesh {plan.shard.mesh_shape} "
          f"{plan.shard.mesh_dim_names}, {plan.precision.param_dtype} params, batch {plan.batch.train_batch_size} = "
          f"{plan.batch.micro_batch_size} x {plan.batch.gradient_accumulation_steps} x {args.world_size}.")
    if code == 1:
        print("NOT RUNNABLE as written: " + "; ".join(f"{d.key} ({d.detail})" for d in plan.unsupported
                                                        if d.explicit or args.all))
    else:
        print("runnable as written.")
    return code


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
