"""Muon's orthogonalize_grads, one matrix at a time against batched (issue 36): JSON + a table.

    .venv/bin/python bench/muon_batch.py                       # CPU fp32, the 0.89 B shapes / 16, 5 reps
    .venv/bin/python bench/muon_batch.py --scale 1 --reps 1    # the real 0.89 B shapes on CPU (minutes: FLOP-bound)
    python bench/muon_batch.py --device cuda --scale 1         # one GPU (NS in fp16, "gram"), the bench's shapes

The matrices are the Muon parameters (fsdpzero.optim.muon.is_muon_param) of bench/zenflow.py's 0.89 B Llama (16
layers, hidden 2048, 16 heads / 8 KV heads, intermediate 5632: 112 matrices of 4 shapes, 7 per layer), each dim
divided by --scale, as plain fp32 tensors on one process (the one-GPU case: no collectives, every matrix on this
rank). MuonWithAuxAdam.orthogonalize_grads is timed with ns_window_bytes 0 (one Newton-Schulz run per matrix, the
order before batching) and with the default window (one run per shape and window), the gradients restored between
reps (untimed). Both must give the same updates; the bench prints the largest difference (0 on CPU fp32; on CUDA a
batched GEMM may differ from a single one in the last bits).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "ops"))

import torch  # noqa: E402

from fsdpzero.optim import muon  # noqa: E402

LLAMA_089B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=5632, vocab_size=32000)


def muon_shapes(scale: int) -> list[tuple[int, int]]:
    """The 0.89 B Llama's Muon matrices (built on the meta device: shapes only), each dim // scale."""
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_089B, tie_word_embeddings=False))
    return [(p.shape[0] // scale, p.shape[1] // scale) for n, p in model.named_parameters()
            if muon.is_muon_param(n, p)]


def time_one(params, grads, window: int, reps: int, device) -> tuple[list[float], list[torch.Tensor], int]:
    opt = muon.MuonWithAuxAdam([dict(params=params, use_muon=True, lr=0.02, momentum=0.95)])
    opt.ns_window_bytes = window
    times, batches = [], muon.ns_batches
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(reps + 1):   # the first is a warm-up
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.orthogonalize_grads()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        opt.drop_staged()
    runs = (muon.ns_batches - batches) // (reps + 1)
    # the transient device memory of orthogonalize_grads (and the untimed grad copies) above what was allocated
    extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 30 if device.type == "cuda" else None
    return times[1:], [p.grad.clone() for p in params], runs, extra


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (fp32, the default) or cuda")
    ap.add_argument("--scale", type=int, default=16, help="divide each matrix dim by this (1: the real shapes)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--windows", default="", help="more ns_window_bytes to time, comma-separated (e.g. 1048576)")
    ap.add_argument("--json", help="also write the JSON here")
    ns = ap.parse_args(argv)
    if ns.scale < 1 or ns.reps < 1:
        raise SystemExit(f"--scale {ns.scale} / --reps {ns.reps}: both must be >= 1")
    torch.set_num_threads(ns.threads)
    device = torch.device(ns.device)
    shapes = muon_shapes(ns.scale)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    rows, updates = [], {}
    extra = [(f"window_{w}", int(w)) for w in ns.windows.split(",") if w]
    for name, window in [("per_matrix", 0), ("batched", muon.NS_WINDOW_BYTES)] + extra:
        times, updates[name], runs, extra = time_one(params, grads, window, ns.reps, device)
        rows.append(dict(mode=name, window_bytes=window, ns_runs=runs, median_s=statistics.median(times),
                         min_s=min(times), times_s=times, peak_extra_gpu_gib=extra))
    diff = max((a - b).abs().max().item() for name in updates for a, b in zip(updates["per_matrix"], updates[name]))
    summary = dict(device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                   threads=ns.threads, scale=ns.scale, matrices=len(shapes),
                   shapes=sorted({s for s in shapes}), ns_method="gram",
                   ns_dtype=str(muon.ns_compute_dtype("gram", device)),
                   speedup=rows[0]["median_s"] / rows[1]["median_s"], max_update_diff=diff, rows=rows)
    text = json.dumps(summary)
    print(text)
    if ns.json:
        Path(ns.json).write_text(text)
    print(f"{'mode':18} {'NS runs':>8} {'median s':>9} {'min s':>8} {'+GPU GiB':>8}   ({summary['matrices']} "
          f"matrices, shapes {summary['shapes']}, {summary['device']}, {summary['ns_dtype']}, {ns.threads} thread(s))")
    for r in rows:
        extra = "-" if r["peak_extra_gpu_gib"] is None else f"{r['peak_extra_gpu_gib']:.2f}"
        print(f"{r['mode']:18} {r['ns_runs']:8d} {r['median_s']:9.4f} {r['min_s']:8.4f} {extra:>8}")
    print(f"batched: {summary['speedup']:.2f}x faster; largest update difference {diff:.3g}")


if __name__ == "__main__":
    main()
