"""bf16 LoRA SFT through the Hugging Face Trainer, fsdpzero.hf.Trainer vs transformers' Trainer on DeepSpeed 0.19.8,
one real LLaMA-Factory config (tests/ds_configs/llamafactory_ds_z3_offload.json: ZeRO-3, parameters and optimizer
offloaded to the CPU, "auto" everywhere), the same model, LoRA, data, seed and TrainingArguments, in one run.

    python bench/hf_lora.py --all --nproc 1 --out out/hf_lora            # both, one torchrun each, then a table

Model: the 0.9 B Llama preset of bench/common.py (random init, bf16 weights: the frozen base as LoRA users load it),
LoRA r=16 on every linear layer of the blocks. Fixed random token batches (data loading is not measured). Per
implementation: median step time over the timed steps (cuda-synchronised Trainer steps), launch to first step, peak
GPU memory (max_memory_allocated / reserved), peak host RSS (VmHWM), pinned host bytes where CUDA reports them, the
trainable parameters, and the loss of every step. FSDPZERO_BENCH_CPU=1: gloo/CPU, tiny model (proves the script).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "ops"))   # fsdpzero_ops, from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its import time is the launch clock)
from host_memory import proc_status  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "ds_configs" / "llamafactory_ds_z3_offload.json"
CONFIGS = ["fsdpzero_z3_offload_lora", "ds_z3_offload_lora"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class FixedBatches(torch.utils.data.Dataset):
    def __init__(self, p: dict, n: int):
        g = torch.Generator().manual_seed(1000)
        self.ids = torch.randint(0, p["vocab_size"], (n, p["seq"]), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _preset(args) -> dict:
    p = dict(common.PRESETS["tiny" if common.CPU else "0.9b"])
    if not common.CPU:
        p.update(num_hidden_layers=args.layers, hidden_size=args.hidden, vocab_size=args.vocab, seq=args.seq,
                 micro=args.micro)
    return p


def run_one(args) -> None:
    import transformers

    import peft
    p = _preset(args)
    ours = args.config.startswith("fsdpzero")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if common.CPU else torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = common.build_model(p, torch.device("cpu"), dtype=torch.bfloat16)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = peft.get_peft_model(model, lora)
    trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
    ds = json.loads(CONFIG.read_text())
    if common.CPU:
        for key in ("offload_optimizer", "offload_param"):
            ds["zero_optimization"][key]["pin_memory"] = False
    kwargs = dict(output_dir=f"{args.out}/{args.config}-trainer", max_steps=args.warmup + args.steps,
                  per_device_train_batch_size=p["micro"], gradient_accumulation_steps=1, learning_rate=2e-4,
                  weight_decay=0.0, warmup_steps=2, max_grad_norm=1.0, logging_steps=1, report_to=[],
                  save_strategy="no", bf16=not common.CPU, use_cpu=common.CPU, disable_tqdm=True, seed=0,
                  deepspeed=ds, dataloader_drop_last=True)
    if ours:
        import fsdpzero.hf
        targs = fsdpzero.hf.TrainingArguments(**kwargs)
        trainer_cls = fsdpzero.hf.Trainer
    else:
        targs = transformers.TrainingArguments(**kwargs)
        trainer_cls = transformers.Trainer
    times: list[float] = []
    first: list[float] = []
    timer = common.step_timer(torch.cuda.synchronize if device.type == "cuda" else (lambda: None), times, first)

    world = int(os.environ.get("WORLD_SIZE", 1))
    data = FixedBatches(p, (args.warmup + args.steps) * p["micro"] * world)
    trainer = trainer_cls(model=model, args=targs, train_dataset=data, callbacks=[timer])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    timed = times[args.warmup:]
    mem = proc_status()
    rank = int(os.environ.get("RANK", 0))
    result = {"config": args.config, "impl": "fsdpzero" if ours else "deepspeed", "world": world,
              "step_s": statistics.median(timed), "min_s": min(timed), "max_s": max(timed),
              "launch_to_first_step_s": first[0] if first else None,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else 0.0,
              "host_peak_rss_gib": mem.get("VmHWM"), "host_rss_end_gib": mem.get("VmRSS"),
              "n_params": common.n_params(model), "trainable_params": trainable,
              "tokens_per_s_per_gpu": p["micro"] * p["seq"] / statistics.median(timed),
              "shape": {k: p[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size", "seq", "micro")},
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "peft": peft.__version__}}
    if not ours:
        import deepspeed
        result["versions"]["deepspeed"] = deepspeed.__version__
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def run_all(args) -> None:
    if "TORCH_CUDA_ARCH_LIST" in os.environ:   # DeepSpeed's op builder cannot parse "9.0a"
        os.environ["TORCH_CUDA_ARCH_LIST"] = os.environ["TORCH_CUDA_ARCH_LIST"].replace("a", "")
    rows = common.run_configs(__file__, args, "hf_lora.json")
    ok = {r["impl"]: r for r in rows if "error" not in r}
    print("\n| impl | step s (min-max) | tokens/s/GPU | peak GPU alloc GiB | host peak RSS GiB | first step s |"
          " loss first -> last |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['error']} | | | | | |")
            continue
        print(f"| {r['impl']} | {r['step_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | "
              f"{r['tokens_per_s_per_gpu']:.0f} | {r['peak_alloc_gib']:.2f} | {r['host_peak_rss_gib']:.2f} | "
              f"{r['launch_to_first_step_s']:.1f} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    if len(ok) == 2:
        a, b = ok["fsdpzero"], ok["deepspeed"]
        ratios = {"step_time_ds_over_ours": b["step_s"] / a["step_s"],
                  "peak_alloc_ours_over_ds": a["peak_alloc_gib"] / max(b["peak_alloc_gib"], 1e-9),
                  "host_rss_ours_over_ds": a["host_peak_rss_gib"] / b["host_peak_rss_gib"],
                  "max_abs_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))}
        print(json.dumps(ratios, indent=1))
        Path(args.out, "hf_lora_ratios.json").write_text(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    common.config_main(__doc__, CONFIGS, run_one, run_all, out="out/hf_lora", timeout=900)
