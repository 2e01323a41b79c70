"""`fsdpzero` command line: a thin dispatcher. Each subcommand lives in its own module, which provides
`add_arguments(parser)` and `run(args) -> int`; `command_module` imports only the one that runs, so
`fsdpzero migrate` never imports torch.
"""
from __future__ import annotations

import argparse
import sys

# command -> one-line help
COMMANDS = {
    "migrate": "translate a ds_config.json: the fate of every key, the FSDP2 plan",
    "validate": "check a ds_config.json; errors only",
    "estimate": "per-GPU / per-node memory of every ZeRO stage and offload option",
    "convert": "convert checkpoints: ours -> safetensors/fp32, DeepSpeed -> ours",
    "nvme-bench": "sweep aio settings on a disk and print the best `aio` section",
    "launch": "the `deepspeed` launcher's flags (--num_gpus, --hostfile, ...) run by torchrun",
    "env": "versions, GPUs, CPU SIMD / CPU Adam kernel, aio, ops built, launch layout: for bug reports",
}


def command_module(name: str):
    """The module that implements a command, imported now."""
    if name in ("migrate", "validate"):
        from fsdpzero.cli import migrate as module
    elif name == "estimate":
        from fsdpzero.cli import estimate as module
    elif name == "convert":
        from fsdpzero.cli import convert as module
    elif name == "nvme-bench":
        from fsdpzero_ops import aio_bench as module
    elif name == "launch":
        from fsdpzero.cli import launch as module
    elif name == "env":
        from fsdpzero.cli import env as module
    else:
        raise KeyError(name)
    return module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fsdpzero", description="DeepSpeed configs on native PyTorch FSDP2")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv[:1])
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module = command_module(name)
    cmd = argparse.ArgumentParser(prog=f"fsdpzero {name}", description=COMMANDS[name])
    module.add_arguments(cmd, name) if _takes_name(module.add_arguments) else module.add_arguments(cmd)
    args = cmd.parse_args(argv[1:])
    args.command = name
    try:
        return int(module.run(args) or 0)
    except (OSError, ValueError) as e:   # a missing or wrong folder, a bad value: one line, no traceback, exit 2
        print(f"fsdpzero {name}: error: {e}", file=sys.stderr)
        return 2


def _takes_name(fn) -> bool:
    import inspect
    return len(inspect.signature(fn).parameters) >= 2


if __name__ == "__main__":
    sys.exit(main())
