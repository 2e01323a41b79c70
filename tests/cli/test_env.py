"""`fsdpzero env`: one screen for a bug report, each line true to this machine: the installed versions as
importlib.metadata reports them, the GPUs torch sees, the CPU SIMD level from /proc/cpuinfo and the CPU Adam kernel
the built op picks, the ops' build state, and a bad knob as one line."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from fsdpzero.cli.env import cpu_simd

ROOT = Path(__file__).resolve().parents[2]
FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FSDPZERO_")}
    return subprocess.run([*FSDPZERO, "env", *args], cwd=ROOT, env={**environ, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=300)


def test_env_reports_this_machine():
    import torch

    from fsdpzero.cli.env import report
    rows = dict(report())
    for name in ("torch", "transformers", "accelerate", "peft"):
        assert rows[name].split()[0] == importlib.metadata.version(name), (name, rows[name])
    assert ("GPUs" in rows) == (not torch.cuda.is_available())
    simd = cpu_simd(set(open("/proc/cpuinfo").read().split()))
    assert f"SIMD {simd}" in rows["CPU"]
    from fsdpzero_ops.build import extensions_dir
    if (extensions_dir() / "fsdpzero_cpu_adam" / "fsdpzero_cpu_adam.so").is_file():
        from fsdpzero_ops import cpu_adam
        assert rows["CPU Adam kernel"].split()[0] == cpu_adam.available_impls()[0] == simd
        assert rows["op fsdpzero_cpu_adam"].endswith(": built")
    assert "gloo" in rows["launch layout"] or "NCCL" in rows["launch layout"]
    # the command prints every row, one screen
    p = _run()
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == len(rows) <= 30
    assert all(line.startswith(k) and line.rstrip().endswith(v.rstrip()) for line, (k, v) in zip(lines, report()))


def test_env_names_a_knob_override_and_refuses_a_typo():
    p = _run(FSDPZERO_CPU_ADAM_IMPL="scalar")
    assert p.returncode == 0 and "scalar (the cpu_adam_impl knob)" in p.stdout, p.stdout
    p = _run(FSDPZERO_CPU_ADAM_IMPL="avx3")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "FSDPZERO_CPU_ADAM_IMPL" in p.stderr


def test_simd_level_from_cpu_flags():
    assert cpu_simd({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}) == "avx512"
    assert cpu_simd({"avx512f", "avx2", "fma", "f16c"}) == "avx2"      # AVX-512 needs BW/VL/DQ too
    assert cpu_simd({"avx2", "fma", "f16c", "sse4_2"}) == "avx2"
    assert cpu_simd({"avx2", "f16c"}) == "scalar"                      # the AVX2 kernel uses FMA
    assert cpu_simd({"neon"}) == "scalar"
