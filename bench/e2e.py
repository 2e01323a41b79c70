"""End-to-end training step: fsdpzero (a DeepSpeed config through `fsdpzero.wrap`) vs the same model hand-wrapped
with plain FSDP2, in the same process, same settings (device_anchors.md's setup for --preset 0.9b).

    torchrun --standalone --nproc_per_node=2 bench/e2e.py --preset 0.9b --stages 2 3 --json bench_e2e.json

Per stage and implementation: median step time over --steps timed steps (after --warmup), tokens/s/GPU, peak GPU
memory allocated/reserved (max over ranks, stats reset after setup), first/last loss. The order is
plain, ours, plain: the two plain runs bound the drift of the machine. The target: ours within 3% step time and
2% peak memory of plain FSDP2.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a source checkout without installing
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "ops"))   # fsdpzero_ops, from the checkout
import fsdpzero  # noqa: E402

from common import BETAS, CLIP, EPS, LR, PRESETS, WD, build_model  # noqa: E402  (bench/ is the script's folder)


def plain_fsdp2(model, stage: int, device):
    """What a user writes by hand: fully_shard per decoder layer, then the root; fused AdamW; clip_grad_norm_."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=None if stage == 3 else False, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def ours(model, stage: int, p: dict):
    config = {"train_micro_batch_size_per_gpu": p["micro"], "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "communication_data_type": "fp32", "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                        "weight_decay": WD}},
              "zero_optimization": {"stage": stage}}
    engine = fsdpzero.wrap(model, config)

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss
    return step


def measure(name: str, make_step, p: dict, args, device) -> dict:
    model = build_model(p, device)
    step = make_step(model)
    g = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    x = torch.randint(0, p["vocab_size"], (p["micro"], p["seq"]), device=device, generator=g)  # fixed batch
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        loss = step(x)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peaks = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()] if cuda else [0, 0]
    stats = torch.tensor(peaks, dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    med = statistics.median(times)
    del step, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"impl": name, "step_s": med, "min_s": min(times), "max_s": max(times),
            "tokens_per_s_per_gpu": p["micro"] * p["seq"] / med, "peak_alloc_gib": stats[0].item() / 2**30,
            "peak_reserved_gib": stats[1].item() / 2**30, "loss_first": losses[0], "loss_last": losses[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    p = PRESETS[args.preset]
    info = fsdpzero.init_distributed()
    device = info.device
    rows = []
    for stage in args.stages:
        runs = [measure("plain_fsdp2", lambda m: plain_fsdp2(m, stage, device), p, args, device),
                measure("fsdpzero", lambda m: ours(m, stage, p), p, args, device),
                measure("plain_fsdp2", lambda m: plain_fsdp2(m, stage, device), p, args, device)]
        base_step = min(runs[0]["step_s"], runs[2]["step_s"])
        base_mem = max(runs[0]["peak_alloc_gib"], runs[2]["peak_alloc_gib"])
        for r in runs:
            r.update(stage=stage, preset=args.preset, world_size=dist.get_world_size(),
                     step_overhead_pct=100 * (r["step_s"] / base_step - 1),
                     mem_overhead_pct=100 * (r["peak_alloc_gib"] / base_mem - 1) if base_mem else 0.0)
        rows += runs
    if dist.get_rank() == 0:
        print(f"{'stage':>5} {'impl':<12} {'step s':>8} {'(min-max)':>15} {'tok/s/GPU':>10} {'alloc GiB':>9} "
              f"{'resv GiB':>8} {'loss first->last':>18} {'step ovh %':>10} {'mem ovh %':>9}")
        for r in rows:
            print(f"{r['stage']:>5} {r['impl']:<12} {r['step_s']:8.4f} ({r['min_s']:.3f}-{r['max_s']:.3f}) "
                  f"{r['tokens_per_s_per_gpu']:10.0f} {r['peak_alloc_gib']:9.2f} {r['peak_reserved_gib']:8.2f} "
                  f"{r['loss_first']:8.4f}->{r['loss_last']:8.4f} {r['step_overhead_pct']:10.2f} "
                  f"{r['mem_overhead_pct']:9.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                           "env_threads": os.environ.get("OMP_NUM_THREADS"), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
