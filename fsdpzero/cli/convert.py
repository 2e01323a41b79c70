"""`fsdpzero convert`: checkpoints -> consolidated weights, DeepSpeed -> ours (fsdpzero.checkpoint.convert does the
work, from the files alone).

    fsdpzero convert DIR --to safetensors|fp32 [--tag T] [--out OUT]      our DCP checkpoint -> model.safetensors
    fsdpzero convert DS_DIR --from deepspeed --to dcp|safetensors [--out OUT]
    fsdpzero convert DIR [--from deepspeed] --to universal [--out SAVE_DIR]   DeepSpeed's universal checkpoint format
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from pathlib import Path

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def shard_size(text: str) -> int:
    """--max-shard-size: bytes with a unit (5GB, 500MiB), at least 1 byte."""
    from fsdpzero.checkpoint.export import parse_size
    try:
        size = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use a size with a unit, such as 5GB or 500MiB") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1B")
    return size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="checkpoint directory (the save_dir holding `latest`, or one tag directory)")
    parser.add_argument("--from", dest="source", choices=["fsdpzero", "deepspeed"], default="fsdpzero")
    parser.add_argument("--to", choices=["safetensors", "fp32", "dcp", "universal"], required=True,
                        help="safetensors: weights in --dtype (default: as stored, fp32 masters); fp32: fp32 "
                             "safetensors; dcp: our resumable format (from deepspeed only); universal: DeepSpeed's "
                             "universal checkpoint (<out>/<tag>_universal + latest_universal; --out: the save dir, "
                             "default the source's)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    parser.add_argument("--out", default=None, help="output directory (default: <dir>/<tag>-<to>)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast floating weights (safetensors)")
    parser.add_argument("--max-shard-size", type=shard_size, default="5GB",
                        help="split safetensors above this size (default 5GB)")
    parser.add_argument("--config", default=None, help="a config.json to copy next to the weights (transformers)")


def _fail(message: str) -> int:
    print(f"fsdpzero convert: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def _model_config(path: str) -> str:
    """The --config file's text, checked as the config reader checks a ds_config (a regular UTF-8 file of at most
    16 MiB, read without blocking) and as a JSON object: it is copied next to the weights as config.json."""
    from fsdpzero.config import ConfigError
    from fsdpzero.config.load import read_file
    try:
        text = read_file(path)
        data = json.loads(text)
    except ConfigError as e:
        raise ValueError(f"--config: {e.problems[0].message}") from None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"--config {path}: not JSON ({str(e).splitlines()[0]}); pass a transformers "
                         "config.json") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: a transformers config.json is a JSON object, got "
                         f"{type(data).__name__}")
    return text


def run(args: argparse.Namespace) -> int:
    if args.source == "fsdpzero" and args.to == "dcp":
        return _fail("--to dcp converts DeepSpeed checkpoints (--from deepspeed); this one is already DCP: use "
                     "--to safetensors or --to fp32")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        return _fail(f"--out {args.out} is a file; pass a directory (created if missing)")
    if args.out is None:   # the default output goes beside the checkpoint, which may be on a read-only mount
        source = Path(args.dir)
        parent = source.parent if (args.source == "fsdpzero" and args.tag is None
                                   and (source / ".metadata").is_file()) else source
        if parent.is_dir() and not os.access(parent, os.W_OK):
            return _fail(f"{parent} is not writable (a read-only mount?), and the output goes there by default; "
                         f"pass --out DIR (the checkpoint itself is only read)")
    try:
        config_text = _model_config(args.config) if args.config else None
    except ValueError as e:
        return _fail(str(e))
    import torch
    from torch.distributed.checkpoint import CheckpointException
    dtype = getattr(torch, _DTYPES["fp32" if args.to == "fp32" else args.dtype]) if (
        args.to == "fp32" or args.dtype) else None
    try:
        if args.to == "universal":
            if args.dtype or args.config:
                return _fail("--to universal writes fp32 masters and optimizer states; --dtype and --config do not "
                             "apply")
            from fsdpzero.checkpoint.convert import to_universal
            out = to_universal(args.dir, args.tag, args.out, source=args.source)
        elif args.source == "deepspeed":
            from fsdpzero.checkpoint.convert import deepspeed_to_ours
            out = deepspeed_to_ours(args.dir, args.tag, args.out, to=args.to, dtype=dtype,
                                    max_shard_size=args.max_shard_size)
        else:
            from fsdpzero.checkpoint.convert import dcp_to_safetensors
            out = dcp_to_safetensors(args.dir, args.tag, args.out, dtype=dtype, max_shard_size=args.max_shard_size)
    # the checkpoint wing's CheckpointError is a RuntimeError; a refused or truncated pickle and torch's reader
    # errors are what an unreadable checkpoint raises: one line, exit 2 (OSError/ValueError: main does the same)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
        return _fail(f"{args.dir}: {e}")
    except CheckpointException as e:   # torch's, a BaseException: one line all the same
        from fsdpzero.checkpoint.agree import describe
        return _fail(f"{args.dir}: reading the checkpoint failed: {describe(e)}")
    if config_text is not None:
        (Path(out) / "config.json").write_text(config_text)
    print(f"wrote {out}")
    return 0
