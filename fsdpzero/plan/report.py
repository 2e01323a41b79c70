"""The fate report: one table of the config's keys, their values and fates, shared by `fsdpzero migrate` and the
engine's startup log, so the two never disagree."""
from __future__ import annotations

import json

from fsdpzero.plan.types import Plan

STATUSES = ("mapped", "approximated", "noop", "unsupported")
NOT_MAPPED = STATUSES[1:]


def _short(value) -> str:
    s = json.dumps(value, default=str)
    return s if len(s) <= 28 else s[:25] + "..."


def fate_rows(plan: Plan, show_all: bool = False, statuses: tuple[str, ...] = STATUSES) -> list:
    """The decisions shown: the keys the config set, or every key DeepSpeed reads when show_all; of `statuses`."""
    return [d for d in plan.decisions if (d.explicit or show_all) and d.status in statuses]


def fate_table(plan: Plan, show_all: bool = False, statuses: tuple[str, ...] = STATUSES) -> str:
    """key | value | fate | how, one line a key; defaulted keys (show_all) are marked `(default)`."""
    rows = fate_rows(plan, show_all, statuses)
    kw = max([len(d.key) for d in rows] + [3])
    vw = max([len(_short(d.value)) for d in rows] + [5])
    lines = [f"{'key':<{kw}}  {'value':<{vw}}  {'fate':<12}  how"]
    for d in rows:
        lines.append(f"{d.key:<{kw}}  {_short(d.value):<{vw}}  {d.status:<12}  {d.detail}"
                     + ("" if d.explicit else "  (default)"))
    return "\n".join(lines)


def fate_counts(plan: Plan, show_all: bool = False) -> dict[str, int]:
    rows = fate_rows(plan, show_all)
    return {s: sum(d.status == s for d in rows) for s in STATUSES}


def summary_line(plan: Plan, show_all: bool = False) -> str:
    """The counts of each fate and the shape of the run, in one line."""
    counts = fate_counts(plan, show_all)
    fates = ", ".join(f"{n} {s}" for s, n in counts.items())
    b = plan.batch
    tp = plan.tensor_parallel.size
    return (f"{sum(counts.values())} keys: {fates}. ZeRO stage {plan.shard.stage} on mesh {plan.shard.mesh_shape} "
            f"{plan.shard.mesh_dim_names}" + (f" x tp {tp}" if tp > 1 else "") + f", {plan.precision.param_dtype} "
            f"params, batch {b.train_batch_size} = "
            f"{b.micro_batch_size} x {b.gradient_accumulation_steps} x "
            f"{b.train_batch_size // max(1, b.micro_batch_size * b.gradient_accumulation_steps)}.")
