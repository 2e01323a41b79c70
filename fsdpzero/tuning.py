"""Tuning knobs: how fsdpzero runs a plan, not what it computes (every setting gives the same result bits unless its
doc says otherwise). One typed, validated object, `Tuning`, read from three channels, later ones winning:

    defaults  <  environment (FSDPZERO_<NAME>)  <  initialize(..., tuning={...} | Tuning(...)) / a recipe's `tuning:`

Every `FSDPZERO_*` variable must be a knob (or one of the bench/test harness names below): a typo is an error that
names the nearest valid name, as the config layer does, never silently ignored. Values are parsed and checked here,
once; the wings receive plain typed values. Defaults are the fastest exact settings. The startup block (rank 0)
prints the knobs that differ from the defaults and where each came from.

Each engine's settings are built once, at wrap/initialize (`engine.tuning`, a frozen Tuning), and passed to what
needs them: the gradient-path builders, the checkpoint code (a save may be given its own: `tuning=`), and the ops
(as plain arguments). Nothing reads the environment or any process-wide knob state after that, so two engines in
one process (TRL's policy and reference model) each keep their own (tests/engine/test_tuning.py,
tests/project/test_layout.py). A function called without an engine (a standalone checkpoint save, a builder in a
test) builds its settings the same way, once, when called: `resolve()`.
fsdpzero_ops (ops/) never imports the library and keeps no settings: each call gets the engine's values as
arguments (`Tuning.cpu_adam_args()`, `Tuning.aio_args()`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

log = logging.getLogger("fsdpzero")

ENV_PREFIX = "FSDPZERO_"
# read by bench/ and tests/ (not by the library): allowed in the environment, not knobs
HARNESS_ENV = frozenset({"FSDPZERO_BENCH_CPU", "FSDPZERO_BENCH_RATIO", "FSDPZERO_GOLDEN_OUT",
                         "FSDPZERO_REGEN_GOLDENS", "FSDPZERO_TEST_INDUCTOR"})
CRASH_POINTS = ("before_data", "mid_write", "before_rename", "before_latest")   # fsdpzero.checkpoint's crash_point()
AIO_BACKENDS = ("auto", "io_uring", "libaio", "threads", "python")              # fsdpzero_ops.aio
CPU_ADAM_IMPLS = ("auto", "avx512", "avx2", "scalar", "reference")             # fsdpzero_ops.cpu_adam
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class TuningError(ValueError):
    """A bad knob: one line naming the knob (as written in its channel), the value and what is allowed."""


MAX_THREADS = 1024          # more threads than any host has cores: 65536 aborted the process, 1000000 segfaulted it
MAX_WRITER_THREADS = 256    # DCP writes one file per writer thread and rank


def _knob(default: Any, kind: str, doc: str, choices: tuple = (), most: int = MAX_THREADS) -> Any:
    """kind: bool | auto_bool (None = decided per run) | int (1..most) | auto_int (None = decided per run) |
    choice | str | opt_choice (None = off)."""
    return field(default=default, metadata={"kind": kind, "doc": doc, "choices": choices, "most": most})


@dataclass(frozen=True)
class Tuning:
    # ZeRO-Offload (fsdpzero/offload, docs/offload.md)
    offload_overlap: bool = _knob(True, "bool", "the CPU step runs while the next forward does; each unit's "
                                  "forward waits only for its own update; reads of the weights wait (exact)")
    offload_speculate: bool | None = _knob(None, "auto_bool", "step chunks during backward, committed only when "
                                           "the step does not clip (exact); shadow buffers of 14 bytes/param of "
                                           "host memory for the chunks speculated (auto: on, shadows for the last "
                                           "40% of the parameters; with several local ranks not the backward right "
                                           "after a clipped step; "
                                           "1: every backward, as many as half the available memory "
                                           "allows; those never reached in 5 steps are released); needs a GPU "
                                           "(staged copy buffers), no effect on a CPU-only run")
    offload_drop_shards: bool | None = _knob(None, "auto_bool", "free stage-2 device shards between forward and "
                                             "the step (auto: on with CUDA and no gradient accumulation; needs "
                                             "a GPU's staged copy buffers, no effect on a CPU-only run)")
    offload_threads: int | None = _knob(None, "auto_int", "CPU step threads (auto: one per CPU of this rank's core "
                                        "slice, fewer under a cgroup CPU quota and where ranks share a NUMA node "
                                        "(32 a node, at least 8 each); OMP_NUM_THREADS when the user set it "
                                        "to other than torchrun's 1; fsdpzero/host.py)")
    offload_speculate_threads: int | None = _knob(None, "auto_int", "threads of the speculative step during "
                                                  "backward (auto: offload threads less a quarter, less one)")
    offload_bind: bool | None = _knob(None, "auto_bool", "pin each local rank to its own slice of whole cores, on "
                                      "its GPU's NUMA node where every node has ranks (auto: with a GPU; 0: "
                                      "unpinned, usable cores / local ranks threads; 1: also on a CPU-only run)")
    offload_early_d2h: bool = _knob(True, "bool", "copy a unit's grads D2H as soon as its reduce-scatter is done")
    offload_profile: bool = _knob(False, "bool", "per-step timeline of the offload pipeline (rank 0, JSON lines)")
    offload_profile_file: str | None = _knob(None, "str", "where the timeline goes (appended; default stderr)")
    # ZeRO stage 1 (fsdpzero_ops.stage1, docs/stage1.md)
    stage1_ramp_buckets: bool = _knob(True, "bool", "small first/last buckets: short exposed ends")
    stage1_fold_grad_scale: bool = _knob(True, "bool", "clip/unscale factor applied inside the fused step")
    stage1_pipeline_step: bool = _knob(True, "bool", "fused Adam bucket by bucket, under the all-gather")
    stage1_forward_allgather: bool = _knob(False, "bool", "the all-gather finishes under the next forward")
    # the engine
    sync_overflow_check: bool = _knob(False, "bool", "decide an overflow skip on the host at once (one sync per "
                                      "step) instead of one step later on the device")
    compile: bool | None = _knob(None, "auto_bool", "torch.compile per transformer block (auto: as the config's "
                                 "compile section says; 1: on with its backend, default inductor; 0: off). "
                                 "Inductor may reorder float math: the one knob that can change result bits")
    # checkpoints (fsdpzero/checkpoint)
    ckpt_stream: bool = _knob(True, "bool", "stream NVMe-resident state through DCP instead of reading it whole")
    ckpt_writer_threads: int = _knob(4, "int", "DCP writer threads per rank", most=MAX_WRITER_THREADS)
    ckpt_convert_dir: str | None = _knob(None, "str", "where engine.load_checkpoint keeps a DeepSpeed checkpoint "
                                         "converted to ours (default: beside the source, <save_dir>/.fsdpzero-<tag>, "
                                         "where rank 0 may write; else $XDG_CACHE_HOME or ~/.cache, /fsdpzero/"
                                         "deepspeed). Multi-node with a read-only source: a directory every node "
                                         "sees")
    ckpt_crash_at: str | None = _knob(None, "opt_choice", "test hook: kill the process at this point of a save",
                                      CRASH_POINTS)
    # the C++ ops (fsdpzero_ops)
    aio_backend: str = _knob("auto", "choice", "NVMe I/O engine", AIO_BACKENDS)
    cpu_adam_impl: str = _knob("auto", "choice", "CPU Adam kernel", CPU_ADAM_IMPLS)
    no_build: bool = _knob(False, "bool", "never JIT-build the C++ ops: pure-torch reference paths")

    def __post_init__(self):
        for f in fields(self):   # Tuning(offload_threads="x") fails as clearly as the other channels
            object.__setattr__(self, f.name, _parse(f, getattr(self, f.name), f.name, "Tuning"))

    def non_defaults(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def replace(self, **changes: Any) -> "Tuning":
        return from_mapping(changes, base=self)

    # what fsdpzero_ops takes as arguments (it reads no knob and keeps none: each engine passes its own)
    def cpu_adam_args(self) -> dict[str, Any]:
        """fsdpzero_ops.cpu_adam's kernel choice: CPUAdam(..., **these), available_impls(build=...)."""
        return {"impl": self.cpu_adam_impl, "build": not self.no_build}

    def aio_args(self) -> dict[str, Any]:
        """fsdpzero_ops.aio's engine choice: AioHandle(config, **these)."""
        return {"backend": self.aio_backend, "build": not self.no_build}


KNOBS = {f.name: f for f in fields(Tuning)}


def env_name(knob: str) -> str:
    return ENV_PREFIX + knob.upper()


def _allowed(f) -> str:
    kind, choices = f.metadata["kind"], f.metadata["choices"]
    return {"bool": "one of 1/0/true/false", "auto_bool": "one of 1/0/true/false/auto",
            "int": f"an integer from 1 to {f.metadata['most']}",
            "auto_int": f"an integer from 1 to {f.metadata['most']} or auto", "str": "a string",
            "choice": f"one of {'/'.join(choices)}",
            "opt_choice": f"one of {'/'.join(choices)} (empty: off)"}[kind]


def _parse(f, value: Any, name: str, source: str) -> Any:
    """`value` for knob `f`, typed; TuningError naming `name` (as written in `source`), the value and the fix."""
    kind = f.metadata["kind"]

    def bad():
        return TuningError(f"fsdpzero tuning: {name} = {value!r} ({source}) is not valid: expected {_allowed(f)} "
                           f"({f.metadata['doc']})")

    text = value.strip().lower() if isinstance(value, str) else None
    if kind in ("bool", "auto_bool"):
        if kind == "auto_bool" and (value is None or text == "auto"):
            return None
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if text in TRUE or text in FALSE:
            return text in TRUE
        raise bad()
    if kind in ("int", "auto_int"):
        if kind == "auto_int" and (value is None or text == "auto"):
            return None
        try:
            number = int(text) if text is not None else value
        except ValueError:
            raise bad() from None
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= f.metadata["most"]:
            raise bad()
        return number
    if kind == "str":
        if value is None or (isinstance(value, str) and value):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise bad()
    if kind == "opt_choice" and (value is None or text == ""):
        return None
    if text in f.metadata["choices"]:
        return text
    raise bad()


def _unknown(name: str, source: str, candidates: list[str]) -> TuningError:
    from fsdpzero.config.errors import closest
    hit = closest(name, candidates, cutoff=0.6)
    fix = f"did you mean {hit}?" if hit else f"valid names: {', '.join(candidates)}"
    return TuningError(f"fsdpzero tuning: unknown knob {name} ({source}); {fix}")


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The knobs set in the environment, typed; an unknown FSDPZERO_* name is an error with a suggestion."""
    environ = os.environ if environ is None else environ
    out = {}
    names = [env_name(k) for k in KNOBS]
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in HARNESS_ENV:
            continue
        knob = var[len(ENV_PREFIX):].lower()
        if knob not in KNOBS:
            raise _unknown(var, "environment", names)
        out[knob] = _parse(KNOBS[knob], environ[var], var, "environment")
    return out


def from_mapping(values: Mapping[str, Any] | Tuning | None, base: Tuning | None = None,
                 source: str = "tuning") -> Tuning:
    """`base` (default: the defaults) with `values` applied: knob names as keys (case and a FSDPZERO_ prefix
    tolerated), or a Tuning whose non-default fields apply."""
    base = base if base is not None else Tuning()
    if values is None:
        return base
    if isinstance(values, Tuning):
        values = values.non_defaults()
    if not isinstance(values, Mapping):
        raise TuningError(f"fsdpzero tuning: expected a mapping of knob names to values or a Tuning ({source}), "
                          f"got {type(values).__name__}")
    changes = {}
    for key, value in values.items():
        knob = str(key).lower()
        knob = knob[len(ENV_PREFIX):] if knob.startswith(ENV_PREFIX.lower()) else knob
        if knob not in KNOBS:
            raise _unknown(str(key), source, list(KNOBS))
        changes[knob] = _parse(KNOBS[knob], value, str(key), source)
    return dataclasses.replace(base, **changes)


def resolve(explicit: Mapping[str, Any] | Tuning | None = None, environ: Mapping[str, str] | None = None,
            source: str = "tuning") -> Tuning:
    """defaults < environment < explicit."""
    return from_mapping(explicit, base=from_mapping(from_env(environ), source="environment"), source=source)


def or_defaults(tuning: Tuning | None) -> Tuning:
    """`tuning` as given (an engine's settings, passed down), or, for a call made without an engine (a standalone
    checkpoint save, a builder called by a test), the process defaults built now (defaults < environment), once,
    by that call. Only ever called on a parameter of the calling function (tests/project/test_layout.py)."""
    return tuning if tuning is not None else resolve()


def sources(explicit: Mapping[str, Any] | Tuning | None = None,
            environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Where each non-default knob came from: "env FSDPZERO_X" or "tuning"."""
    out = {k: f"env {env_name(k)}" for k in from_env(environ)}
    if explicit is not None:
        out.update({k: "tuning" for k in from_mapping(explicit).non_defaults()})
        if not isinstance(explicit, Tuning):
            out.update({k.lower().removeprefix(ENV_PREFIX.lower()): "tuning" for k in explicit})
    return out


def describe(tuning: Tuning, where: Mapping[str, str] | None = None) -> str:
    """One line: the non-default knobs (empty string when every knob is at its default)."""
    diff = tuning.non_defaults()
    if not diff:
        return ""
    where = where or {}
    parts = [f"{k}={v}" + (f" ({where[k]})" if k in where else "") for k, v in diff.items()]
    return "tuning (non-default): " + ", ".join(parts)


# -- an engine's settings ------------------------------------------------------------------------------------------
_printed: set[str] = set()   # startup lines already logged (a log de-duplication, not a setting)


def use(explicit: Mapping[str, Any] | Tuning | None = None, *, announce: bool = True) -> Tuning:
    """Called by wrap()/initialize(): build the engine's settings from every channel (validated before any process
    group exists) and log the non-defaults once (rank 0 logs at INFO). The result is the engine's alone: nothing
    of it is kept here."""
    tuning = resolve(explicit)
    line = describe(tuning, sources(explicit))
    if announce and line and line not in _printed:
        _printed.add(line)
        log.info(line)
    return tuning


def current() -> Tuning:
    """The process defaults now (defaults < environment), for what has no engine: the `fsdpzero env` report and
    tests. The library never reads it: it passes an engine's settings down (tests/project/test_layout.py)."""
    return resolve()


def table() -> str:
    """Every knob with its environment name, default and meaning (docs/tuning.md)."""
    rows = ["| knob | environment | default | allowed | what |", "|---|---|---|---|---|"]
    for name, f in KNOBS.items():
        default = "auto" if f.default is None and f.metadata["kind"].startswith("auto") else f.default
        rows.append(f"| `{name}` | `{env_name(name)}` | `{default}` | {_allowed(f)} | {f.metadata['doc']} |")
    return "\n".join(rows)


__all__ = ["Tuning", "TuningError", "KNOBS", "HARNESS_ENV", "env_name", "from_env", "from_mapping", "resolve",
           "or_defaults", "describe", "use", "current", "table"]
