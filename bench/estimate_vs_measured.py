"""`fsdpzero estimate` against the GPU: model-state memory of every row the estimate prints for one model (stages 0-3,
CPU optimizer offload at stages 1-3, parameter + optimizer offload at stage 3; bf16 compute, fp32 masters, AdamW),
measured as the growth of `max_memory_allocated` over 3 training steps of 1 x 16 tokens (activations are noise at
that size), next to the estimate's fsdpzero column. Run on N GPUs:

    torchrun --standalone --nproc_per_node=2 bench/estimate_vs_measured.py --out estimate_vs_measured.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import fsdpzero
from fsdpzero.cli import estimate as est


OPTIONS = {"none": {},
           "offload_optimizer=cpu": {"offload_optimizer": {"device": "cpu"}},
           "offload_param+optimizer=cpu": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
ROWS = [(0, "none"), (1, "none"), (1, "offload_optimizer=cpu"), (2, "none"), (2, "offload_optimizer=cpu"),
        (3, "none"), (3, "offload_optimizer=cpu"), (3, "offload_param+optimizer=cpu")]


def measure(model_name: str, stage: int, option: str = "none", phases: dict | None = None) -> int:
    config = est.load_model_config(model_name)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **OPTIONS[option]},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}
    engine = fsdpzero.wrap(model, ds)
    mark = (lambda name: phases.setdefault(name, (torch.cuda.max_memory_allocated() - base) / 2**30)) \
        if phases is not None else (lambda name: None)
    mark("wrap")
    with torch.no_grad():                      # a real init, so steps are finite and Adam states get allocated
        for p in engine.module.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(0.0, 0.02)
    ids = torch.randint(0, config.vocab_size, (1, 16), device="cuda")
    for i in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        mark(f"forward{i}")
        engine.backward(loss)
        mark(f"backward{i}")
        engine.step()
        mark(f"step{i}")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del engine, model, loss
    gc.collect()
    torch.cuda.empty_cache()
    t = torch.tensor([peak], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-0.9b")
    ap.add_argument("--out", default="estimate_vs_measured.json")
    ap.add_argument("--rows", default="", help="only these rows, e.g. '1:offload_optimizer=cpu,2:none'")
    ap.add_argument("--phases", action="store_true", help="also print the peak (GiB) after wrap and after each "
                    "forward, backward and step: where a row's peak comes from")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    counts = est.count_model(args.model)
    rows = []
    wanted = [(int(r.split(":")[0]), r.split(":")[1]) for r in args.rows.split(",") if r]
    for stage, option in wanted or ROWS:
        phases = {} if args.phases else None
        measured = measure(args.model, stage, option, phases)
        if phases and dist.get_rank() == 0:
            print(f"stage {stage} {option} peaks GiB: " + " ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        estimate, _ = est.fsdpzero_bytes(counts, stage, option, world, world, compute_bytes=2)
        rows.append({"stage": stage, "option": option, "world": world, "estimate": estimate, "measured": measured,
                     "ratio": estimate / measured})
        if dist.get_rank() == 0:
            print(f"stage {stage} {option}: estimate {estimate / 2**30:.2f} GiB, measured {measured / 2**30:.2f} "
                  f"GiB, ratio {estimate / measured:.3f}", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "counts": counts.__dict__, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
