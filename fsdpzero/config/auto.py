"""Resolve "auto" values the way the Hugging Face Trainer does, from an explicit context.

The context is a mapping of `transformers.TrainingArguments` names (per_device_train_batch_size, learning_rate,
...) plus `world_size`, `hidden_size` (model.config.hidden_size) and `num_training_steps` (or `max_steps`).
With `hf_defaults=True` the missing TrainingArguments names take that class's defaults (transformers 5.x).
Rules (transformers/integrations/deepspeed.py, `trainer_config_process` / `trainer_config_finalize`):
an "auto" is replaced; an explicit value that differs from a value the caller *gave* is a mismatch error;
only existing keys are touched. The hidden-size keys of stage 3 are filled only at stage 3, as HF does.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from fsdpzero.config.errors import Problem

# transformers.TrainingArguments defaults (5.x; warmup_steps < 1 is a ratio there, `warmup_ratio` is v4's name)
HF_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "learning_rate": 5e-5,
    "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0,
    "warmup_steps": 0, "warmup_ratio": 0.0, "max_steps": -1, "bf16": False, "fp16": False,
}
CONTEXT_KEYS = tuple(HF_DEFAULTS) + ("num_training_steps", "hidden_size", "world_size")
FLAGS = {"hidden_size": "--hidden-size H", "world_size": "--world-size N"}   # `fsdpzero migrate`'s own flags


def _how_to_pass(field: str) -> str:
    """The fix for an unresolved "auto": the context key, and the migrate/validate flag that carries it. A
    TrainingArguments name comes first from `--hf-defaults`, which fills every such name as the Trainer would."""
    flag = FLAGS.get(field, f"--set {field}=...")
    if field in HF_DEFAULTS:
        return (f"add --hf-defaults (TrainingArguments' defaults, {field}={HF_DEFAULTS[field]!r}, as the HF Trainer "
                f"fills them), or pass {field} (`fsdpzero migrate {flag}`), or write a value")
    return f"pass {field} in the context (`fsdpzero migrate {flag}`) or write a value"

STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")


class _Missing(Exception):
    def __init__(self, fields: str):
        self.fields = fields


def _get(ctx: Mapping[str, Any], name: str) -> Any:
    if ctx.get(name) is None:
        raise _Missing(name)
    return ctx[name]


def _num_steps(ctx: Mapping[str, Any]) -> int:
    if ctx.get("num_training_steps") is not None:
        return int(ctx["num_training_steps"])
    if ctx.get("max_steps") is not None and int(ctx["max_steps"]) > 0:
        return int(ctx["max_steps"])
    raise _Missing("num_training_steps (TrainingArguments.max_steps, or steps computed from the dataset)")


def _warmup_steps(ctx: Mapping[str, Any]) -> int:
    if ctx.get("warmup_steps") is None and ctx.get("warmup_ratio") is None:
        raise _Missing("warmup_steps")            # nothing given: no mismatch to check against
    ws = float(ctx.get("warmup_steps") or 0)
    if ws >= 1:
        return max(1, int(ws))
    ratio = ws if ws > 0 else float(ctx.get("warmup_ratio") or 0.0)
    if ratio <= 0:
        return 1                                   # HF keeps it positive: DeepSpeed >= 0.19.6 rejects 0
    return max(1, math.ceil(_num_steps(ctx) * ratio))


def _hidden(ctx: Mapping[str, Any]) -> int:
    try:
        return int(_get(ctx, "hidden_size"))
    except _Missing:
        raise _Missing("hidden_size (model.config.hidden_size; `fsdpzero migrate --hidden-size H`)") from None


# key -> (TrainingArguments field named in messages, resolver, must_match, only at ZeRO stage 3)
Rule = tuple[str, Callable[[Mapping[str, Any]], Any], bool, bool]
RULES: dict[str, Rule] = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size",
                                       lambda c: _get(c, "per_device_train_batch_size"), True, False),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",
                                    lambda c: _get(c, "gradient_accumulation_steps"), True, False),
    "train_batch_size": ("world_size * per_device_train_batch_size * gradient_accumulation_steps",
                         lambda c: _get(c, "world_size") * _get(c, "per_device_train_batch_size")
                         * _get(c, "gradient_accumulation_steps"), True, False),
    "gradient_clipping": ("max_grad_norm", lambda c: _get(c, "max_grad_norm"), True, False),
    "optimizer.params.lr": ("learning_rate", lambda c: _get(c, "learning_rate"), True, False),
    "optimizer.params.betas": ("adam_beta1, adam_beta2",
                               lambda c: [_get(c, "adam_beta1"), _get(c, "adam_beta2")], True, False),
    "optimizer.params.eps": ("adam_epsilon", lambda c: _get(c, "adam_epsilon"), True, False),
    "optimizer.params.weight_decay": ("weight_decay", lambda c: _get(c, "weight_decay"), True, False),
    "scheduler.params.warmup_min_lr": ("(always 0)", lambda c: 0, False, False),
    "scheduler.params.warmup_max_lr": ("learning_rate", lambda c: _get(c, "learning_rate"), True, False),
    "fp16.enabled": ("fp16", lambda c: bool(_get(c, "fp16")), True, False),
    "bf16.enabled": ("bf16", lambda c: bool(_get(c, "bf16")), True, False),
    "zero_optimization.reduce_bucket_size": ("hidden_size", lambda c: _hidden(c) ** 2, False, False),
    "zero_optimization.stage3_prefetch_bucket_size": ("hidden_size", lambda c: int(0.9 * _hidden(c) ** 2),
                                                      False, True),
    "zero_optimization.stage3_param_persistence_threshold": ("hidden_size", lambda c: 10 * _hidden(c),
                                                             False, True),
    "scheduler.params.total_num_steps": ("max_steps", _num_steps, True, False),
    "scheduler.params.warmup_num_steps": ("warmup_steps", _warmup_steps, True, False),
}


def _walk(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            yield path, node, k, v
            yield from _walk(v, path)


def resolve_autos(raw: dict, context: Mapping[str, Any] | None, *, hf_defaults: bool, strict: bool,
                  strict_sections: frozenset[str]) -> tuple[dict, list[Problem], list[str], dict, list[str]]:
    """Replace every "auto" in `raw` (in place). Returns (raw, problems, warnings, resolved, deferred):
    resolved maps key -> (value, source); deferred lists step keys left for the trainer to fill."""
    given = {k: v for k, v in (context or {}).items() if v is not None}
    ctx = {**HF_DEFAULTS, **given} if hf_defaults else dict(given)
    zero = raw.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else 0
    problems: list[Problem] = []
    warnings: list[str] = []
    resolved: dict[str, tuple[Any, str]] = {}
    deferred: list[str] = []

    for path, parent, key, value in list(_walk(raw)):
        rule = RULES.get(path)
        if value != "auto":
            if rule and rule[2]:        # fill_match: must agree with a value the caller gave (not a default)
                try:
                    want = rule[1](given)
                except (_Missing, TypeError, ValueError):
                    continue
                listy = isinstance(value, (list, tuple)) and isinstance(want, (list, tuple))
                same = list(value) == list(want) if listy else value == want
                if not same and value is not None:
                    problems.append(Problem(path, f"is {value!r} but TrainingArguments {rule[0]} gives "
                                                  f"{want!r} (the HF Trainer rejects this mismatch)",
                                            f'set `{path}` to "auto" or make the two agree'))
            continue
        if rule and not (rule[3] and stage != 3):
            try:
                parent[key] = rule[1](ctx)
                resolved[path] = (parent[key], rule[0])
            except _Missing as m:
                if hf_defaults and path in STEP_KEYS and "num_training_steps" in m.fields:
                    del parent[key]
                    deferred.append(path.rsplit(".", 1)[1])
                    warnings.append(f'{path}: "auto" is left for the trainer (needs {m.fields})')
                else:
                    problems.append(Problem(path, f'is "auto" and nothing resolves it: missing {m.fields}',
                                            _how_to_pass(m.fields.split(" ")[0])))
            continue
        section = path.split(".", 1)[0]
        if section in strict_sections and not strict:
            # DeepSpeed drops "auto" inside pydantic-validated sections before validation: silent default.
            del parent[key]
            resolved[path] = ("<DeepSpeed default>", "dropped as DeepSpeed does in strict sections")
            warnings.append(f'{path}: "auto" has no resolver; DeepSpeed drops it and uses its default')
        else:
            problems.append(Problem(path, '"auto" has no resolver here (neither the HF Trainer nor DeepSpeed '
                                          'fills it)', "write an explicit value"))
    return raw, problems, warnings, resolved, deferred
