"""ZeRO stage 1 on GPUs: fsdpzero's stage 1 (ops/fsdpzero_ops/stage1/optimizer.py through fsdpzero.wrap) against DeepSpeed stage 1 and
fsdpzero's stage 2 (FSDP2), with the setup of shared/spec/device_anchors.md: 0.89 B Llama, bf16 compute with fp32
masters, AdamW lr 1e-4 wd 0.01, clip 1.0, seq 2048 x micro-batch 4 per GPU, 3 warm-up + 10 timed steps;
communication in bf16, DeepSpeed's default for bf16 (the *_fp32reduce config reduces in fp32).

Timing, the same for every config: the timed steps run as a training loop runs them, each reading its loss
(loss.item() after engine.step(), as a loop that logs every step), the device synchronized once after the last;
step_s is the mean (rank 0). Work a step leaves on the device (stage 1's all-gather, finished under the next
forward) is therefore charged where it really costs time, not hidden by a synchronize after each step.

All configs, each its own torchrun, one table (run on 2 GPUs):
    python bench/stage1.py --all --nproc 2 --out out/stage1
One config:
    torchrun --standalone --nproc_per_node=2 bench/stage1.py --config ours_z1 --json out/stage1/ours_z1.json
Configs: ours_z1 (overlap_comm off: every reduce-scatter after backward), ours_z1_overlap (reduce-scatters from
backward hooks, default 5e8-element buckets), ours_z1_overlap_b1e8 (1e8-element buckets: more overlap),
ours_z1_fp32reduce, ours_z1_legacy / ours_z1_overlap_legacy (the stage-1 speed-ups of fsdpzero.optim.stage1.KNOBS
off: plain greedy buckets, a separate clip-scaling pass, no pipelined step, the all-gather finished inside step()),
ours_z1_fwdag (FSDPZERO_STAGE1_FORWARD_ALLGATHER=1, opt-in: the all-gather finishes under the next forward), ours_z2 (fsdpzero stage 2 = FSDP2
reshard_after_forward=False), ds_z1, ds_z2 (DeepSpeed,
overlap_comm and contiguous_gradients on, as in device_anchors.md; skipped when deepspeed is not importable).
--layers/--hidden/--vocab/--seq/--micro shrink the model; FSDPZERO_BENCH_CPU=1 runs on CPU/gloo (script check only).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "ops"))   # fsdpzero_ops, from the checkout
from common import config_main, run_configs  # noqa: E402  (bench/ is the script's folder)
CONFIGS = ["ours_z1", "ours_z1_overlap", "ours_z1_overlap_b1e8", "ours_z1_fp32reduce", "ours_z2", "ds_z1", "ds_z2",
           "ours_z3", "ds_z3", "ours_z1_legacy", "ours_z1_overlap_legacy", "ours_z1_fwdag"]   # z3: the same setup at stage 3, for the stage-3 ratio against DeepSpeed
DEVICE = "cuda" if os.environ.get("FSDPZERO_BENCH_CPU") != "1" else "cpu"


def build_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                      num_key_value_heads=8, intermediate_size=args.hidden * 11 // 4, vocab_size=args.vocab,
                      tie_word_embeddings=False, max_position_embeddings=max(2048, args.seq))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    return LlamaForCausalLM(cfg)


def ds_config(args, name: str) -> dict:
    """The same DeepSpeed config for both libraries; only the ZeRO section varies by config name."""
    zero = {"stage": 3 if "z3" in name else 2 if "z2" in name else 1, "overlap_comm": name.startswith("ds_") or "overlap" in name,
            "contiguous_gradients": True}
    if name.endswith("b1e8"):
        zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = 100_000_000
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
           "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                     "weight_decay": 0.01}}}
    if name.endswith("fp32reduce"):
        cfg["communication_data_type"] = "fp32"
    return cfg


def make_engine(args, name: str):
    model = build_model(args)
    if name.startswith("ds_"):
        import deepspeed  # the bench may import DeepSpeed; the library never does
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(args, name))
    else:
        import fsdpzero.api
        engine = fsdpzero.api.wrap(model, ds_config(args, name), device_type=DEVICE)
    return engine


def run_one(args):
    import psutil
    import torch
    import torch.distributed as dist
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    if args.config.startswith("ds_"):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
        if cuda:
            major, minor = torch.cuda.get_device_capability()
            os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"   # DS 0.19.8 cannot parse "9.0a"
        import deepspeed
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    if args.config.endswith("_legacy"):
        from fsdpzero.optim.stage1 import KNOBS
        os.environ.update({env: "0" for env in KNOBS.values()})
    if args.config.endswith("_fwdag"):
        os.environ["FSDPZERO_STAGE1_FORWARD_ALLGATHER"] = "1"
    t_setup = time.perf_counter()
    engine = make_engine(args, args.config)
    setup_s = time.perf_counter() - t_setup
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + rank)
    x = torch.randint(0, args.vocab, (args.micro, args.seq), device=DEVICE, generator=gen)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses = []

    def train_step():
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    for _ in range(args.warmup):
        train_step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step()
    sync()
    mean = (time.perf_counter() - t0) / args.steps
    result = {"config": args.config, "world": dist.get_world_size(), "step_s": mean, "timing": "mean, one sync",
              "tokens_per_s_per_gpu": args.micro * args.seq / mean,
              "peak_alloc_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
              "peak_reserved_GiB": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
              "host_rss_GiB": psutil.Process().memory_info().rss / 2**30, "setup_s": setup_s,
              "loss_first": losses[0], "loss_last": losses[-1], "losses": losses}
    peak = torch.tensor([result["peak_alloc_GiB"], result["peak_reserved_GiB"]], device=DEVICE)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    result["peak_alloc_GiB_max_over_ranks"], result["peak_reserved_GiB_max_over_ranks"] = peak.tolist()
    if rank == 0:
        print(json.dumps(result))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


def run_all(args):
    rows = run_configs(__file__, args, "stage1.json")
    ok = {r["config"]: r for r in rows if "error" not in r}
    ds, z2 = ok.get("ds_z1"), ok.get("ours_z2")
    print("\n| config | step s (mean, one sync) | tokens/s/GPU | vs DS z1 | peak alloc / reserved GiB (max rank) "
          "| loss first -> last | max abs loss diff vs ours_z2 |\n|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['error']} | | | | | |")
            continue
        vs = f"{r['tokens_per_s_per_gpu'] / ds['tokens_per_s_per_gpu']:.3f}x" if ds else "-"
        drift = f"{max(abs(a - b) for a, b in zip(r['losses'], z2['losses'])):.2e}" if z2 else "-"
        print(f"| {r['config']} | {r['step_s']:.4f} | "
              f"{r['tokens_per_s_per_gpu']:,.0f} | {vs} | {r['peak_alloc_GiB_max_over_ranks']:.2f} / "
              f"{r['peak_reserved_GiB_max_over_ranks']:.2f} | {r['loss_first']:.4f} -> {r['loss_last']:.4f} | "
              f"{drift} |")


if __name__ == "__main__":
    config_main(__doc__, CONFIGS, run_one, run_all, out="out/stage1", timeout=500)
