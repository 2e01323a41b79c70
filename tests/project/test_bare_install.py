"""What `pip install fsdpzero` without extras gives: the core dependencies only (torch, pydantic, safetensors[torch]
with its numpy, tqdm). Each case runs in a fresh interpreter with every extra's top-level module made unimportable
(`sys.modules[name] = None`: `import` fails and `importlib.util.find_spec` says absent, as in a bare venv).
.ci/wheel_check does the same from the built wheel in a real bare venv."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("transformers", "accelerate", "peft", "hydra", "omegaconf", "yaml", "tokenizers", "deepspeed", "ninja",
          "psutil", "matplotlib", "huggingface_hub")


def _bare_python(code: str, blocked=EXTRAS, args=(), launcher=()) -> subprocess.CompletedProcess:
    prologue = f"import sys\nfor _name in {tuple(blocked)!r}:\n    sys.modules[_name] = None\n"
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"fsdpzero_bare_{os.getpid()}_{abs(hash(code))}.py"
    script.write_text(prologue + textwrap.dedent(code))
    try:
        return subprocess.run([*launcher, str(script), *args] if launcher else [sys.executable, str(script), *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    finally:
        script.unlink(missing_ok=True)


def test_estimate_of_a_named_model_needs_no_extras(tmp_path):
    """`fsdpzero estimate llama-3-8b` (README: no download) runs without transformers; a config.json, which does need
    it, is one line saying so."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    p = _bare_python(f"""
        from fsdpzero.cli import main
        print("exit", main(["estimate", "llama-3-8b", "--gpus", "8", "--gpu-memory", "80"]))
        print("exit", main(["estimate", {str(tmp_path / "config.json")!r}]))
        """)
    assert "Traceback" not in p.stderr, p.stderr
    assert "llama-3-8b: 8030.3M params" in p.stdout and "fits: stage" in p.stdout
    assert p.stdout.count("exit 0") == 1 and "exit 2" in p.stdout
    errors = [line for line in p.stderr.splitlines() if line.startswith("fsdpzero estimate: error:")]
    assert len(errors) == 1 and "needs transformers" in errors[0] and "llama-3-8b" in errors[0], p.stderr


SAVE_LOAD = """
    import os, tempfile, torch
    import fsdpzero
    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": int(sys.argv[1])},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = fsdpzero.initialize(model=build(0), config=cfg)
    x = torch.randn(2, 8)
    engine.backward(engine(x).square().mean())
    engine.step()
    d = sys.argv[2]
    try:
        engine.save_checkpoint(d)
    except Exception as e:
        print("SAVE FAILED:", repr(str(e)), flush=True)
        with open(f"{d}.report.{os.environ.get('RANK', 0)}", "w") as f:   # the pipe's lines can interleave
            f.write(str(e))
        raise SystemExit(3)
    fresh, *_ = fsdpzero.initialize(model=build(1), config=cfg)
    fresh.load_checkpoint(d)
    a = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in engine.module.parameters()]
    b = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in fresh.module.parameters()]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    print("round trip ok", fresh.global_steps, flush=True)
"""


def test_save_and_load_with_core_dependencies_only(tmp_path):
    p = _bare_python(SAVE_LOAD, args=("1", str(tmp_path / "ckpt")),
                     launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"))
    assert p.returncode == 0 and "round trip ok 1" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_a_failed_save_names_its_own_error_on_every_rank(tmp_path):
    """The cross-rank error report (fsdpzero.dist) needs nothing beyond torch: with numpy missing too, a 2-rank save
    fails with the real cause (safetensors' torch API wants numpy), not with the report's own 'Numpy is not
    available'."""
    p = _bare_python(SAVE_LOAD, blocked=EXTRAS + ("numpy",), args=("2", str(tmp_path / "ckpt")),
                     launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"))
    # one report per rank, each in its own file: a report longer than a pipe's atomic write (4 KiB) came through
    # the shared stdout cut by the other rank's (CI: 'SAVE FAILED: SAVE FAILED: ...' left one report empty)
    reports = sorted(tmp_path.glob("ckpt.report.*"))
    assert [r.name for r in reports] == ["ckpt.report.0", "ckpt.report.1"], p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count("SAVE FAILED:") == 2
    for report in (r.read_text() for r in reports):
        assert "numpy halted" in report and "rng_" in report and "Numpy is not available" not in report, report
