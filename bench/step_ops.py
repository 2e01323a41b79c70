"""Operators dispatched per training step, by optimizer path (CPU, one process): a launch-count proxy for a GPU.

On a GPU a step whose optimizer launches a few kernels for each of a model's ~150 tensors is bound by the launches
(each ~5-10 us of host time), not by the arithmetic. This counts the ATen operators one step dispatches (forward,
backward, the gradient path's step) with a TorchDispatchMode, on the 0.89 B Llama's tensor layout (16 layers: 147
parameter tensors) at toy widths, so it runs on a CPU in seconds. A foreach operator counts once (on a GPU it is one
launch per ~20 M elements of its tensors); "kernel ops" leave out views, host reads and profiler records. The
rows differ only in the optimizer path, so the differences between rows, and between trees, are the optimizer's.
`--lib DIR` imports fsdpzero from another checkout (a `git worktree` of an older commit) to compare trees with the
same script:

    python bench/step_ops.py --out out/step_ops.json
    git worktree add /tmp/old HEAD~3 && python bench/step_ops.py --lib /tmp/old --out out/step_ops_old.json

Rows: adamw (ZeRO-2, AdamW, no offload: torch's fused/foreach AdamW), muon (ZeRO-2, DeepSpeed's Muon), zenflow
(ZeRO-2 + CPU offload with the zenflow section of tests/ds_configs/dsex_zenflow_stage2.json: a selective step every
step; steps 0-3 warm the selection up, step 5 is counted: not a CPU-update step).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = dict(layers=16, hidden=64, micro=2, seq=32, vocab=512)   # the 0.89 B preset's tensors, toy widths
COUNTED_STEP = 5
# operators that launch no kernel on a GPU (besides views): a host read, autograd's detach, profiler records
NO_KERNEL = {"_local_scalar_dense", "detach", "_record_function_enter_new", "_record_function_exit"}


def config(row: str) -> dict:
    zero = {"stage": 2}
    opt = {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}
    if row == "zenflow":
        corpus = json.loads((ROOT / "tests" / "ds_configs" / "dsex_zenflow_stage2.json").read_text())
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["zenflow"] = corpus["zero_optimization"]["zenflow"]
    if row == "muon":
        opt = {"type": "Muon", "params": {"lr": 1e-4, "muon_lr": 0.02, "adam_lr": 1e-4, "weight_decay": 0.01}}
    return {"train_micro_batch_size_per_gpu": LAYOUT["micro"], "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 9, "gradient_clipping": 1.0, "zero_optimization": zero, "optimizer": opt,
            "zero_allow_untested_optimizer": True}


def count_row(row: str) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    import fsdpzero

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = self.foreach = self.kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.foreach += "_foreach_" in func.__name__
            self.kernels += not (func.is_view or func.__name__.split(".")[0] in NO_KERNEL)
            return func(*args, **(kwargs or {}))

    p = LAYOUT
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=p["hidden"], num_hidden_layers=p["layers"],
                                         num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=p["hidden"] * 11 // 4, vocab_size=p["vocab"],
                                         tie_word_embeddings=False))
    tensors = sum(1 for q in model.parameters() if q.requires_grad)
    engine = fsdpzero.initialize(model=model, config=copy.deepcopy(config(row)))[0]
    x = torch.randint(0, p["vocab"], (p["micro"], p["seq"]), generator=torch.Generator().manual_seed(1))
    counted = {}
    for k in range(COUNTED_STEP + 1):
        whole, opt = Count(), Count()
        with whole:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            with opt:
                engine.step()
        if k == COUNTED_STEP:
            counted = {"ops_per_step": whole.ops, "ops_in_engine_step": opt.ops, "foreach_ops": whole.foreach,
                       "kernel_ops_per_step": whole.kernels, "kernel_ops_in_engine_step": opt.kernels}
    engine.destroy()
    return {"row": row, "param_tensors": tensors, "step": COUNTED_STEP, **counted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="adamw,muon,zenflow")
    ap.add_argument("--lib", help="import fsdpzero from this checkout instead of this one")
    ap.add_argument("--out", help="write the rows as JSON here")
    ns = ap.parse_args()
    lib = Path(ns.lib).resolve() if ns.lib else ROOT
    sys.path[:0] = [str(lib), str(lib / "ops")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import fsdpzero
    rows = [count_row(r) for r in ns.rows.split(",")]
    for r in rows:
        r["fsdpzero"] = str(Path(fsdpzero.__file__).parent)
    print(json.dumps(rows))
    print(f"{'row':10} {'params':>7} {'ops/step':>9} {'in step()':>10} {'kernel ops/step':>16} {'in step()':>10} "
          f"{'foreach':>8}")
    for r in rows:
        print(f"{r['row']:10} {r['param_tensors']:>7} {r['ops_per_step']:>9} {r['ops_in_engine_step']:>10} "
              f"{r['kernel_ops_per_step']:>16} {r['kernel_ops_in_engine_step']:>10} {r['foreach_ops']:>8}")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
