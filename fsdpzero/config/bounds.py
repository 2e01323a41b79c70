"""Bounds fsdpzero adds to DeepSpeed's types: every value that sizes memory, threads or loops, or divides.

DeepSpeed accepts `fp16.initial_scale_power: 10**40` (2**that never finishes), `aio.intra_op_parallelism: 100000`
(threads), `hysteresis: 0` (the loss scale never drops), `sub_group_size: 0`; they fail at run time, after the
process group exists, or hang. Here they are errors of the config, with the key, the value and the fix. The
pydantic models keep DeepSpeed's own bounds (an oracle test compares them); these run after them, on the validated
config. Optimizer and scheduler kwargs are bounded in rules.py.
"""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from fsdpzero.config.errors import Problem, brief
from fsdpzero.config.schema import DSConfig

INT32 = 2**31 - 1
ALIGN = 4096                # O_DIRECT: aio requests are cut into blocks of this alignment (ops/aio.py's ALIGN)


@dataclass(frozen=True)
class Bound:
    key: str                # canonical DeepSpeed spelling, dotted
    lo: float
    hi: float
    why: str                # what the value sizes, in the message
    when: str = ""          # "" always; "nvme": some offload device is nvme; "nvme_optimizer": offload_optimizer


_Z = "zero_optimization."
BOUNDS = (
    # 2**x must be a finite fp32 number (a test may start above 2**64 to force overflows; 10**40 never returned)
    Bound("fp16.initial_scale_power", 0, 127, "the first loss scale is 2**initial_scale_power, an fp32 number"),
    Bound("fp16.hysteresis", 1, INT32, "overflows tolerated before the scale drops; 0 never lowers it"),
    Bound("fp16.loss_scale", 0, 2.0**64, "a static loss scale; 0 is dynamic"),
    Bound("fp16.min_loss_scale", 0, 2.0**64, "the floor of the dynamic loss scale"),
    Bound("fp16.loss_scale_window", 0, INT32, "steps without overflow before the scale grows"),
    Bound("train_batch_size", 1, INT32, "samples per optimizer step"),
    Bound("train_micro_batch_size_per_gpu", 1, INT32, "samples per rank and forward"),
    Bound("gradient_accumulation_steps", 1, INT32, "micro-steps per optimizer step"),
    Bound("steps_per_print", 1, INT32, "steps between progress lines; 0 would divide by zero"),
    Bound("gradient_clipping", 0, math.inf, "the gradient-norm clip; 0 is off"),
    Bound("gradient_predivide_factor", 0, math.inf, "the gradient pre-division factor"),
    # 0 is legal in DeepSpeed (a sub-group per parameter, real configs use it); NVMeAdam needs >= 1 element
    Bound(_Z + "sub_group_size", 1, 2**63 - 1, "parameter elements per NVMe optimizer sub-group", "nvme_optimizer"),
    Bound(_Z + "sub_group_size", 0, 2**63 - 1, "parameter elements per optimizer sub-group"),
    Bound(_Z + "reduce_bucket_size", 1, 2**63 - 1, "elements per gradient bucket"),
    Bound(_Z + "allgather_bucket_size", 0, 2**63 - 1, "elements per all-gather bucket"),
    Bound(_Z + "stage3_prefetch_bucket_size", 0, 2**63 - 1, "elements prefetched ahead"),
    Bound(_Z + "stage3_max_live_parameters", 0, 2**63 - 1, "parameter elements kept gathered"),
    Bound(_Z + "zero_hpz_partition_size", 0, INT32, "ranks of the secondary partition"),
    Bound(_Z + "offload_optimizer.buffer_count", 1, 1024, "pinned swap buffers of the NVMe optimizer", "nvme"),
    Bound(_Z + "offload_param.buffer_count", 1, 1024, "pinned swap buffers of the NVMe parameter swapper", "nvme"),
    Bound("aio.block_size", ALIGN, 2**30, "bytes per aio request chunk"),
    Bound("aio.queue_depth", 1, 1024, "aio requests in flight per thread"),
    Bound("aio.intra_op_parallelism", 1, 256, "aio threads per request"),
    Bound("checkpoint.writer.io_buffer_size", 1, 2**40, "bytes of the checkpoint writer's buffer"),
    Bound("comet.samples_log_interval", 1, INT32, "samples between Comet logs"),
)


def value_at(cfg: DSConfig, key: str) -> Any:
    """The validated value of a canonical dotted key, or None where a section on the way is absent."""
    node: Any = cfg
    for part in key.split("."):
        if node is None:
            return None
        fields = type(node).model_fields
        name = next((n for n, f in fields.items() if part in (n, f.alias)), part)
        node = getattr(node, name, None)
    return node


def _default(key: str) -> Any:
    """DeepSpeed's default of a canonical dotted key (the schema's), or None."""
    model: Any = DSConfig
    for part in key.split("."):
        f = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if f is None:
            return None
        subs = [a for a in (f.annotation, *typing.get_args(f.annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)]
        if not subs:
            return f.get_default(call_default_factory=True)
        model = subs[0]
    return None


def _num(v: float) -> str:
    if v == math.inf:
        return "inf"
    if v >= 2**20 and float(v).is_integer():
        for n, tail in ((int(v).bit_length() - 1, ""), (int(v).bit_length(), "-1")):
            if int(v) == 2**n - (1 if tail else 0):
                return f"2**{n}{tail}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def check(cfg: DSConfig) -> list[Problem]:
    z = cfg.zero_optimization
    nvme_opt = z.offload_optimizer is not None and z.offload_optimizer.device == "nvme"
    nvme = nvme_opt or (z.offload_param is not None and z.offload_param.device == "nvme")
    out = []
    for b in BOUNDS:
        if (b.when == "nvme" and not nvme) or (b.when == "nvme_optimizer" and not nvme_opt) \
                or any(p.key == b.key for p in out):
            continue
        v = value_at(cfg, b.key)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            out.append(Problem(b.key, f"is {brief(v)}; must be a finite number ({b.why})", _fix(b)))
        elif not b.lo <= v <= b.hi:
            out.append(Problem(b.key, f"is {brief(v)}; must be between {_num(b.lo)} and {_num(b.hi)} ({b.why})",
                               _fix(b)))
    bs = cfg.aio.block_size if cfg.aio is not None else None
    if isinstance(bs, int) and ALIGN <= bs <= 2**30 and bs % ALIGN:
        out.append(Problem("aio.block_size", f"is {bs}; must be a multiple of {ALIGN} (O_DIRECT alignment)",
                           f"use {max(ALIGN, bs // ALIGN * ALIGN)} (DeepSpeed's default: 1048576)"))
    return out


def _fix(b: Bound) -> str:
    d = _default(b.key)
    return f"set {b.key} within [{_num(b.lo)}, {_num(b.hi)}]" + (
        f" (DeepSpeed's default: {d!r})" if isinstance(d, (int, float)) and not isinstance(d, bool) else "")
