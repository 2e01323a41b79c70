"""Write the golden GPU loss curves of tests/assets/ds_golden_gpu.json with real DeepSpeed (0.19.8), for the cases
of tests/golden_cases.py; tests/engine/test_gpu_golden.py runs fsdpzero on the same configs and compares.

Run on a machine with 2 GPUs, from the repository root (deepspeed from the [oracle] extra; only this script and the
benches import it):
    torchrun --standalone --nproc_per_node=2 tests/generators/make_ds_golden.py [--cases z1_bf16,...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import golden_cases as gc  # noqa: E402


def main() -> None:
    import deepspeed
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(gc.CASES))
    ap.add_argument("--out", default=gc.GOLDEN)
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()
    assert dist.get_world_size() == gc.WORLD
    out = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "steps": gc.STEPS, "cases": {}}
    for name in args.cases.split(","):
        cfg = gc.CASES[name]
        model = gc.build_model(device)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        res = gc.train(engine, rank, cfg["gradient_accumulation_steps"], device)
        out["cases"][name] = {"config": cfg, **res}
        if rank == 0:
            print(f"{name}: loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}", flush=True)
        del engine, model
        torch.cuda.empty_cache()
    if rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
