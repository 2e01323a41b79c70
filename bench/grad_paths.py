"""One GPU, every gradient path's training step through fsdpzero.wrap, for one or more source trees side by side:
ZeRO 2 (FSDPGradPath), ZeRO 1 (Stage1GradPath), ZeRO 2 + CPU optimizer offload (OffloadGradPath, overlapped: the
default) and ZeRO 3 + optimizer and parameter offload. A refactor's before/after in one call: each case runs once per
tree, the trees alternating, each run in its own process that imports fsdpzero (and fsdpzero_ops) from its tree.

    python bench/grad_paths.py --tree /path/to/before --tree . --out out/grad_paths

A Llama of --layers x --hidden (default 8 x 2048, 0.55 B), bf16 compute, fp32 masters, AdamW lr 1e-4 wd 0.01,
clip 1.0, seq --seq x micro-batch --micro; --warmup steps, then --steps timed: the median step time, the mean
including an overlapped step's tail, peak GPU memory and the losses (the largest difference between trees is
printed: the same computation in each). Prints one
JSON line per run, then a table (per case: each tree's median step s and the ratio to the first tree), and writes
the JSON list to --out/grad_paths.json. --budget-s stops starting runs when the time is spent (skipped runs get a
row). FSDPZERO_BENCH_CPU=1 runs it on CPU/gloo with a tiny model (the script's own smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {   # name -> zero_optimization
    "z2": {"stage": 2},
    "z1": {"stage": 1},
    "z2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "z3_offload_both": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                        "offload_param": {"device": "cpu", "pin_memory": True}},
}
CPU = os.environ.get("FSDPZERO_BENCH_CPU") == "1"


def ds_config(case: str, micro: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "zero_optimization": CASES[case],
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.01}}}


def worker(a) -> None:
    """One case in this process, fsdpzero imported from a.tree; prints one JSON line."""
    tree = Path(a.tree).resolve()
    sys.path[:0] = [str(tree), str(tree / "ops")]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fsdpzero
    assert Path(fsdpzero.__file__).resolve().is_relative_to(tree), (fsdpzero.__file__, tree)
    device = "cpu" if CPU else "cuda"
    cfg = LlamaConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=8,
                      intermediate_size=a.hidden * 11 // 4, vocab_size=a.vocab, tie_word_embeddings=False,
                      max_position_embeddings=max(2048, a.seq))
    torch.manual_seed(1234)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    t0 = time.perf_counter()
    engine = fsdpzero.wrap(model, ds_config(a.case, a.micro), device_type=device)
    setup_s = time.perf_counter() - t0
    x = torch.randint(0, a.vocab, (a.micro, a.seq), device=device, generator=torch.Generator(device).manual_seed(7))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(a.warmup + a.steps):
        sync()
        t = time.perf_counter()
        if i == a.warmup:
            t_loop = t
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
        losses.append(float(loss))
    engine.wait_for_params()   # an overlapped CPU step ends after step() returns
    sync()
    print(json.dumps({"tree": str(tree), "case": a.case, "grad_path": type(engine.grad_path).__name__,
                      "step_s": statistics.median(times), "step_min": min(times), "step_max": max(times),
                      "step_s_mean_incl_tail": (time.perf_counter() - t_loop) / a.steps, "setup_s": setup_s,
                      "peak_alloc_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
                      "losses": losses}), flush=True)
    engine.destroy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", help="a source tree (repeat; default: this one)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=230)
    ap.add_argument("--out", default="out/grad_paths")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if CPU and not a.worker:   # the smoke shape
        a.layers, a.hidden, a.vocab, a.seq, a.micro, a.warmup, a.steps = 2, 64, 512, 32, 2, 1, 2
    if a.worker:
        a.tree = a.tree[0]
        worker(a)
        return 0
    trees = a.tree or [str(Path(__file__).resolve().parent.parent)]
    start, rows = time.monotonic(), []
    shape = [f"--{k}={getattr(a, k)}" for k in ("layers", "hidden", "vocab", "seq", "micro", "warmup", "steps")]
    for case in a.cases.split(","):
        for tree in trees:
            left = a.budget_s - (time.monotonic() - start)
            row = {"tree": str(Path(tree).resolve()), "case": case}
            if left < 20:
                rows.append({**row, "error": f"skipped: {left:.0f} s of the budget left"})
                continue
            cmd = [sys.executable, __file__, "--worker", "--tree", tree, "--case", case, *shape]
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())))
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                row = json.loads(lines[-1]) if proc.returncode == 0 and lines else \
                    {**row, "error": f"rc={proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-2000:]}
            except subprocess.TimeoutExpired:
                row = {**row, "error": f"killed after {left:.0f} s"}
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grad_paths.json").write_text(json.dumps(rows, indent=2))
    names = [str(Path(t).resolve()) for t in trees]
    print("\n| case | " + " | ".join(f"tree {i}: step s median (min-max), peak GiB" for i in range(len(names)))
          + (" | ratio to tree 0 |" if len(names) > 1 else " |"))
    print("|---" * (len(names) + 1 + (len(names) > 1)) + "|")
    for case in a.cases.split(","):
        got = {r["tree"]: r for r in rows if r["case"] == case}
        cells = [(f"{r['step_s']:.4f} ({r['step_min']:.4f}-{r['step_max']:.4f}), {r['peak_alloc_GiB']:.2f}"
                  if "step_s" in r else r.get("error", "-")) for r in (got.get(n, {}) for n in names)]
        ratio = ""
        if len(names) > 1:
            base, *others = (got.get(n, {}).get("step_s") for n in names)
            ratio = " | " + ", ".join(f"{o / base:.3f}" if base and o else "-" for o in others)
        print(f"| {case} | " + " | ".join(cells) + ratio + " |")
    for i, n in enumerate(names):
        print(f"tree {i}: {n}")
    for case in a.cases.split(","):   # the same computation in every tree: the losses agree (GPU kernels may not
        runs = [r["losses"] for r in rows if r["case"] == case and "losses" in r]   # be bit-deterministic)
        if len(runs) > 1:
            diff = max(abs(x - y) for other in runs[1:] for x, y in zip(runs[0], other))
            print(f"{case}: largest loss difference between trees {diff:.3g}")
    return 0 if all("step_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
