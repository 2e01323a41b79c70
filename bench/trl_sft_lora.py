"""TRL SFTTrainer + LoRA at ZeRO-3, fsdpzero beside DeepSpeed 0.19.8: one unchanged TRL script (the worker
below: SFTTrainer with `deepspeed=`, no fsdpzero or DeepSpeed call in it), run once through `fsdpzero launch
--num_gpus N` (the door users take: its shim makes `deepspeed=` run on fsdpzero) and once under torchrun with the
real DeepSpeed, the same model, LoRA, data, seed and SFTConfig. Prints one JSON object and a table: median step
time, peak GPU memory (max over ranks), the loss curve of each and their max difference.

    PYTHONPATH=$PWD/.dsdist python bench/trl_sft_lora.py --nproc 2 --out out/trl_sft_lora     # 2 GPUs, < 5 min
    # on the GPU image (no trl, datasets, dill, multiprocess, pydantic): install .whl/ first, as bench/gpu_suite.sh does
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD/.dsdist NCCL_NVLS_ENABLE=0 python3 bench/trl_sft_lora.py --nproc 2 --out out/trl_sft_lora
    FSDPZERO_BENCH_CPU=1 python bench/trl_sft_lora.py --nproc 2 --steps 2 --warmup 1          # CPU smoke (gloo)

Setup: bench/common.py's 0.89 B Llama (random init, seed 1234, bf16 weights: the frozen base as LoRA users load it),
peft LoraConfig r=16 on every linear layer of the blocks, handed to SFTTrainer as `peft_config`; fixed random
pre-tokenized sequences of `--seq` tokens (seed 1000; data loading is not what is measured), micro 4 per GPU, lr 2e-4,
clip 1.0, TRL's SFTConfig defaults otherwise (gradient checkpointing on). ds_config: TRL's ZeRO-3 without offload, bf16
and the rest "auto" (ZERO3 below). 3 warm-up + 10 timed steps; a TrainerCallback times on_step_begin -> on_step_end
(cuda-synchronised) on rank 0, the median is reported. FSDPZERO_BENCH_CPU=1: gloo/CPU, tiny preset, fp32.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU = os.environ.get("FSDPZERO_BENCH_CPU") == "1"
IMPLS = ("fsdpzero", "deepspeed")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# TRL's docs' ZeRO-3 (examples/accelerate_configs/deepspeed_zero3.yaml as a ds_config), bf16 from SFTConfig
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "bf16": {"enabled": "auto"}, "steps_per_print": 10**9,
         "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                               "stage3_gather_16bit_weights_on_model_save": True}}


def worker(args) -> None:
    """The TRL script: what a user writes, no fsdpzero and no DeepSpeed import (the launcher picks the engine)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import common   # model presets only (bench/common.py; it imports fsdpzero.dist for its exit hand-over)
    import datasets
    import peft
    import torch
    import torch.distributed as dist
    import transformers
    import trl
    from transformers import ByT5Tokenizer

    p = dict(common.PRESETS[args.preset])
    p["seq"] = args.seq or p["seq"]
    cuda = torch.cuda.is_available() and not CPU
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ.get("WORLD_SIZE", 1))
    model = common.build_model(p, torch.device("cpu"), dtype=torch.float32 if CPU else torch.bfloat16)
    g = torch.Generator().manual_seed(1000)
    n_rows = (args.warmup + args.steps) * p["micro"] * world
    ids = torch.randint(3, p["vocab_size"], (n_rows, p["seq"]), generator=g).tolist()   # 0-2: ByT5's pad/eos/unk
    data = datasets.Dataset.from_dict({"input_ids": ids})
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    cfg = trl.SFTConfig(output_dir=args.work, max_steps=args.warmup + args.steps,
                        per_device_train_batch_size=p["micro"], gradient_accumulation_steps=1,
                        learning_rate=2e-4, max_grad_norm=1.0, max_length=p["seq"],
                        logging_steps=1, report_to="none", save_strategy="no", seed=0, bf16=not CPU, use_cpu=CPU,
                        disable_tqdm=True, dataloader_drop_last=True, deepspeed=ZERO3)
    times: list[float] = []
    timer = common.step_timer(torch.cuda.synchronize if cuda else (lambda: None), times)
    trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=data, processing_class=ByT5Tokenizer(),
                             peft_config=lora, callbacks=[timer])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    trainable = sum(getattr(q, "ds_numel", q.numel()) for q in trainer.model.parameters() if q.requires_grad)
    mine = [torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30] if cuda else [0.0, 0.0]
    peaks = [None] * world
    dist.all_gather_object(peaks, mine)
    engine = sys.modules["deepspeed"]
    timed = times[args.warmup:]
    if dist.get_rank() == 0:
        r = {"impl": args.impl, "world_size": world, "preset": args.preset, "seq": p["seq"], "micro": p["micro"],
             "step_s": statistics.median(timed), "min_s": min(timed), "max_s": max(timed), "timed_steps": len(timed),
             "tokens_per_s_per_gpu": p["micro"] * p["seq"] / statistics.median(timed),
             "peak_alloc_gib": max(a for a, _ in peaks), "peak_reserved_gib": max(b for _, b in peaks),
             "peak_alloc_gib_per_rank": [a for a, _ in peaks],
             "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
             "trainable_params": trainable, "gradient_checkpointing": cfg.gradient_checkpointing,
             "engine": f"deepspeed {engine.__version__} from {getattr(engine, '__file__', None) or 'fsdpzero launch'}",
             "device": torch.cuda.get_device_name() if cuda else "cpu",
             "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                          "peft": peft.__version__, "trl": trl.__version__}}
        Path(args.json).write_text(json.dumps(r, indent=1))


def launch(impl: str, args, out: Path) -> dict:
    path = out / f"{impl}.json"
    script = [__file__, "--worker", "--impl", impl, "--json", str(path), "--work", str(out / f"{impl}-trainer"),
              "--preset", args.preset, "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if impl == "fsdpzero":    # the deepspeed launcher's command line; the script runs unchanged on fsdpzero
        cmd = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())", "launch",
               "--num_gpus", str(args.nproc), "--master_port", str(args.port), *script]
    else:                     # real DeepSpeed (torchrun: no shim, `import deepspeed` is DeepSpeed's)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", *script]
    sys.path.insert(0, str(ROOT / "bench"))
    import common
    env = common.worker_env(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "ops"), os.environ.get("PYTHONPATH")])),
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions")))
    if "TORCH_CUDA_ARCH_LIST" in env:   # DeepSpeed 0.19.8's op builder cannot parse "9.0a"
        env["TORCH_CUDA_ARCH_LIST"] = env["TORCH_CUDA_ARCH_LIST"].replace("a", "")
    shown = ["fsdpzero", *cmd[3:]] if impl == "fsdpzero" else cmd
    print(f"--- {impl}: {' '.join(shown)}", flush=True)
    t0 = time.perf_counter()
    text, rc = common.run_launcher(cmd, env, args.run_timeout, cwd=ROOT)
    (out / f"{impl}.log").write_text(text)
    if rc != 0 or not path.exists():
        tail = [line for line in text.strip().splitlines() if line.strip()][-1:]
        print(f"    failed (rc {rc}): {tail}", flush=True)
        return {"impl": impl, "error": f"rc={rc}", "log_tail": text[-3000:]}
    row = json.loads(path.read_text())
    row["wall_s"] = time.perf_counter() - t0
    print(f"    {row['step_s']:.3f} s/step, peak alloc {row['peak_alloc_gib']:.2f} GiB, wall {row['wall_s']:.0f} s",
          flush=True)
    return row


def table(rows: list[dict]) -> tuple[str, dict]:
    lines = ["| impl | step s median (min-max) | tok/s/GPU | peak alloc GiB | peak resv GiB | trainable | "
             "first / last loss |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['impl']} | {r['step_s']:.4f} ({r['min_s']:.4f}-{r['max_s']:.4f}) | "
                     f"{r['tokens_per_s_per_gpu']:.0f} | {r['peak_alloc_gib']:.2f} | {r['peak_reserved_gib']:.2f} | "
                     f"{r['trainable_params']} | {r['losses'][0]:.4f} / {r['losses'][-1]:.4f} |")
    by = {r["impl"]: r for r in rows if "error" not in r}
    compare = {}
    if set(by) == set(IMPLS):
        a, b = by["fsdpzero"], by["deepspeed"]
        compare = {"step_time_ours_over_ds": a["step_s"] / b["step_s"],
                   "peak_alloc_gib_ours_minus_ds": a["peak_alloc_gib"] - b["peak_alloc_gib"],
                   "max_abs_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
                   "steps_compared": min(len(a["losses"]), len(b["losses"]))}
        lines.append(f"\nfsdpzero/DeepSpeed step time {compare['step_time_ours_over_ds']:.3f}, peak alloc "
                     f"{compare['peak_alloc_gib_ours_minus_ds']:+.2f} GiB, max loss difference over "
                     f"{compare['steps_compared']} steps {compare['max_abs_loss_diff']:.2e}")
    return "\n".join(lines), compare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)   # the deepspeed launcher passes it
    ap.add_argument("--impl", choices=IMPLS)
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--preset", default="tiny" if CPU else "0.9b")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: the preset's)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--port", type=int, default=29531, help="fsdpzero launch's --master_port")
    ap.add_argument("--run-timeout", type=int, default=280)
    ap.add_argument("--json")
    ap.add_argument("--work")
    ap.add_argument("--out", default="out/trl_sft_lora")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for impl in args.impls:
        if impl == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            rows.append({"impl": impl, "error": "deepspeed not importable (PYTHONPATH=$PWD/.dsdist on the GPU host)"})
            continue
        rows.append(launch(impl, args, out))
    md, compare = table(rows)
    summary = {"nproc": args.nproc, "preset": args.preset, "steps": args.steps, "warmup": args.warmup,
               "ds_config": ZERO3, "rows": rows, "compare": compare}
    (out / "trl_sft_lora.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(md + "\n")
    print(json.dumps(summary))
    print(md)


if __name__ == "__main__":
    main()
