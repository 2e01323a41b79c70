"""Offload training step on GPUs: fsdpzero's optimizer offload against FSDP2 CPUOffloadPolicy, DeepSpeed ZeRO-Offload
and no offload, with the setup of shared/spec/device_anchors.md (0.89 B Llama, bf16 compute, fp32 masters, AdamW
lr 1e-4 wd 0.01, clip 1.0, seq 2048 x micro-batch 4 per GPU, 3 warm-up + 10 timed steps, rank 0 median).

One config per torchrun (run on 2 GPUs):
    torchrun --standalone --nproc_per_node=2 bench/offload.py --config ours_z2 --json out/ours_z2.json
All configs in sequence, one table (each config is its own torchrun, so nothing leaks between them):
    python bench/offload.py --all --nproc 2 --out out/offload
Configs: fsdp_z2, fsdp_z3 (no offload); fsdp_z3_cpuoffload (CPUOffloadPolicy + CPU fused AdamW); ours_z2 (stage 2 +
optimizer offload); ours_z3_both (stage 3 + optimizer and param offload); *_overlap (the CPU step overlaps the next
forward); *_spec (FSDPZERO_OFFLOAD_SPECULATE=1: the speculative CPU step during backward); *_noclip
(gradient_clipping 0, both implementations); ours_z3_ratio_overlap / ds_z3_ratio (stage 3, offload_optimizer.ratio = FSDPZERO_BENCH_RATIO, default 0.5:
the rest steps on the GPU); ds_z2_offload, ds_z3_offload_both (DeepSpeed, when importable). --layers/--hidden/--vocab/--seq/--micro shrink the model for a smoke run;
FSDPZERO_BENCH_CPU=1 runs it on CPU/gloo (correctness of the script only).
FSDPZERO_OFFLOAD_PROFILE=1: the ours_* configs also write the offload path's per-step timeline (rank 0, JSON lines,
fields in fsdpzero/offload/timeline.py) next to their JSON as <config>.timeline.jsonl, and the row gets
"timeline_median" (the median of each scalar field over the timed steps).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import config_main, run_configs  # noqa: E402  (bench/ is the script's folder)
CONFIGS = ["fsdp_z2", "fsdp_z3", "fsdp_z3_cpuoffload", "ours_z2", "ours_z2_overlap", "ours_z2_overlap_spec",
           "ours_z2_overlap_noclip", "ours_z2_overlap_noclip_spec", "ours_z3_both", "ours_z3_both_overlap",
           "ours_z3_ratio_overlap", "ds_z2_offload", "ds_z2_offload_noclip", "ds_z3_offload_both", "ds_z3_ratio"]
RATIO = float(os.environ.get("FSDPZERO_BENCH_RATIO", "0.5"))   # *_ratio*: offload_optimizer.ratio (stage 3)
DEVICE = "cuda" if os.environ.get("FSDPZERO_BENCH_CPU") != "1" else "cpu"   # CPU: smoke runs only
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CLIP = 1.0


def build_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                      num_key_value_heads=8, intermediate_size=args.hidden * 11 // 4, vocab_size=args.vocab,
                      tie_word_embeddings=False,
                      max_position_embeddings=max(2048, args.seq))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    return LlamaForCausalLM(cfg)


def shard(model, stage, cpu_offload):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mesh = init_device_mesh(DEVICE, (int(os.environ["WORLD_SIZE"]),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=DEVICE == "cuda") if cpu_offload else OffloadPolicy()
    raf = stage == 3
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=raf, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf, mp_policy=mp, offload_policy=policy)
    return model


def ds_config(args, name):
    """The DeepSpeed config of a run: DeepSpeed and fsdpzero ("ours_*") read the same dict."""
    both = "both" in name
    zero = {"stage": 3 if "z3" in name else 2, "overlap_comm": True, "contiguous_gradients": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if "ratio" in name:
        zero["offload_optimizer"]["ratio"] = RATIO
    if both:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "gradient_clipping": 0.0 if "noclip" in name else CLIP,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": HYPER["lr"], "betas": list(HYPER["betas"]),
                                                      "eps": HYPER["eps"], "weight_decay": HYPER["weight_decay"]}}}


def fsdp_runner(args, name):
    """Plain FSDP2 (no offload, or CPUOffloadPolicy + CPU fused AdamW), driven like a hand-written loop."""
    import torch
    from fsdpzero.optim import FSDPGradPath, clip_factor
    stage = 3 if "z3" in name else 2
    model = shard(build_model(args).to(DEVICE), stage, cpu_offload=name.endswith("cpuoffload"))
    path = FSDPGradPath(model, torch.optim.AdamW(model.parameters(), **HYPER, fused=True))

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        path.finish_gradients()
        path.scale_grads_(clip_factor(path.grad_norm(), CLIP))
        path.step()
        path.zero_grad()
        return loss
    return step, lambda: None


def ours_runner(args, name):
    """fsdpzero: the DeepSpeed config through fsdpzero.wrap (engine + offload gradient path)."""
    import fsdpzero
    os.environ["FSDPZERO_OFFLOAD_OVERLAP"] = "1" if "_overlap" in name else "0"
    os.environ["FSDPZERO_OFFLOAD_SPECULATE"] = "1" if name.endswith("_spec") else "0"
    engine = fsdpzero.wrap(build_model(args), ds_config(args, name))

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss
    step.grad_norm = engine.get_global_grad_norm   # clipping triggers when it is above CLIP
    spec = getattr(engine.grad_path, "spec", None)
    step.spec_stats = (lambda: dict(spec.stats)) if spec is not None else None
    return step, getattr(engine.grad_path, "wait", lambda: None)


def ds_runner(args, name):
    import deepspeed  # the bench may import DeepSpeed; the library never does
    model = build_model(args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(args, name))

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss
    step.grad_norm = engine.get_global_grad_norm
    return step, lambda: None


def run_one(args):
    import psutil
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if DEVICE == "cuda":
        torch.cuda.set_device(local_rank)
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // local_world))   # torchrun sets 1; every config gets the same share
    if args.config.startswith("ds_"):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"   # DS 0.19.8 cannot parse "9.0a"
        import deepspeed
        deepspeed.init_distributed(dist_backend="nccl")
    elif args.config.startswith("fsdp_"):
        dist.init_process_group("cuda:nccl,cpu:gloo" if DEVICE == "cuda" else "gloo")
    timeline = None
    if os.environ.get("FSDPZERO_OFFLOAD_PROFILE") == "1" and args.config.startswith("ours_"):
        timeline = Path(args.json or f"out/offload/{args.config}.json").with_suffix(".timeline.jsonl")
        timeline.parent.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            timeline.unlink(missing_ok=True)
        os.environ["FSDPZERO_OFFLOAD_PROFILE_FILE"] = str(timeline)
    t_setup = time.perf_counter()
    runner = {"ds": ds_runner, "fsdp": fsdp_runner, "ours": ours_runner}[args.config.split("_")[0]]
    step, finish = runner(args, args.config)
    setup_s = time.perf_counter() - t_setup
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + rank)
    x = torch.randint(0, args.vocab, (args.micro, args.seq), device=DEVICE, generator=gen)
    cuda = DEVICE == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses, norms = [], [], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        if i == args.warmup:
            t_loop = t0
        loss = step(x)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        norm = getattr(step, "grad_norm", lambda: None)()
        norms.append(None if norm is None else float(norm))
    finish()   # an overlapped CPU step ends after step() returns: count its tail in the mean
    sync()
    mean_incl_tail = (time.perf_counter() - t_loop) / args.steps
    med = statistics.median(times)
    tokens = args.micro * args.seq
    result = {"config": args.config, "world": world, "threads": torch.get_num_threads(), "step_s": med, "step_s_mean_incl_tail": mean_incl_tail,
              "step_min": min(times), "step_max": max(times), "tokens_per_s_per_gpu": tokens / med,
              "peak_alloc_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
              "peak_reserved_GiB": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
              "host_rss_GiB": psutil.Process().memory_info().rss / 2**30, "setup_s": setup_s,
              "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
              "grad_norms": norms}
    if getattr(step, "spec_stats", None) is not None:
        result["speculation"] = step.spec_stats()
    clip = ds_config(args, args.config)["gradient_clipping"] if not args.config.startswith("fsdp") else CLIP
    timed_norms = norms[args.warmup:]
    if clip > 0 and all(n is not None for n in timed_norms):   # per-step times split by whether clipping triggered
        for key, pick in (("step_s_clipped", lambda n: n + 1e-6 > clip), ("step_s_unclipped", lambda n: n + 1e-6 <= clip)):
            sel = [t for t, n in zip(times, timed_norms) if pick(n)]
            result[key] = statistics.median(sel) if sel else None
            result[key.replace("step_s", "steps")] = len(sel)
    peak = torch.tensor([result["peak_alloc_GiB"]], device=DEVICE)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    result["peak_alloc_GiB_max_over_ranks"] = peak.item()
    if timeline is not None and rank == 0 and timeline.exists():
        result["timeline_file"] = str(timeline)
        result["timeline_median"] = timeline_median(timeline, args.warmup)
    if rank == 0:
        print(json.dumps(result))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()


def timeline_median(path: Path, warmup: int) -> dict:
    """Median over the timed steps of each scalar field of the timeline, plus per-chunk Adam/D2H/H2D medians."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["step"] >= warmup] or recs
    med = {k: statistics.median(r[k] for r in recs if k in r)
           for k in recs[0] if isinstance(recs[0][k], (int, float))}
    med["unit_wait_host"] = [statistics.median(r["unit_wait_host"][u] for r in recs)
                             for u in range(len(recs[0]["unit_wait_host"]))]
    if "unit_wait_gpu" in recs[0]:
        med["unit_wait_gpu"] = [statistics.median(r["unit_wait_gpu"][u] for r in recs)
                                for u in range(len(recs[0]["unit_wait_gpu"]))]
    chunk_keys = ("numel", "d2h_gpu", "d2h_wait_host", "adam_host", "adam_gparam_s", "adam_start_host", "h2d_gpu",
                  "h2d_end_gpu")
    med["chunks"] = [{k: statistics.median(r["chunks"][i][k] for r in recs if k in r["chunks"][i])
                      for k in chunk_keys if k in recs[0]["chunks"][i]} for i in range(len(recs[0]["chunks"]))]
    return med


def run_all(args):
    rows = run_configs(__file__, args, "offload.json")
    print("\n| config | step s median (min-max) | mean incl. tail | clipped / unclipped steps: median s (n) | "
          "tokens/s/GPU | peak alloc GiB (max rank) | host RSS r0 GiB | "
          "loss first -> last |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['error']} | | | | | | |")
            continue
        split = " / ".join(f"{r[k]:.3f} ({r[k.replace('step_s', 'steps')]})" if r.get(k) is not None else "-"
                           for k in ("step_s_clipped", "step_s_unclipped"))
        print(f"| {r['config']} | {r['step_s']:.3f} ({r['step_min']:.3f}-{r['step_max']:.3f}) | "
              f"{r['step_s_mean_incl_tail']:.3f} | {split} | "
              f"{r['tokens_per_s_per_gpu']:,.0f} | {r['peak_alloc_GiB_max_over_ranks']:.2f} | "
              f"{r['host_rss_GiB']:.2f} | {r['loss_first']:.4f} -> {r['loss_last']:.4f} |")
    for r in rows:
        t = r.get("timeline_median")
        if t:
            keys = ("backward_end_host", "backward_end_gpu", "grad_norm_gpu", "factor_sync_host", "device_step_host",
                    "step_return_host",
                    "cpu_done_host", "adam_host_total", "adam_gparam_s", "d2h_wait_host_total", "step_threads")
            print(f"{r['config']} timeline (median s): " + ", ".join(f"{k}={t[k]:.4g}" for k in keys if k in t)
                  + f", unit_wait_host={sum(t['unit_wait_host']):.4g}"
                  + (f", unit_wait_gpu={sum(t['unit_wait_gpu']):.4g}" if "unit_wait_gpu" in t else ""))


if __name__ == "__main__":
    config_main(__doc__, CONFIGS, run_one, run_all, out="out/offload", timeout=400)
