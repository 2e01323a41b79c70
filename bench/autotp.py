"""AutoTP (tensor_parallel.autotp_size) side by side: fsdpzero (DTensor TP over tp, FSDP2 over dp) vs DeepSpeed
0.19.8's AutoTP training, the same ds_config, model, data and seed; one torchrun per run. Prints one JSON object and a
table: step time, tokens/s/GPU, peak GPU memory, and the loss curve of each (max difference per stage).

    python bench/autotp.py --nproc 4 --tp 2 --out out/autotp_tp2dp2     # 4 GPUs: tp 2 x dp 2 (0.89 B, bf16)
    python bench/autotp.py --nproc 2 --tp 2 --out out/autotp_tp2dp1     # 2 GPUs: tp 2 x dp 1
    FSDPZERO_BENCH_CPU=1 python bench/autotp.py --nproc 4 --tp 2 --stages 2 --steps 2 --warmup 1   # CPU smoke
    python bench/autotp.py --nproc 2 --tp 2 --stages 2 --impls fsdpzero fsdpzero_dtensor deepspeed   # before/after

Implementations: `fsdpzero` (its Linear layers computing on local shards: fsdpzero/parallel/tensor_parallel.py),
`fsdpzero_dtensor` (the same engine with DTensor's ColwiseParallel / RowwiseParallel per layer, fsdpzero's path before
that change: dtensor_styles=True), `deepspeed`.

Setup: bench/common.py's 0.89 B Llama (16 heads, 8 kv heads: tp up to 8), seq 2048, micro 4 per GPU, AdamW 1e-4, clip
1.0, bf16, stages --stages (default 1 2 3), 3 warm-up + 10 timed steps, rank 0's median. Every rank of a tp group reads
the same micro-batches (its data replica's). No train_batch_size in the config: DeepSpeed 0.19.8's ZeRO-3 refuses any
explicit value under AutoTP (docs/parallelism.md). DeepSpeed runs with torch_adam (torch's AdamW; no FusedAdam JIT
build) and fsdpzero with its default (torch's fused AdamW on GPUs). About 30-40 s per run on H100s; 6 runs by default
(--impls fsdpzero deepspeed).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "ops"))   # fsdpzero_ops, from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its import time is the launch clock)
import torch  # noqa: E402

IMPLS = ("fsdpzero", "fsdpzero_dtensor", "deepspeed")


def config(stage: int, tp: int, p: dict, ga: int) -> dict:
    cfg = common.ds_config({"stage": stage, "dtype": "fp32" if common.CPU else "bf16", "ga": ga}, p)
    cfg["tensor_parallel"] = {"autotp_size": tp}
    cfg["optimizer"]["params"]["torch_adam"] = True   # DeepSpeed: torch's AdamW; fsdpzero reads and ignores it
    return cfg


def worker(args) -> None:
    import torch.distributed as dist
    p = common.PRESETS[args.preset]
    device, rank, world = common.init_worker(deepspeed=args.impl == "deepspeed")
    cfg = config(args.stage, args.tp, p, args.ga)
    batches = common.fixed_batches(p, rank // args.tp, args.ga, device)   # one data replica = tp ranks, same rows
    model = common.build_model(p, device)
    n = common.n_params(model)
    if args.impl == "deepspeed":
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        import fsdpzero
        if args.impl == "fsdpzero_dtensor":   # every sharded Linear through DTensor's styles (the old path)
            import functools
            import fsdpzero.api
            from fsdpzero.parallel.tensor_parallel import apply_tensor_parallel
            fsdpzero.api.apply_tensor_parallel = functools.partial(apply_tensor_parallel, dtensor_styles=True)
        engine, *_ = fsdpzero.initialize(model=model, config=cfg)
    timing = common.timed_loop(common.engine_step(engine, batches), args.warmup, args.steps, device)
    if rank == 0:
        tokens = p["micro"] * p["seq"] * args.ga // args.tp   # a tp group shares its replica's tokens
        r = common.row(timing, n, tokens, config=f"z{args.stage}_tp{args.tp}_dp{world // args.tp}", impl=args.impl,
                       stage=args.stage, tp=args.tp, dp=world // args.tp, world_size=world, preset=args.preset,
                       device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
        Path(args.json).write_text(json.dumps(r, indent=1))
    dist.destroy_process_group()


def launch(stage: int, impl: str, args, out: Path) -> dict:
    path = out / f"z{stage}__{impl}__tp{args.tp}_n{args.nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
           "--worker", "--impl", impl, "--stage", str(stage), "--tp", str(args.tp), "--json", str(path), "--preset",
           args.preset, "--steps", str(args.steps), "--warmup", str(args.warmup), "--ga", str(args.ga)]
    print(f"--- z{stage} {impl} tp {args.tp} x dp {args.nproc // args.tp}", flush=True)
    t0 = time.perf_counter()
    text, rc = common.run_launcher(cmd, common.worker_env(), args.run_timeout)
    if rc != 0 or not path.exists():
        (out / path.name.replace(".json", ".log")).write_text(text)
        tail = [line for line in str(text).strip().splitlines() if line.strip()][-1:]
        print(f"    failed (rc {rc}): {tail}", flush=True)
        return {"config": f"z{stage}", "impl": impl, "error": f"rc={rc}", "log_tail": str(text)[-2000:]}
    row = json.loads(path.read_text())
    row["wall_s"] = time.perf_counter() - t0
    return row


def table(rows: list[dict]) -> str:
    lines = ["| stage | tp x dp | impl | step s | tok/s/GPU | peak alloc GiB | peak resv GiB | first / last loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | | {r['impl']} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['stage']} | {r['tp']} x {r['dp']} | {r['impl']} | {r['step_s']:.4f} | "
                     f"{r['tokens_per_s_per_gpu']:.0f} | {r['peak_alloc_gib']:.2f} | {r['peak_reserved_gib']:.2f} | "
                     f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f} |")
    by = {(r.get("stage"), r["impl"]): r for r in rows if "error" not in r}
    for stage in sorted({s for s, _ in by}):
        for impl in ("fsdpzero", "fsdpzero_dtensor"):
            ours, theirs = by.get((stage, impl)), by.get((stage, "deepspeed"))
            if ours and theirs:
                diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
                lines.append(f"\nstage {stage}: {impl}/DeepSpeed step time {ours['step_s'] / theirs['step_s']:.3f}, "
                             f"peak alloc {ours['peak_alloc_gib'] - theirs['peak_alloc_gib']:+.2f} GiB, "
                             f"max loss difference over {len(ours['losses'])} steps {diff:.2e}")
        new, old = by.get((stage, "fsdpzero")), by.get((stage, "fsdpzero_dtensor"))
        if new and old:
            diff = max(abs(a - b) for a, b in zip(new["losses"], old["losses"]))
            lines.append(f"stage {stage}: fsdpzero/fsdpzero_dtensor step time {new['step_s'] / old['step_s']:.3f}, "
                         f"max loss difference {diff:.2e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=IMPLS)
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=["fsdpzero", "deepspeed"])
    ap.add_argument("--stage", type=int)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--ga", type=int, default=1)
    ap.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny" if common.CPU else "0.9b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--run-timeout", type=int, default=600)
    ap.add_argument("--json")
    ap.add_argument("--out", default="out/autotp")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.nproc % args.tp:
        ap.error(f"--tp {args.tp} does not divide --nproc {args.nproc}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    impls = [i for i in args.impls if i != "deepspeed" or importlib.util.find_spec("deepspeed") is not None]
    rows = [launch(stage, impl, args, out) for stage in args.stages for impl in impls]
    summary = {"nproc": args.nproc, "tp": args.tp, "dp": args.nproc // args.tp, "preset": args.preset, "rows": rows}
    (out / "autotp.json").write_text(json.dumps(summary, indent=1))
    md = table(rows)
    (out / "summary.md").write_text(md + "\n")
    print(json.dumps(summary))
    print(md)


if __name__ == "__main__":
    main()
