"""GPU loss parity with DeepSpeed: fsdpzero runs each case of tests/golden_cases.py on 2 GPUs (NCCL) with the same
ds_config, model, data and seed that DeepSpeed 0.19.8 ran to write tests/assets/ds_golden_gpu.json, and its per-step
losses must follow DeepSpeed's curve. Not part of CPU CI; run with

    pytest -m gpu tests/engine/test_gpu_golden.py -s      (FSDPZERO_GOLDEN_OUT=ours.json also writes our curves)

Tolerances (set from the first H200 run, torch 2.11 + DeepSpeed 0.19.8, observed values in brackets):
- loss, max |ours - DeepSpeed| over the 40 steps relative to the first loss: fp32 1e-5 [5.6e-7]; bf16 / fp16 1e-2
  [4.0e-3]. fp32 is the same math in another summation order (DeepSpeed all-reduces buckets, FSDP2
  reduce-scatters). bf16/fp16: DeepSpeed reduces gradients in the compute dtype at stages 2/3 and keeps its own
  bf16 accumulation at stage 1 (docs/deepspeed_differences.md); we reduce in fp32.
- global grad norm, relative: fp32 every step 1e-4 [6e-6]; bf16 / fp16 the first 10 steps 2e-2 [5.6e-3] and the
  median step 5e-2 [2.1e-2]. Once the model memorises its batches, single late steps differ by up to ~20 % in
  bf16: the two trajectories have drifted apart by rounding, and the norm of a near-converged step is sensitive to
  it, while the losses still agree to 4e-3.
Grad norms are compared on the steps both engines applied (fp16 overflow steps report None, -1 or inf).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests import golden_cases as gc
from tests.multirank import free_port

pytestmark = pytest.mark.gpu
TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}
NORM_FIRST10 = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}
NORM_MEDIAN = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}


def _rank(rank: int, world: int, port: int, workdir: str, names: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    import fsdpzero
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    golden = json.loads(Path(gc.GOLDEN).read_text())["cases"]
    out = {}
    for name in names:
        cfg = golden[name]["config"]
        engine, *_ = fsdpzero.initialize(model=gc.build_model(device), config=cfg)
        out[name] = gc.train(engine, rank, cfg["gradient_accumulation_steps"], device)
        del engine
        torch.cuda.empty_cache()
    if rank == 0:
        Path(workdir, "ours.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def curves():
    if torch.cuda.device_count() < gc.WORLD:
        pytest.skip("needs 2 GPUs")
    golden = json.loads(Path(gc.GOLDEN).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(gc.WORLD, free_port(), tmp, list(golden["cases"])), nprocs=gc.WORLD,
                           start_method="spawn", join=True)
        ours = json.loads(Path(tmp, "ours.json").read_text())
    if os.environ.get("FSDPZERO_GOLDEN_OUT"):
        Path(os.environ["FSDPZERO_GOLDEN_OUT"]).write_text(json.dumps(ours, indent=1))
    return golden["cases"], ours


@pytest.mark.parametrize("name", list(gc.CASES))
def test_loss_curve_follows_deepspeed(curves, name):
    golden, ours = curves
    ds, me = golden[name], ours[name]
    dtype = name.split("_")[1]
    scale = ds["losses"][0]
    diff = max(abs(a - b) for a, b in zip(me["losses"], ds["losses"])) / scale
    assert ds["losses"][-1] < ds["losses"][0] - 1.0, "the golden curve must fall, or agreement proves nothing"
    ok = lambda x: x is not None and math.isfinite(x) and x >= 0  # noqa: E731  (DeepSpeed: -1/inf on overflow)
    rel = [abs(a - b) / max(b, 1e-12) for a, b in zip(me["grad_norms"], ds["grad_norms"]) if ok(a) and ok(b)]
    first10, median = max(rel[:10]), sorted(rel)[len(rel) // 2]
    print(f"{name}: max rel loss diff {diff:.2e} (tol {TOL[dtype]:.0e}); rel grad-norm diff first 10 steps "
          f"{first10:.2e}, median {median:.2e}; DeepSpeed {ds['losses'][0]:.4f}->{ds['losses'][-1]:.4f}, "
          f"ours {me['losses'][0]:.4f}->{me['losses'][-1]:.4f}")
    assert len(me["losses"]) == len(ds["losses"]) == gc.STEPS
    assert diff <= TOL[dtype]
    assert len(rel) >= gc.STEPS - 5 and first10 <= NORM_FIRST10[dtype] and median <= NORM_MEDIAN[dtype]
