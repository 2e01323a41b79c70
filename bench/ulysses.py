"""Ulysses sequence parallelism (sequence_parallel_size) at growing sequence lengths: the longest sequence that fits and
tokens/s for fsdpzero ZeRO-3 + sp N, plain fsdpzero ZeRO-3 (sp 1) and DeepSpeed 0.19.8's ALST (ZeRO-3 +
UlyssesSPAttentionHF, when deepspeed imports), each (implementation, length) in its own torchrun so an out-of-memory is
one failed row. Lengths double from --seq-start; an implementation stops at its first failure. Prints one JSON object
and a table.

    python bench/ulysses.py --nproc 2 --out out/ulysses_n2       # 2 GPUs: sp 2, ~4-5 min
    python bench/ulysses.py --nproc 4 --sp 4 --out out/ulysses_n4
    FSDPZERO_BENCH_CPU=1 python bench/ulysses.py --nproc 2 --seq-start 32 --seq-max 64 --steps 1 --warmup 1  # CPU smoke

Setup: bench/common.py's 0.25 B Llama preset (16 heads, 8 KV heads; --preset 0.9b for the 0.89 B one), micro 1, bf16,
ZeRO-3, HF activation checkpointing (gradient_checkpointing_enable, non-reentrant) for every implementation, sdpa,
AdamW 1e-4, clip 1.0, --warmup 1 + --steps 2 timed steps, rank 0's median. Every rank of an sp group holds the same
sequence and keeps its 1/sp slice (fsdpzero.parallel.ulysses.shard_batch: labels shifted, position_ids global; the
step of DeepSpeed's UlyssesSPDataLoaderAdapter without its gather, so data movement is not timed); the loss is the
mean over the sequence's tokens, DeepSpeed's side aggregating it as the HF Trainer does. tokens/s/GPU counts each
sequence once: dp x seq / step time / GPUs (dp = GPUs / sp).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "ops"))   # fsdpzero_ops, from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its import time is the launch clock)
import torch  # noqa: E402

IMPLS = ("fsdpzero_sp", "zero3", "deepspeed_alst")


class _GatherSum(torch.autograd.Function):
    """all_gather whose backward all-reduces the gradients and keeps this rank's (what NCCL's reduce-scatter in
    torch.distributed.nn.all_gather gives; gloo's fallback there fails for subgroups)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def config(p: dict, sp: int, world: int) -> dict:
    cfg = common.ds_config({"stage": 3, "dtype": "fp32" if common.CPU else "bf16"}, p)
    cfg["optimizer"]["params"]["torch_adam"] = True   # DeepSpeed: torch's AdamW; fsdpzero reads and ignores it
    cfg["train_batch_size"] = p["micro"] * world // sp
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    return cfg


def worker(args) -> None:
    import torch.distributed as dist
    from fsdpzero.parallel.ulysses import shard_batch
    p = dict(common.PRESETS[args.preset], seq=args.seq, micro=1)
    sp = 1 if args.impl == "zero3" else args.sp
    device, rank, world = common.init_worker(deepspeed=args.impl == "deepspeed_alst")
    model = common.build_model(p, device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n = common.n_params(model)
    cfg = config(p, sp, world)
    group = None
    if args.impl == "deepspeed_alst":
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, p["micro"], seq_length=args.seq,
                                                              seq_length_is_variable=False)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
        group = mpu.get_sequence_parallel_group()
    else:
        import fsdpzero
        engine, *_ = fsdpzero.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1000 + rank // sp)   # one sequence per sp group
    ids = torch.randint(0, p["vocab_size"], (p["micro"], args.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(args.seq).expand_as(ids)}
    if sp > 1:
        batch = shard_batch(batch, rank % sp, sp)
    batch = {k: v.to(device) for k, v in batch.items()}

    def step():
        if args.impl == "deepspeed_alst":   # the HF Trainer's aggregation (transformers deepspeed_sp_compute_loss)
            shift = batch["shift_labels"]
            local_loss = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=shift,
                                shift_labels=shift).loss
            good = (shift != -100).sum().float()
            losses, goods = _GatherSum.apply(local_loss, group), _GatherSum.apply(good, group)
            loss = (torch.where(goods > 0, losses, torch.zeros_like(losses)) * goods).sum() / goods.sum()
        else:
            loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()
    timing = common.timed_loop(step, args.warmup, args.steps, device)
    if rank == 0:
        tokens = (world // sp) * p["micro"] * args.seq // world   # each sequence counted once, per GPU
        r = common.row(timing, n, tokens, impl=args.impl, sp=sp, dp=world // sp, seq=args.seq, world_size=world,
                       preset=args.preset,
                       device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
        Path(args.json).write_text(json.dumps(r, indent=1))
    dist.destroy_process_group()


def launch(impl: str, seq: int, args, out: Path) -> dict:
    path = out / f"{impl}__seq{seq}__n{args.nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
           "--worker", "--impl", impl, "--seq", str(seq), "--sp", str(args.sp), "--json", str(path), "--preset",
           args.preset, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = common.worker_env(
        PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
    print(f"--- {impl} seq {seq}", flush=True)
    t0 = time.perf_counter()
    text, rc = common.run_launcher(cmd, env, args.run_timeout)
    if rc != 0 or not path.exists():
        (out / path.name.replace(".json", ".log")).write_text(text)
        oom = "OutOfMemoryError" in text or "out of memory" in text
        why = "out of memory" if oom else f"rc={rc}"
        print(f"    failed: {why}", flush=True)
        return {"impl": impl, "seq": seq, "error": why, "log_tail": text[-1500:]}
    row = json.loads(path.read_text())
    row["wall_s"] = time.perf_counter() - t0
    print(f"    {row['step_s']:.3f} s/step, {row['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
          f"peak {row['peak_alloc_gib']:.1f} GiB", flush=True)
    return row


def table(rows: list[dict], impls: list[str]) -> str:
    lines = ["| impl | seq | step s | tok/s/GPU | peak alloc GiB | peak resv GiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['seq']} | {r['error']} | | | |")
        else:
            lines.append(f"| {r['impl']} | {r['seq']} | {r['step_s']:.3f} | {r['tokens_per_s_per_gpu']:.0f} | "
                         f"{r['peak_alloc_gib']:.2f} | {r['peak_reserved_gib']:.2f} |")
    lines.append("")
    for impl in impls:
        ok = [r for r in rows if r["impl"] == impl and "error" not in r]
        longest = max(ok, key=lambda r: r["seq"]) if ok else None
        lines.append(f"{impl}: longest sequence that ran {longest['seq'] if longest else 'none'}"
                     + (f" ({longest['tokens_per_s_per_gpu']:.0f} tok/s/GPU there)" if longest else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=IMPLS)
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--seq", type=int)
    ap.add_argument("--seq-start", type=int, default=16384)
    ap.add_argument("--seq-max", type=int, default=262144)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny" if common.CPU else "0.25b")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--run-timeout", type=int, default=100)
    ap.add_argument("--budget", type=int, default=200,
                    help="launch no run after this many seconds (a run may take --run-timeout more)")
    ap.add_argument("--json")
    ap.add_argument("--out", default="out/ulysses")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.nproc % args.sp:
        ap.error(f"--sp {args.sp} does not divide --nproc {args.nproc}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    impls = [i for i in args.impls if i != "deepspeed_alst" or importlib.util.find_spec("deepspeed") is not None]
    rows, failed, t0 = [], set(), time.perf_counter()
    seq = args.seq_start
    while seq <= args.seq_max and len(failed) < len(impls):   # lengths ascending, the implementations side by side
        for impl in impls:
            if impl in failed:
                continue
            if time.perf_counter() - t0 > args.budget:
                rows.append({"impl": impl, "seq": seq, "error": "not run (time budget)"})
                failed.add(impl)
                continue
            row = launch(impl, seq, args, out)
            rows.append(row)
            if "error" in row:
                failed.add(impl)
        seq *= 2
    summary = {"nproc": args.nproc, "sp": args.sp, "preset": args.preset, "impls": impls, "rows": rows}
    (out / "ulysses.json").write_text(json.dumps(summary, indent=1))
    md = table(rows, impls)
    (out / "summary.md").write_text(md + "\n")
    print(json.dumps(summary))
    print(md)


if __name__ == "__main__":
    main()
