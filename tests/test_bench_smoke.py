"""bench/vs_deepspeed.py end to end on 2 gloo ranks (tiny model, fp32): JSON rows appear and fsdpzero's per-step
losses match a hand-written FSDP2 run with the same seed and data (rtol 1e-4: only reduction order differs)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_vs_deepspeed_cpu_smoke(tmp_path):
    env = dict(os.environ, FSDPZERO_BENCH_CPU="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "bench/vs_deepspeed.py"), "--matrix", "smoke", "--nproc", "2",
           "--out", str(tmp_path), "--impls", "fsdpzero", "plain_fsdp2", "--steps", "3", "--warmup", "1"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert res.returncode == 0, res.stdout + res.stderr
    ours = json.loads(next(tmp_path.glob("*__fsdpzero__n2.json")).read_text())
    plain = json.loads(next(tmp_path.glob("*__plain_fsdp2__n2.json")).read_text())
    for r in (ours, plain):
        assert r["world_size"] == 2 and r["dtype"] == "fp32" and r["tokens_per_s_per_gpu"] > 0
        assert len(r["losses"]) == 4 and r["launch_to_first_step_s"] > 0
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert ours["losses"][-1] < ours["losses"][0]   # the optimizer steps really happen
    assert "| step s |" in (tmp_path / "summary.md").read_text()
