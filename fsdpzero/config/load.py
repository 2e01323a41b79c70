"""Load a ds_config (path | dict | JSON string) into a validated `DSConfig`, collecting every problem.

Order: read -> keys DeepSpeed 0.19.8 removed -> deprecated aliases renamed (warned) -> "auto" resolved ->
unknown keys judged (strict sections: error with the nearest key; lenient sections: a near-miss is an error,
anything else a warning, or an error with strict=True) -> pydantic types and ranges -> cross-field checks.
All problems are raised together as one ConfigError.
"""
from __future__ import annotations

import base64
import copy
import json
import math
import os
import re
import stat
import types
import typing
import warnings as _warnings
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

from fsdpzero.config import bounds, rules
from fsdpzero.config.auto import resolve_autos
from fsdpzero.config.errors import ConfigError, Problem, brief, closest, did_you_mean
from fsdpzero.config.schema import COMPAT_VERSION, DSConfig, Strict, STRICT_SECTIONS

NEAR_MISS_CUTOFF = 0.8      # an unknown lenient key this close to a real one is a typo, not another tool's key

# Top-level keys DeepSpeed 0.19.8 rejects outright (DeepSpeedConfigError): the feature was removed.
REMOVED_TOP_LEVEL = {
    "nebula": "Nebula checkpointing was removed", "compression_training": "the compression library was removed",
    "amp": "Apex AMP was removed; use fp16, bf16 or torch_autocast",
    "quantize_training": "MoQ / quantize_training was removed",
    "sparse_gradients": "sparse gradient compression was removed", "eigenvalue": "eigenvalue MoQ was removed",
    "sparse_attention": "Sparse Attention was removed", "elasticity": "elastic training was removed",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "top-level curriculum_learning was removed (use "
                           "data_efficiency.data_sampling.curriculum_learning)",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
}
REMOVED_ZERO = {"zeropp_loco_param": "LoCo-ZeRO++ was removed"}
CARRIED_REMOVED_ZERO = ("mics_shard_size", "mics_hierarchical_params_gather")   # fsdpzero maps MiCS to HSDP
LEGACY_TOP_LEVEL = ("allgather_size", "bfloat16")     # consumed by the alias pass


# ---------------------------------------------------------------- reading
def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ConfigError(Problem(k, "duplicate key (DeepSpeed's loader rejects duplicates)",
                                      "keep one occurrence"))
        seen[k] = v
    return seen


_COMMENT = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|#[^\n]*|/\*.*?\*/', re.S)
_TRAILING_COMMA = re.compile(r'"(?:\\.|[^"\\])*"|,(\s*[}\]])', re.S)


def parse_text(text: str) -> dict:
    """JSON plus the hjson conveniences seen in real configs: //, # and /* */ comments, trailing commas."""
    text = _COMMENT.sub(lambda m: m.group(0) if m.group(0).startswith('"') else "", text)
    text = _TRAILING_COMMA.sub(lambda m: m.group(0) if m.group(0).startswith('"') else m.group(1), text)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except ConfigError:
        raise
    except json.JSONDecodeError as e:
        raise ConfigError(Problem("", f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                                  "fix the syntax (comments and trailing commas are accepted)")) from None
    except RecursionError:
        raise ConfigError(Problem("", f"nested deeper than Python's JSON parser allows (more than {MAX_DEPTH} "
                                  "levels are refused anyway)", "flatten the config")) from None
    except ValueError as e:                    # CPython's 4300-digit limit on integers
        raise ConfigError(Problem("", f"not a usable number: {str(e).split(';')[0]}",
                                  "write the number with fewer digits")) from None


# Bounds on what the reader takes in: real configs are a few KiB deep 5 levels; a /dev/zero or a FIFO must not hang.
MAX_CONFIG_BYTES = 16 * 2**20
MAX_DEPTH = 32
INT64 = 2**63


def read_file(path: str) -> str:
    """The text of a config file: a regular file of at most MAX_CONFIG_BYTES, UTF-8 (a BOM is allowed).
    Opened non-blocking and checked with fstat before reading, so a FIFO, a device or a directory is refused
    without blocking or reading unbounded."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(Problem("", f"cannot open {path}: {e.strerror}", "pass a readable ds_config.json")) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(Problem("", f"{path} is a directory", "pass the ds_config.json file inside it"))
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(Problem("", f"{path} is not a regular file (a FIFO, device or socket)",
                                      "pass a ds_config.json file"))
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(Problem("", f"{path} is {st.st_size} bytes; a ds_config is at most "
                                      f"{MAX_CONFIG_BYTES >> 20} MiB", "pass a ds_config.json file"))
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)        # st_size can lie (/proc): read with a limit anyway
    except OSError as e:
        raise ConfigError(Problem("", f"cannot read {path}: {e.strerror or e}",
                                  "pass a readable ds_config.json")) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(Problem("", f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB",
                                  "pass a ds_config.json file"))
    return decode_text(data, path)


def decode_text(data: bytes, name: str) -> str:
    head = data[:4]
    # a BOM, or ASCII in UTF-16 (every other byte NUL: `{\0"\0` or `\0{\0"`)
    utf16 = data.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(head) == 4 and (
        (head[0] and not head[1] and head[2] and not head[3]) or (not head[0] and head[1] and not head[2] and head[3])))
    if utf16:
        raise ConfigError(Problem("", f"{name} is UTF-16 text; DeepSpeed reads configs as UTF-8",
                                  "save the file as UTF-8"))
    if b"\x00" in data:
        raise ConfigError(Problem("", f"{name} is binary (NUL bytes), not JSON text", "pass a ds_config.json file"))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(Problem("", f"{name} is not UTF-8 text (byte {e.start}: 0x{data[e.start]:02x}); "
                                  "DeepSpeed reads configs as UTF-8", "save the file as UTF-8 JSON")) from None


def check_shape(data: Any) -> None:
    """Depth, key types and integer range, walked without recursion (a deep input must not exhaust the stack
    of the recursive passes that follow). Integers beyond int64 size nothing real and overflow float()."""
    stack, bad = [(data, "", 0)], []
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(Problem(path.split(".", 1)[0], f"nested deeper than {MAX_DEPTH} levels",
                                      "flatten the config (a ds_config is a few levels deep)"))
        if isinstance(node, dict):
            for k, v in node.items():
                p = f"{path}.{k}" if path else str(k)
                if not isinstance(k, str):
                    bad.append(Problem(p, "keys must be strings", "use JSON object keys"))
                stack.append((v, p, depth + 1))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))
        elif isinstance(node, int) and not isinstance(node, bool) and not -INT64 <= node < INT64:
            bad.append(Problem(path, f"the integer {brief(node)} is out of range (beyond int64)",
                               "write a value that fits the setting"))
    if bad:
        raise ConfigError(bad)


def read_source(source: Any) -> dict:
    if isinstance(source, DSConfig) and source.raw:
        source = source.raw
    elif isinstance(source, BaseModel):
        source = source.model_dump(by_alias=True, exclude_unset=True)
    if isinstance(source, Mapping):
        check_shape(dict(source))
        data = copy.deepcopy(dict(source))
    elif isinstance(source, (str, Path)):
        s = str(source)
        if isinstance(source, str) and s.lstrip().startswith("{"):
            data = parse_text(s)
        elif os.path.lexists(s):
            try:
                data = parse_text(read_file(s))
            except ConfigError as e:           # a whole-file problem names the file
                raise ConfigError([p if p.key or s in p.message else Problem("", f"{s}: {p.message}", p.suggestion)
                                   for p in e.problems]) from None
        else:
            try:                                   # DeepSpeed also takes base64-encoded JSON
                data = parse_text(base64.urlsafe_b64decode(s).decode("utf-8"))
            except (ValueError, UnicodeDecodeError, ConfigError):
                raise ConfigError(Problem("", f"{brief(s, 80)} is neither an existing file, a JSON object nor "
                                          "base64 JSON", "pass a path to ds_config.json, a dict, or JSON "
                                          "text")) from None
    else:
        raise ConfigError(Problem("", f"cannot read a config from {type(source).__name__}",
                                  "pass a path, a dict or a JSON string"))
    if not isinstance(data, dict):
        raise ConfigError(Problem("", f"the config must be a JSON object, got {type(data).__name__}",
                                  "wrap the settings in { ... }"))
    check_shape(data)
    return data


# ---------------------------------------------------------------- deprecated names and removed features
def normalize(raw: dict, problems: list[Problem], notes: list[str]) -> dict:
    for key, why in REMOVED_TOP_LEVEL.items():
        if key in raw:
            problems.append(Problem(key, f"DeepSpeed {COMPAT_VERSION} rejects this key: {why}",
                                    f"remove the `{key}` entry"))
    if "bfloat16" in raw:
        if "bf16" in raw:
            notes.append("bfloat16: ignored because bf16 is present (DeepSpeed reads bf16 first)")
            raw.pop("bfloat16")
        else:
            notes.append("bfloat16: deprecated name, read as bf16")
            raw["bf16"] = raw.pop("bfloat16")
    if "seq_parallel_comm_data_type" in raw and "seq_parallel_communication_data_type" not in raw:
        notes.append("seq_parallel_comm_data_type: renamed seq_parallel_communication_data_type (DeepSpeed 0.16.5)")
        raw["seq_parallel_communication_data_type"] = raw.pop("seq_parallel_comm_data_type")
    allgather_size = raw.pop("allgather_size", None)
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):
        notes.append("zero_optimization: a bool is the deprecated form; true means stage 1")
        zero = raw["zero_optimization"] = {"stage": 1 if zero else 0}
        if zero["stage"]:
            zero["allgather_bucket_size"] = allgather_size if allgather_size is not None else 500_000_000
    if isinstance(zero, dict):
        for key, why in REMOVED_ZERO.items():
            if key in zero:
                problems.append(Problem(f"zero_optimization.{key}",
                                        f"DeepSpeed {COMPAT_VERSION} rejects this key: {why}",
                                        f"remove `zero_optimization.{key}`"))
        for key in CARRIED_REMOVED_ZERO:
            if key in zero:
                notes.append(f"zero_optimization.{key}: removed in DeepSpeed {COMPAT_VERSION} (MiCS); fsdpzero keeps "
                             "it as an HSDP (replicate, shard) mesh")
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old in zero:
                val = zero.pop(old)
                notes.append(f"zero_optimization.{old}: deprecated, use {new}")
                if new in zero and val:
                    problems.append(Problem(f"zero_optimization.{old}", f"cannot be given together with {new}",
                                            f"remove `{old}`"))
                elif val is True:
                    zero[new] = {"device": "cpu"}
                elif val not in (False, None):
                    problems.append(Problem(f"zero_optimization.{old}", f"must be true or false, got {val!r}",
                                            f"use `{new}: {{\"device\": \"cpu\"}}`"))
        if "cpu_offload_use_pin_memory" in zero:
            zero.pop("cpu_offload_use_pin_memory")
            notes.append("zero_optimization.cpu_offload_use_pin_memory: deprecated and ignored (as in DeepSpeed); "
                         "use offload_*.pin_memory")
        old = "stage3_gather_fp16_weights_on_model_save"
        if old in zero:
            val = zero.pop(old)
            if "stage3_gather_16bit_weights_on_model_save" in zero or "gather_16bit_weights_on_model_save" in zero:
                problems.append(Problem(f"zero_optimization.{old}", "cannot be given together with "
                                        "stage3_gather_16bit_weights_on_model_save", f"remove `{old}`"))
            else:
                notes.append(f"zero_optimization.{old}: deprecated, read as stage3_gather_16bit_weights_on_model_save")
                zero["stage3_gather_16bit_weights_on_model_save"] = val
    aio = raw.get("aio")
    if isinstance(aio, dict) and "thread_count" in aio:
        val = aio.pop("thread_count")
        if "intra_op_parallelism" not in aio:
            aio["intra_op_parallelism"] = val
        notes.append("aio.thread_count: the documented name; DeepSpeed reads intra_op_parallelism")
    return raw


# ---------------------------------------------------------------- unknown keys
def model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            m = model_of(arg)
            if m is not None:
                return m
    return None


def field_names(model: type[BaseModel]) -> dict[str, str]:
    """Every accepted spelling -> field name."""
    out = {}
    for name, f in model.model_fields.items():
        out[name] = name
        if f.alias:
            out[f.alias] = name
    return out


def judge_unknown(raw: dict, model: type[BaseModel], prefix: str, strict: bool,
                  problems: list[Problem], notes: list[str], unknown: dict[str, Any]) -> None:
    names = field_names(model)
    is_strict = issubclass(model, Strict)
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key in names:
            sub = model_of(model.model_fields[names[key]].annotation)
            if sub is not None and isinstance(value, dict):
                judge_unknown(value, sub, path + ".", strict, problems, notes, unknown)
            continue
        if not prefix and key in LEGACY_TOP_LEVEL:
            continue
        if is_strict:
            problems.append(Problem(path, "unknown key (DeepSpeed rejects unknown keys in this section)",
                                    did_you_mean(key, names) or f"valid keys: {', '.join(sorted(model.model_fields))}"))
        elif (hit := closest(key, names, NEAR_MISS_CUTOFF)) is not None:
            problems.append(Problem(path, "unknown key; DeepSpeed would silently ignore it",
                                    f"did you mean `{hit}`?"))
        elif strict:
            problems.append(Problem(path, "unknown key (strict mode)", "remove it or use a DeepSpeed key"))
        else:
            unknown[path] = value
            notes.append(f"{path}: unknown to DeepSpeed, ignored as DeepSpeed does")


# ---------------------------------------------------------------- "auto" where it cannot go
NO_AUTO = {"zero_optimization.stage": ("neither the HF Trainer nor DeepSpeed fills it (DeepSpeed drops it and "
                                       "silently runs stage 0)", "write 0, 1, 2 or 3")}


def _is_object(annotation: Any) -> bool:
    if annotation is dict or typing.get_origin(annotation) is dict or model_of(annotation) is not None:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_object(a) for a in typing.get_args(annotation))
    return False


def misplaced_autos(raw: dict, model: type[BaseModel] = DSConfig, prefix: str = "") -> list[Problem]:
    """"auto" written for a whole section, or for a key nothing may default (the stage). Checked before "auto" is
    resolved, as DeepSpeed checks a section's type first (`"bf16": "auto"` is a TypeError there: its config class
    is called with **section). The keys are removed from raw: the load fails anyway, and no later pass reports
    them again."""
    out = []
    names = field_names(model)
    for key in list(raw):
        if key not in names:
            continue
        value, path = raw[key], prefix + key
        annotation = model.model_fields[names[key]].annotation
        if isinstance(value, str) and value == "auto" and _is_object(annotation):
            out.append(Problem(path, '"auto" for a whole section; it must be a JSON object { ... } (DeepSpeed '
                               f"{COMPAT_VERSION} raises on a top-level one and drops a nested one silently)",
                               'write the section as an object and put "auto" on its keys, e.g. '
                               '"bf16": {"enabled": "auto"}'))
            del raw[key]
        elif isinstance(value, str) and value == "auto" and path in NO_AUTO:
            why, fix = NO_AUTO[path]
            out.append(Problem(path, f'"auto" has no resolver here: {why}', fix))
            del raw[key]
        elif isinstance(value, dict) and (sub := model_of(annotation)) is not None:
            out += misplaced_autos(value, sub, path + ".")
    return out


# ---------------------------------------------------------------- sizes given as floats
# Counts of elements or bytes. The HF DeepSpeed guide computes stage3_prefetch_bucket_size as 0.9 * d_model**2
# (943718.4 for d_model 1024) and configs write 5e8: a near-integer float is rounded (noted in the fate report;
# these are hints under FSDP2). A float far from any integer (0.5), a negative or a non-finite one stays an error.
_Z = "zero_optimization."
SIZE_KEYS = frozenset(
    [_Z + k for k in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size")]
    + [_Z + p + k for k in ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                            "max_live_parameters", "max_reuse_distance") for p in ("", "stage3_")]
    + [_Z + "offload_param.buffer_size", _Z + "offload_param.max_in_cpu", "aio.block_size",
       "checkpoint.writer.io_buffer_size"])
NEAR_INTEGER = 1e-3         # |x - round(x)| <= this x |x|


def round_sizes(raw: dict, notes: list[str]) -> dict[str, float]:
    """Round near-integer floats of SIZE_KEYS in raw, in place; returns path -> the value as written."""
    rounded = {}
    for path in sorted(SIZE_KEYS):
        *parents, key = path.split(".")
        node: Any = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(node.get(key), float) or not math.isfinite(node[key]):
            continue
        value = node[key]
        if value.is_integer():
            node[key] = int(value)                 # 5e8: exact, nothing to note
        elif abs(value - round(value)) <= NEAR_INTEGER * abs(value):
            node[key] = int(round(value))
            rounded[path] = value
            notes.append(f"{path}: {value!r} rounded to {node[key]} (a count of elements)")
    return rounded


# ---------------------------------------------------------------- pydantic errors -> problems
def default_at(loc: tuple) -> Any:
    model: Any = DSConfig
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        name = field_names(model).get(part)
        if name is None:
            return None
        f = model.model_fields[name]
        if part == loc[-1]:
            return f.get_default(call_default_factory=True)
        model = model_of(f.annotation)
    return None


def _hint(err: dict, loc: tuple) -> str:
    kind, value = err["type"], err.get("input")
    default = default_at(loc)
    tail = f" (DeepSpeed's default: {default!r})" if default is not None and not isinstance(default, BaseModel) else ""
    if kind == "literal_error" and isinstance(value, str):
        expected = re.findall(r"'([^']*)'", err["msg"])
        hit = closest(value, expected, 0.5)
        return (f"did you mean `{hit}`?" if hit else f"use one of {expected}") + tail
    if kind.startswith("int") or kind == "int_from_float":
        return "use a whole number" + tail
    if kind.startswith("bool"):
        return "use true or false" + tail
    if kind.startswith(("float", "greater", "less")):
        return "use a number in range" + tail
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return "this section must be a JSON object { ... }"
    if kind.startswith("list"):
        return "use a JSON list [ ... ]"
    return tail.strip(" ()") if tail else ""


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def pydantic_problems(exc: ValidationError, seen: set[str]) -> list[Problem]:
    out = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
        path = _path(loc)
        if err["type"] == "extra_forbidden" or path in seen:
            continue                               # already reported by judge_unknown (with a suggestion)
        seen.add(path)
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        shown = err.get("input")
        own = err["type"] in ("value_error", "assertion_error") or isinstance(shown, dict)
        msg = f"{msg[0].lower()}{msg[1:]}" + ("" if own else f", got {brief(shown)}")
        out.append(Problem(path, msg, _hint(err, loc)))
    return out


# ---------------------------------------------------------------- the entry point
def load_config(source: Any, *, context: Mapping[str, Any] | None = None, hf_defaults: bool = False,
                strict: bool = False) -> DSConfig:
    """Read, normalise, resolve "auto", validate. Raises ConfigError listing every problem."""
    raw = read_source(source)
    problems: list[Problem] = []
    notes: list[str] = []
    raw = normalize(raw, problems, notes)
    problems += misplaced_autos(raw)
    raw, auto_problems, auto_notes, resolved, deferred = resolve_autos(
        raw, context, hf_defaults=hf_defaults, strict=strict, strict_sections=STRICT_SECTIONS)
    dropped = [k for k, (v, _) in resolved.items() if v == "<DeepSpeed default>"]   # still written by the user
    explicit = sorted(set(_paths(raw)) | set(dropped))
    problems += auto_problems
    notes += auto_notes
    rounded = round_sizes(raw, notes)
    unknown: dict[str, Any] = {}
    judge_unknown(raw, DSConfig, "", strict, problems, notes, unknown)
    seen = {p.key for p in problems}
    cfg = None
    try:
        with _warnings.catch_warnings():
            _warnings.simplefilter("ignore")
            cfg = DSConfig.model_validate(raw)
    except ValidationError as e:
        problems += pydantic_problems(e, seen)
    problems += [p for p in rules.check_sections(raw, deferred) if p.key not in seen]
    if cfg is not None:
        problems += rules.check(cfg, raw, deferred)
        have = {p.key for p in problems}
        problems += [p for p in bounds.check(cfg) if p.key not in have]
    if problems:
        raise ConfigError(problems)
    cfg.record_load(raw=raw, notes=notes, explicit=explicit, unknown=unknown, autos=resolved, deferred=deferred,
                    rounded=rounded)
    return cfg


def _paths(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            yield p
            yield from _paths(v, p)
