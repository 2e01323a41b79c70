"""CPU Adam throughput: ours (fused mixed-precision), torch fused AdamW (fp32), torch fused + separate casts (what a
mixed-precision offload step costs with torch), torch foreach, and DeepSpeedCPUAdam (--deepspeed, JIT-built once
into .torch_extensions), against the machine's memory bandwidth, in one run. Prints a table and writes JSON.

    python bench/cpu_adam.py --params 2e8 --threads 16 --json out/cpu_adam.json
    python bench/cpu_adam.py --deepspeed            # + DeepSpeedCPUAdam (first build ~135 s on 2 cores, then cached)

Roofline: an fp32 Adam step moves 28 B/param (read param, grad, exp_avg, exp_avg_sq; write param and both states);
the mixed step reads a 2 B grad and writes a 2 B param copy instead of a 4 B grad: also 28 B. "roofline" =
params/s * 28 B / stream bandwidth, where the stream bandwidth is the best of a plain copy and an in-place add
(counting bytes read + written; the in-place add has Adam's access pattern, the copy pays write-allocate on top).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "ops"))   # fsdpzero_ops, from the checkout
from fsdpzero_ops import cpu_adam  # noqa: E402

BYTES_PER_PARAM = 28
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def timed(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def split_sizes(total, tensors):
    """Uneven, odd sizes like a model's layers (the largest ~2x the smallest)."""
    weights = [1 + i / max(1, tensors - 1) for i in range(tensors)]
    return [max(1, int(total * w / sum(weights))) | 1 for w in weights]


def stream_bandwidth(nbytes, steps, warmup):
    n = nbytes // 4
    a, b = torch.rand(n), torch.rand(n)
    copy_s = timed(lambda: a.copy_(b), steps, warmup)
    add_s = timed(lambda: a.add_(b), steps, warmup)
    return {"copy_GBps": 2 * n * 4 / copy_s / 1e9, "inplace_add_GBps": 3 * n * 4 / add_s / 1e9}


def make(sizes, grad_dtype):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in sizes]
    grads = [(torch.randn(s, generator=gen) * 1e-2).to(grad_dtype) for s in sizes]
    return params, grads


def bench_ours(sizes, low, steps, warmup, impl):
    params, grads = make(sizes, low)
    outs = [torch.empty(s, dtype=low) for s in sizes]
    opt = cpu_adam.CPUAdamW(params, **HYPER, impl=impl)

    def step():
        for p, g, o in zip(params, grads, outs):
            opt.step_param(p, g, out=o)
    return timed(step, steps, warmup)


def bench_ours_fp32(sizes, steps, warmup, impl):
    params, grads = make(sizes, torch.float32)
    for p, g in zip(params, grads):
        p.grad = g
    opt = cpu_adam.CPUAdamW(params, **HYPER, impl=impl)
    return timed(opt.step, steps, warmup)


def bench_torch(sizes, steps, warmup, **impl):
    params, grads = make(sizes, torch.float32)
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, **HYPER, **impl)
    return timed(opt.step, steps, warmup)


def bench_torch_casts(sizes, low, steps, warmup):
    """The offload step with torch: low-precision grad -> fp32 (cast pass), fused step, fp32 -> low copy (cast)."""
    params, grads = make(sizes, low)
    for p in params:
        p.grad = torch.empty_like(p)
    outs = [torch.empty(s, dtype=low) for s in sizes]
    opt = torch.optim.AdamW(params, **HYPER, fused=True)

    def step():
        torch._foreach_copy_([p.grad for p in params], grads)
        opt.step()
        torch._foreach_copy_(outs, params)
    return timed(step, steps, warmup)


def bench_deepspeed(sizes, steps, warmup):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parent.parent / ".torch_extensions"))
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # the bench may import DeepSpeed; the library never does
    params, grads = make(sizes, torch.float32)
    for p, g in zip(params, grads):
        p.grad = g
    opt = DeepSpeedCPUAdam(params, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                           weight_decay=HYPER["weight_decay"], adamw_mode=True)
    return timed(opt.step, steps, warmup)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=5e7, help="total parameters (default 5e7)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: keep torch's default)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--low", choices=["bf16", "fp16"], default="bf16", help="grad/param copy dtype, mixed step")
    ap.add_argument("--impls", default="auto", help="comma list of our kernels to time: auto,avx512,avx2,scalar")
    ap.add_argument("--deepspeed", action="store_true", help="also time DeepSpeedCPUAdam (JIT build, cached)")
    ap.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True, help="time torch foreach")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.low]
    n = int(args.params)
    sizes = split_sizes(n, args.tensors)
    n = sum(sizes)
    kw = dict(steps=args.steps, warmup=args.warmup)

    bw = stream_bandwidth(min(n * 4, 1 << 30), **kw)
    stream = max(bw.values())
    rows = []

    def add(name, seconds, note=""):
        rate = n / seconds
        rows.append({"name": name, "step_s": seconds, "Mparams_per_s": rate / 1e6,
                     "GBps_28B": rate * BYTES_PER_PARAM / 1e9, "roofline": rate * BYTES_PER_PARAM / 1e9 / stream,
                     "note": note})

    impls = [i for i in args.impls.split(",") if i]
    for impl in impls:
        resolved = cpu_adam.available_impls()[0] if impl == "auto" else impl
        add(f"ours {args.low} grad -> fp32 -> {args.low} copy [{resolved}]", bench_ours(sizes, low, impl=impl, **kw),
            "one pass")
    add(f"ours fp32 [{cpu_adam.available_impls()[0]}]", bench_ours_fp32(sizes, impl="auto", **kw))
    add("torch AdamW fused=True, fp32", bench_torch(sizes, fused=True, **kw), "no casts: not an offload step")
    add(f"torch fused + casts ({args.low} grad -> fp32, fp32 -> {args.low})", bench_torch_casts(sizes, low, **kw),
        "mixed-precision baseline")
    if args.foreach:
        add("torch AdamW foreach=True, fp32", bench_torch(sizes, foreach=True, **kw))
    if args.deepspeed:
        try:
            add("DeepSpeedCPUAdam fp32", bench_deepspeed(sizes, **kw), "as in ZeRO-Offload: fp32 grads")
        except Exception as e:  # not importable / build failed: say so, keep the rest
            rows.append({"name": "DeepSpeedCPUAdam", "error": f"{type(e).__name__}: {e}"})

    base = next(r for r in rows if r["name"].startswith("torch fused + casts"))
    ours = rows[0]
    result = {
        "host": {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "torch": torch.__version__, "cpus": os.cpu_count()},
        "params": n, "tensors": len(sizes), "stream_bandwidth": bw, "rows": rows,
        "speedup_vs_torch_fused_casts": base["step_s"] / ours["step_s"],
    }
    print(f"\nCPU Adam, {n / 1e6:.1f} M params in {len(sizes)} tensors, {torch.get_num_threads()} threads; "
          f"copy {bw['copy_GBps']:.1f} GB/s, in-place add {bw['inplace_add_GBps']:.1f} GB/s (read+write)")
    print(f"| {'kernel':<58} | {'step s':>8} | {'Mparam/s':>9} | {'GB/s@28B':>8} | {'roofline':>8} |")
    print(f"|{'-' * 60}|{'-' * 10}|{'-' * 11}|{'-' * 10}|{'-' * 10}|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']:<58} | {r['error'][:50]}")
            continue
        print(f"| {r['name']:<58} | {r['step_s']:8.4f} | {r['Mparams_per_s']:9.0f} | {r['GBps_28B']:8.1f} | "
              f"{r['roofline']:8.2f} |")
    print(f"ours vs torch fused + casts: {result['speedup_vs_torch_fused_casts']:.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
