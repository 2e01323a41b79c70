"""`fsdpzero env`: one screen to paste into a bug report, in the spirit of `ds_report` and `accelerate env`.

    fsdpzero env            # what is installed and what a launch here would use; builds nothing
    fsdpzero env --build    # also JIT-builds the C++ ops now (CPU Adam, aio), as the first run would

Versions (torch, CUDA, NCCL, transformers, accelerate, peft, trl, DeepSpeed if installed), the GPUs, the CPU's SIMD
level and the CPU Adam kernel that will run, the aio backends, whether each op is built, and the process and thread
layout `fsdpzero launch` would use on this machine.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

PACKAGES = ("torch", "transformers", "accelerate", "peft", "trl", "safetensors", "pydantic", "deepspeed")
OPS = {"fsdpzero_cpu_adam": "CPU Adam (offload_optimizer)", "fsdpzero_aio": "aio (NVMe offload)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--build", action="store_true",
                        help="JIT-build the C++ ops now (else only report whether they are built)")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_simd(flags: set[str]) -> str:
    """The kernel fsdpzero's CPU Adam picks on a CPU with these /proc/cpuinfo flags (best_isa() in
    ops/csrc/cpu_adam_kernels.h, which also asks the OS; this reads the flags only)."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "scalar"


def _cpu_flags() -> tuple[str, set[str]]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or platform.machine(), set()
    model, flags = platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == platform.machine():
            model = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags


def op_built(name: str) -> bool:
    from fsdpzero_ops.build import extensions_dir
    return (extensions_dir() / name / f"{name}.so").is_file()


def report(build: bool = False) -> list[tuple[str, str]]:
    """(label, value) rows; imports torch, touches no GPU memory and no process group."""
    import torch
    rows: list[tuple[str, str]] = [("fsdpzero", _version("fsdpzero")), ("python", sys.version.split()[0]),
                                   ("platform", platform.platform())]
    for name in PACKAGES:
        value = _version(name)
        if name == "deepspeed" and value != "not installed":
            value += " (not used by fsdpzero; the test oracle only)"
        rows.append((name, value))
    cuda = torch.cuda.is_available()
    rows.append(("CUDA (torch build)", torch.version.cuda or "none (CPU build)"))
    if cuda:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as e:  # a build without NCCL
            nccl = f"unavailable ({type(e).__name__})"
        rows.append(("NCCL", nccl))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}"))
    else:
        rows.append(("GPUs", "none visible (launch runs gloo CPU ranks)"))
    model, flags = _cpu_flags()
    simd = cpu_simd(flags)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rows.append(("CPU", f"{model}, {cores} usable cores, SIMD {simd}, torch sees "
                        f"{torch.backends.cpu.get_cpu_capability()}"))
    if build:
        from fsdpzero_ops import cpu_adam
        cpu_adam.available_impls()
        from fsdpzero_ops import aio
        aio.available_backends()
    built = {name: op_built(name) for name in OPS}
    for name, what in OPS.items():
        rows.append((f"op {name}", f"{what}: {'built' if built[name] else 'not built (JIT-built at first use; fsdpzero env --build)'}"))
    from fsdpzero.tuning import current
    knobs = current()      # FSDPZERO_CPU_ADAM_IMPL / FSDPZERO_AIO_BACKEND, validated (a typo is an error)
    if knobs.cpu_adam_impl != "auto":
        rows.append(("CPU Adam kernel", f"{knobs.cpu_adam_impl} (the cpu_adam_impl knob)"))
    elif built["fsdpzero_cpu_adam"]:
        from fsdpzero_ops import cpu_adam
        impls = cpu_adam.available_impls()
        rows.append(("CPU Adam kernel", f"{impls[0]} (auto; available: {', '.join(impls)})"))
    else:
        rows.append(("CPU Adam kernel", f"{simd} once built (this CPU); the pure-torch reference path if the build "
                                        "fails"))
    if built["fsdpzero_aio"]:
        from fsdpzero_ops import aio
        backends = aio.available_backends()
        rows.append(("aio backend", f"{knobs.aio_backend if knobs.aio_backend != 'auto' else backends[0]} "
                                    f"({'the aio_backend knob' if knobs.aio_backend != 'auto' else 'auto'}; "
                                    f"available: {', '.join(backends)})"))
    else:
        rows.append(("aio backend", "python (threads) until the op is built"))
    from fsdpzero_ops.build import extensions_dir
    rows.append(("op build cache", str(extensions_dir())))
    # what `fsdpzero launch` would start here, and the threads each rank's CPU work gets
    ranks = torch.cuda.device_count() if cuda else 0
    omp = os.environ.get("OMP_NUM_THREADS")
    if ranks:
        layout = (f"{ranks} ranks (one per visible GPU), NCCL + gloo; offload CPU threads per rank "
                  f"{max(1, cores // ranks)} (cores / ranks)")
    else:
        layout = ("--num_gpus N gloo ranks (default 1); torch threads per rank: "
                  + (f"OMP_NUM_THREADS={omp}" if omp else f"torch's default ({torch.get_num_threads()} here)"))
    rows.append(("launch layout", layout))
    rows.append(("threads", f"torch intra-op {torch.get_num_threads()}, OMP_NUM_THREADS={omp or 'unset'}"))
    return rows


def run(args: argparse.Namespace) -> int:
    rows = report(build=args.build)
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0
