"""`fsdpzero convert`: checkpoints -> consolidated weights, DeepSpeed -> ours (fsdpzero.checkpoint.convert does the
work, from the files alone).

    fsdpzero convert DIR --to safetensors|fp32 [--tag T] [--out OUT]      our DCP checkpoint -> model.safetensors
    fsdpzero convert DS_DIR --from deepspeed --to dcp|safetensors [--out OUT]
"""
from __future__ import annotations

import argparse
from pathlib import Path

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="checkpoint directory (the save_dir holding `latest`, or one tag directory)")
    parser.add_argument("--from", dest="source", choices=["fsdpzero", "deepspeed"], default="fsdpzero")
    parser.add_argument("--to", choices=["safetensors", "fp32", "dcp"], required=True,
                        help="safetensors: weights in --dtype (default: as stored, fp32 masters); fp32: fp32 "
                             "safetensors; dcp: our resumable format (from deepspeed only)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    parser.add_argument("--out", default=None, help="output directory (default: <dir>/<tag>-<to>)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast floating weights (safetensors)")
    parser.add_argument("--max-shard-size", default="5GB", help="split safetensors above this size (default 5GB)")
    parser.add_argument("--config", default=None, help="a config.json to copy next to the weights (transformers)")


def run(args: argparse.Namespace) -> int:
    import shutil

    import torch
    dtype = getattr(torch, _DTYPES["fp32" if args.to == "fp32" else args.dtype]) if (
        args.to == "fp32" or args.dtype) else None
    if args.source == "deepspeed":
        from fsdpzero.checkpoint.convert import deepspeed_to_ours
        out = deepspeed_to_ours(args.dir, args.tag, args.out, to=args.to, dtype=dtype,
                                max_shard_size=args.max_shard_size)
    else:
        if args.to == "dcp":
            raise SystemExit("fsdpzero convert: --to dcp converts DeepSpeed checkpoints; this one is already DCP")
        from fsdpzero.checkpoint.convert import dcp_to_safetensors
        out = dcp_to_safetensors(args.dir, args.tag, args.out, dtype=dtype, max_shard_size=args.max_shard_size)
    if args.config:
        shutil.copy(args.config, Path(out) / "config.json")
    print(f"wrote {out}")
    return 0
