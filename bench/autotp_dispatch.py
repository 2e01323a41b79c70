"""The CPU cost of AutoTP's Linear layers, without GPUs: forward + backward of a 16-layer transformers Llama with a
tiny hidden size (its compute negligible, so the time is dispatch) in one process on a 1-rank gloo tp mesh, the
planned layers as fsdpzero's ParallelLinear (local shards) and as DTensor's ColwiseParallel / RowwiseParallel
(`dtensor_styles=True`, fsdpzero's path before). Also counts the ops each dispatches through DTensor. Prints one JSON
object and a table. The difference is host time per step that a GPU run pays wherever the host, not the GPU, is the
bottleneck (suspected at tp 2 on 2 H200s: BENCHMARKS.md S12).

    python bench/autotp_dispatch.py [--layers 16] [--repeats 25]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def build(layers: int):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


def dtensor_ops(model, x) -> int:
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    count = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            count[0] += any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs or {})))
            return func(*args, **(kwargs or {}))
    with Count():
        model(input_ids=x, labels=x).loss.backward()
    return count[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    if args.repeats < 6:   # the first 5 calls are warm-up
        ap.error(f"--repeats {args.repeats}: give at least 6 (the median is over the calls after the first 5)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    from fsdpzero.parallel.tensor_parallel import apply_tensor_parallel
    from fsdpzero.parallel.tp_plan import resolve_tp_plan
    from fsdpzero.plan.types import TensorParallelPlan
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    x = torch.randint(0, 256, (1, 16))
    rows = {}
    for impl in ("ParallelLinear", "DTensor styles") * 2:   # interleaved: the load drifts
        model = build(args.layers)
        styles = resolve_tp_plan(model, TensorParallelPlan(size=2))   # the plan tp 2 would shard
        apply_tensor_parallel(model, styles, mesh, dtensor_styles=impl == "DTensor styles")
        model._forward_pre_hooks.clear()   # the first-forward batch check
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            model(input_ids=x, labels=x).loss.backward()
            times.append(time.perf_counter() - t)
        row = rows.setdefault(impl, {"impl": impl, "linears": len(styles), "ms": [],
                                     "dtensor_ops": dtensor_ops(model, x)})
        row["ms"].append(statistics.median(times[5:]) * 1e3)
    dist.destroy_process_group()
    out = {"layers": args.layers, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "rows": [{**r, "ms_per_fwd_bwd": min(r["ms"])} for r in rows.values()]}
    print(json.dumps(out))
    print("| impl | sharded Linears | DTensor ops per fwd+bwd | ms per fwd+bwd (best of 2 medians) |\n|---|---|---|---|")
    for r in out["rows"]:
        print(f"| {r['impl']} | {r['linears']} | {r['dtensor_ops']} | {r['ms_per_fwd_bwd']:.1f} |")


if __name__ == "__main__":
    main()
