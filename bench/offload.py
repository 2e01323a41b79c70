"""Offload training step on GPUs: fsdpzero's optimizer offload against FSDP2 CPUOffloadPolicy, DeepSpeed ZeRO-Offload
and no offload, with the setup of shared/spec/device_anchors.md (0.89 B Llama, bf16 compute, fp32 masters, AdamW
lr 1e-4 wd 0.01, clip 1.0, seq 2048 x micro-batch 4 per GPU, 3 warm-up + 10 timed steps, rank 0 median).

Issue 24's comparison, in one call on one GPU (DeepSpeed, fsdpzero serial / overlapped / speculative, the GPU step
without optimizer and the CPU Adam step, for the 0.89 B and 2.8 B Llama; JSON + one table per size; each config is
its own torchrun, skipped with a row when the time budget would be exceeded, so the call ends in time and exits 0):
    python bench/offload.py --suite issue24 --out out/offload24 --budget-s 560
    python bench/offload.py --suite issue24 --sizes 2.8b --out out/offload24_2p8    # one size per call
Issue 31's (item 4) on N GPUs: stage 2 + CPU offload and stage 3 + full offload, fsdpzero's default CPU placement
(fsdpzero/host.py), the old unpinned share (*_bind0: knob offload_bind=0) and DeepSpeed, median of 12 timed steps,
slowest step / median, per-step page faults, new pinned blocks and pages placed off their CPU's NUMA node, JSON
(issue31.json) + table:
    PYTHONPATH=$PWD/.dsdist python bench/offload.py --suite issue31 --sizes 0.89b --nproc 2 --out out/offload31 \
        --budget-s 450
Its row "same, 4 OMP threads per rank" on 4 GPUs (both sides 4 CPU threads per rank: ours_*_t4 is offload_threads 4;
ds_*_t4 runs DeepSpeed with OMP_NUM_THREADS=4 and torch.set_num_threads(4), so its CPU Adam's OpenMP loop has 4
threads; the row's omp_max_threads is what that OpenMP runtime reports after the run; not yet run on GPUs):
    PYTHONPATH=$PWD/.dsdist NCCL_NVLS_ENABLE=0 python bench/offload.py --suite issue31 --sizes 0.89b --nproc 4 \
        --configs ours_z2_t4,ds_z2_offload_t4,ours_z3_both_t4,ds_z3_offload_both_t4 --out out/offload31_t4 \
        --budget-s 500

One config per torchrun (run on 2 GPUs):
    torchrun --standalone --nproc_per_node=2 bench/offload.py --config ours_z2 --json out/ours_z2.json
All configs in sequence, one table (each config is its own torchrun, so nothing leaks between them):
    python bench/offload.py --all --nproc 2 --out out/offload
Configs: fsdp_z2, fsdp_z3 (no offload); fsdp_z3_cpuoffload (CPUOffloadPolicy + CPU fused AdamW); ours_z2 (stage 2 +
optimizer offload, fsdpzero's defaults: overlapped); ours_z3_both (stage 3 + optimizer and param offload); *_serial
(tuning offload_overlap=false and offload_speculate=false: the CPU step inside step()); *_overlap (the CPU step
overlaps the next forward, the default; with the default speculation, offload_speculate=auto); *_nospec
(offload_speculate=false); *_spec (offload_speculate=true: shadows for all that fit in half the host's memory); *_noclip
(gradient_clipping 0, both implementations); ours_z3_ratio_overlap / ds_z3_ratio (stage 3, offload_optimizer.ratio = FSDPZERO_BENCH_RATIO, default 0.5:
the rest steps on the GPU); ours_z2_ratio<NN> (stage 2, ratio NN/100: an fsdpzero extension, DeepSpeed rejects
ratio < 1 below stage 3, so it has no DeepSpeed twin); ds_z2_offload, ds_z3_offload_both (DeepSpeed, when importable;
*_t<N>: N OpenMP threads per rank, the OMP_NUM_THREADS a DeepSpeed user sets;
*_bind1: each rank pinned to its own cores first, as `deepspeed --bind_cores_to_rank` runs it). --layers/--hidden/--vocab/--seq/--micro shrink the model for a smoke run;
ref_gpu_noopt (FSDP2 stage 2, bf16: forward + backward + grad norm, no optimizer step) and ref_cpu_adam (the fused
CPU Adam over this model's parameters per rank, chunked as the offload path steps them, bf16 grads in, bf16 out) are
the two terms of issue 24's limit max(GPU step without optimizer, CPU Adam step).
FSDPZERO_BENCH_CPU=1 runs it on CPU/gloo (correctness of the script only).
FSDPZERO_OFFLOAD_PROFILE=1: the ours_* configs also write the offload path's per-step timeline (every rank, JSON
lines, fields in fsdpzero/offload/timeline.py) next to their JSON as <config>.timeline.rank<N>.jsonl, and the row gets
"timeline_median" (rank 0's median of each scalar field over the timed steps) and "timeline_ranks" (every rank's
per-step fields). Every row has "ranks": each rank's step times, CPU seconds and involuntary context switches per step.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "ops"))   # fsdpzero_ops, from the checkout
from common import config_main, run_configs  # noqa: E402  (bench/ is the script's folder)
from fsdpzero.host import format_cpulist  # noqa: E402
CONFIGS = ["fsdp_z2", "fsdp_z3", "fsdp_z3_cpuoffload", "ours_z2", "ours_z2_serial", "ours_z2_overlap",
           "ours_z2_overlap_spec", "ours_z2_overlap_noclip", "ours_z2_overlap_noclip_spec", "ours_z3_both",
           "ours_z3_both_serial", "ours_z3_both_overlap", "ours_z3_ratio_overlap", "ds_z2_offload",
           "ds_z2_offload_noclip", "ds_z3_offload_both", "ds_z3_ratio", "ref_gpu_noopt", "ref_cpu_adam",
           "ours_z2_overlap_t8", "ours_z2_overlap_t12", "ours_z3_both_overlap_t8", "ours_z3_both_overlap_t12",
           "ours_z2_overlap_t14", "ours_z2_overlap_noclip_t14", "ours_z2_overlap_noclip_spec_t14",
           "ours_z2_overlap_noclip_spec_t12", "ours_z2_overlap_spec_t14", "ours_z2_serial_noclip",
           "ours_z2_overlap_nospec", "ours_z2_overlap_noclip_nospec", "ours_z2_overlap_noclip_t16",
           "ours_z2_overlap_noclip_st8", "ours_z2_overlap_noclip_st13", "ours_z2_overlap_noclip_st15",
           "ours_z2_ratio70", "ours_z2_ratio80", "ours_z2_ratio70_noclip", "ours_z2_bind0", "ours_z3_both_bind0",
           "ours_z2_bind1", "ours_z3_both_bind1", "ds_z2_offload_bind1", "ds_z3_offload_both_bind1",
           "ours_z2_t14", "ours_z2_t15", "ours_z3_both_t14", "ours_z3_both_t15", "ours_z2_t16", "ours_z3_both_t16",
           "ours_z2_t4", "ours_z3_both_t4", "ds_z2_offload_t4", "ds_z3_offload_both_t4"]
# issue 24: per size, the shape (micro-batch per GPU) and the configs, cheapest reference first
SIZES = {"0.89b": dict(layers=16, hidden=2048, micro=4), "2.8b": dict(layers=26, hidden=3072, micro=2),
         "tiny": dict(layers=2, hidden=64, micro=2, vocab=512, seq=32)}   # tiny: the CPU smoke test
_Z2 = ["ref_cpu_adam", "ref_gpu_noopt", "ds_z2_offload", "ours_z2_serial", "ours_z2_overlap_nospec", "ours_z2_overlap"]
_Z3 = ["ds_z3_offload_both", "ours_z3_both_serial", "ours_z3_both_overlap"]
# issue 31 item 4: the default placement (fsdpzero/host.py: a core slice per local rank) against the old unpinned
# share (offload_bind=0) and DeepSpeed, stage 2 + CPU optimizer offload and stage 3 + full offload, 12 timed steps;
# ours first, so a fresh host's first-run costs fall on the default, not on the comparison rows
_I31 = ["ours_z2", "ds_z2_offload", "ours_z2_bind0", "ours_z3_both", "ds_z3_offload_both", "ours_z3_both_bind0"]
SUITE = {"issue24": {"0.89b": _Z2 + _Z3, "2.8b": _Z2, "tiny": _Z2 + _Z3},   # issue 24 asks 2.8 B for stage 2 only
         "issue31": {"0.89b": _I31, "2.8b": ["ours_z2", "ds_z2_offload", "ours_z2_bind0"], "tiny": _I31}}
RATIO = float(os.environ.get("FSDPZERO_BENCH_RATIO", "0.5"))   # *_ratio*: offload_optimizer.ratio (stage 3)
DEVICE = "cuda" if os.environ.get("FSDPZERO_BENCH_CPU") != "1" else "cpu"   # CPU: smoke runs only
# BENCH_OFFLOAD_EXACT=1 (--exact): eager attention and deterministic kernels, so that runs that must be bit-identical
# (serial / overlapped / speculative) can be compared bit for bit on the GPU; slower, not for the timing table
EXACT = os.environ.get("BENCH_OFFLOAD_EXACT") == "1"
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CLIP = 1.0


def build_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                      num_key_value_heads=8, intermediate_size=args.hidden * 11 // 4, vocab_size=args.vocab,
                      tie_word_embeddings=False,
                      max_position_embeddings=max(2048, args.seq))
    cfg._attn_implementation = "eager" if EXACT else "sdpa"
    torch.manual_seed(1234)   # the same weights for every implementation (the device's generator)
    with torch.device(DEVICE):   # initialised on the GPU: seconds instead of minutes for 2.8 B on the host
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
    if "ratio" in name:   # *_ratio<NN>: offload_optimizer.ratio NN/100, else FSDPZERO_BENCH_RATIO
        tail = name.split("ratio", 1)[1].split("_")[0]
        zero["offload_optimizer"]["ratio"] = int(tail) / 100 if tail.isdigit() else RATIO
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
    import fsdpzero.host
    knobs = {}                                        # the typed knobs (fsdpzero/tuning.py); default: auto
    if "_spec" in name or "_nospec" in name or "_serial" in name:
        knobs["offload_speculate"] = "_spec" in name   # "_nospec" and serial rows: no speculation
    if threads_suffix(name):                                 # *_t<N>: offload_threads N
        knobs["offload_threads"] = threads_suffix(name)
    if "_st" in name and name.rsplit("_st", 1)[1].isdigit():   # *_st<N>: offload_speculate_threads N
        knobs["offload_speculate_threads"] = int(name.rsplit("_st", 1)[1])
    if "_serial" in name or "_overlap" in name:            # else fsdpzero's default (overlap)
        knobs["offload_overlap"] = "_overlap" in name
    if "_bind" in name:                                    # *_bind0: unpinned, cores / local ranks threads (the
        knobs["offload_bind"] = name.rsplit("_bind", 1)[1][:1] == "1"   # behaviour before placement); *_bind1: on
    engine = fsdpzero.wrap(build_model(args), ds_config(args, name), tuning=knobs)

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss
    step.grad_norm = engine.get_global_grad_norm   # clipping triggers when it is above CLIP
    spec = getattr(engine.grad_path, "spec", None)
    step.spec_stats = (lambda: dict(spec.stats)) if spec is not None else None
    step.overlap = bool(getattr(engine.grad_path, "overlap", False))
    placement = fsdpzero.host.applied()               # what the startup block's cpu line says (fsdpzero/host.py)
    step.placement = placement.describe() if placement is not None else None
    return step, engine.wait_for_params


def threads_suffix(name: str) -> int | None:
    """N of a config named *_t<N> (CPU threads per rank), else None."""
    tail = name.rsplit("_t", 1)[1] if "_t" in name else ""
    return int(tail) if tail.isdigit() else None


def omp_max_threads() -> int | None:
    """omp_get_max_threads() of the libgomp.so.1 loaded in this process (the one a JIT-built DeepSpeed op links), from
    this thread; None if none is loaded under that name."""
    import ctypes
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD).omp_get_max_threads()
    except OSError:
        return None


def ref_runner(args, name):
    """The two terms of the pipeline limit. ref_gpu_noopt: FSDP2 stage 2, bf16, forward + backward + the grad norm,
    no optimizer step. ref_cpu_adam: the fused CPU Adam over this rank's share of the model's parameters, in the
    offload path's chunks, bf16 grads in and bf16 params out, with the threads the offload path would use."""
    import torch
    if name == "ref_gpu_noopt":
        from fsdpzero.optim import FSDPGradPath
        model = shard(build_model(args), 2, cpu_offload=False)
        path = FSDPGradPath(model, torch.optim.SGD(model.parameters(), lr=0.0))

        def step(x):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            path.finish_gradients()
            step.norm = path.grad_norm()
            path.zero_grad()
            return loss
        step.grad_norm = lambda: step.norm
        return step, lambda: None
    import fsdpzero.host
    import fsdpzero.tuning
    from fsdpzero.offload.chunks import CHUNK
    from fsdpzero_ops import CPUAdamW
    with torch.device("meta"):
        total = sum(p.numel() for p in build_model_meta(args).parameters())
    world = int(os.environ["WORLD_SIZE"])
    n = -(-total // world)
    # the threads and cores the engine's CPU step gets: its placement (fsdpzero/host.py) from the settings wrap
    # builds (knobs offload_threads / offload_bind: defaults < FSDPZERO_* environment); collective
    placement = fsdpzero.host.place_cpu_step(fsdpzero.tuning.resolve())
    sizes = [min(CHUNK, n - i) for i in range(0, n, CHUNK)]
    pin = DEVICE == "cuda"
    masters = [torch.zeros(k) for k in sizes]
    grads = [torch.full((k,), 1e-3, dtype=torch.bfloat16, pin_memory=pin) for k in sizes]
    outs = [torch.empty(k, dtype=torch.bfloat16, pin_memory=pin) for k in sizes]
    opt = CPUAdamW(masters, **HYPER)

    def step(x):
        t0 = time.perf_counter()
        for m, g, o in zip(masters, grads, outs):
            opt.step_param(m, g, out=o)
        step.gparam_s = n / (time.perf_counter() - t0) / 1e9
        return torch.zeros(())
    step.params_per_rank = n
    step.placement = placement.describe()
    return step, lambda: None


def build_model_meta(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                      num_key_value_heads=8, intermediate_size=args.hidden * 11 // 4, vocab_size=args.vocab,
                      tie_word_embeddings=False, max_position_embeddings=max(2048, args.seq))
    return LlamaForCausalLM(cfg)


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
    if EXACT:
        torch.use_deterministic_algorithms(True, warn_only=True)
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // local_world))   # torchrun sets 1; every config gets the same share
    ds_threads = threads_suffix(args.config) if args.config.startswith("ds_") else None
    if ds_threads:   # DeepSpeed's CPU Adam is an OpenMP loop: its runtime's threads, whether it shares torch's
        os.environ["OMP_NUM_THREADS"] = str(ds_threads)   # (set_num_threads) or loads its own libgomp (reads this)
        torch.set_num_threads(ds_threads)
    if args.config.startswith("ds_") and args.config.endswith("_bind1"):   # DeepSpeed as `deepspeed
        from fsdpzero.host import bind_process, launcher_binding         # --bind_cores_to_rank` would run it
        placement = launcher_binding(local_rank, local_world)
        bind_process(placement.cores)
        torch.set_num_threads(placement.threads)
    if args.config.startswith("ds_"):
        from common import prepare_deepspeed_build
        prepare_deepspeed_build()
        import deepspeed
        if DEVICE == "cpu":   # DeepSpeed JIT-builds a shared-memory all-reduce for inference on CPU (~40 s); unused
            import importlib   # the module itself: `import deepspeed.comm.torch as m` binds the re-exported torch
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="nccl" if DEVICE == "cuda" else "gloo")
    elif args.config.startswith(("fsdp_", "ref_")):
        dist.init_process_group("cuda:nccl,cpu:gloo" if DEVICE == "cuda" else "gloo")
    timeline = None
    if os.environ.get("FSDPZERO_OFFLOAD_PROFILE") == "1" and args.config.startswith("ours_"):
        base = Path(args.json or f"out/offload/{args.config}.json")
        base.parent.mkdir(parents=True, exist_ok=True)
        # one file per rank: with N ranks on a host the slowest rank sets the step
        timeline = base.with_suffix(f".timeline.rank{rank}.jsonl")
        timeline.unlink(missing_ok=True)
        os.environ["FSDPZERO_OFFLOAD_PROFILE_FILE"] = str(base.with_suffix(".timeline.rank{rank}.jsonl"))
    t_setup = time.perf_counter()
    runner = {"ds": ds_runner, "fsdp": fsdp_runner, "ours": ours_runner, "ref": ref_runner}[args.config.split("_")[0]]
    step, finish = runner(args, args.config)
    setup_s = time.perf_counter() - t_setup
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + rank)
    x = torch.randint(0, args.vocab, (args.micro, args.seq), device=DEVICE, generator=gen)
    cuda = DEVICE == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses, norms, faults, pinned, cpu_s, preempted = [], [], [], [], [], [], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        if i == args.warmup:
            t_loop, remote0 = t0, numa_other_node_pages()
        ru0, pin0 = resource.getrusage(resource.RUSAGE_SELF), pinned_blocks()
        loss = step(x)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            ru = resource.getrusage(resource.RUSAGE_SELF)
            # pages first touched (or pinned blocks created) in a timed step: lazily grown host memory
            faults.append(ru.ru_minflt - ru0.ru_minflt)
            pinned.append(pinned_blocks() - pin0)
            # the process's CPU seconds (all threads; spinning OpenMP threads count) and the times one of its
            # threads was preempted: contention between the ranks sharing the host shows here
            cpu_s.append(round(ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime, 4))
            preempted.append(ru.ru_nivcsw - ru0.ru_nivcsw)
        losses.append(float(loss))
        norm = getattr(step, "grad_norm", lambda: None)()
        norms.append(None if norm is None else float(norm))
    finish()   # an overlapped CPU step ends after step() returns: count its tail in the mean
    sync()
    mean_incl_tail = (time.perf_counter() - t_loop) / args.steps
    remote = numa_other_node_pages() - remote0
    med = statistics.median(times)
    tokens = args.micro * args.seq
    result = {"config": args.config, "world": world, "threads": torch.get_num_threads(), "step_s": med, "step_s_mean_incl_tail": mean_incl_tail,
              "step_min": min(times), "step_max": max(times), "slowest_over_median": max(times) / med,
              "step_times": times, "minor_faults_per_step": faults, "pinned_blocks_created_per_step": pinned,
              "numa_other_node_pages_timed_host": remote,
              "cpus": format_cpulist(os.sched_getaffinity(0)), "tokens_per_s_per_gpu": tokens / med,
              "peak_alloc_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
              "peak_reserved_GiB": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
              "host_rss_GiB": psutil.Process().memory_info().rss / 2**30, "setup_s": setup_s,
              "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
              "grad_norms": norms}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"cpu_s_per_step": cpu_s, "preempted_per_step": preempted,
                                      "step_times": [round(t, 4) for t in times]})
    result["ranks"] = per_rank
    if getattr(step, "spec_stats", None) is not None:
        result["speculation"] = step.spec_stats()
    if hasattr(step, "overlap"):
        result["overlap"] = step.overlap
    if getattr(step, "placement", None):
        result["placement"] = step.placement
    if args.config.startswith("ds_"):
        result["omp_max_threads"] = omp_max_threads()
    if hasattr(step, "gparam_s"):
        result["cpu_adam_gparam_s"], result["params_per_rank"] = step.gparam_s, step.params_per_rank
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
    if timeline is not None:
        dist.barrier()   # every rank's records of the timed steps are written
    if timeline is not None and rank == 0 and timeline.exists():
        result["timeline_file"] = str(timeline)
        result["timeline_median"] = timeline_median(timeline, args.warmup)
        result["timeline_ranks"] = timeline_ranks(timeline, world, args.warmup)
    if rank == 0:
        print(json.dumps(result))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()


def numa_other_node_pages() -> int:
    """Pages the kernel placed on a node other than the allocating CPU's, host-wide (numastat other_node)."""
    total = 0
    for stat in Path("/sys/devices/system/node").glob("node*/numastat"):
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            total += int(value) if name == "other_node" else 0
    return total


def pinned_blocks() -> int:
    """Pinned host blocks the caching host allocator has created so far (0 without CUDA or the statistic)."""
    import torch
    try:
        return int(torch.cuda.host_memory_stats().get("allocations.allocated", 0)) if DEVICE == "cuda" else 0
    except (AttributeError, RuntimeError):
        return 0


def timeline_median(path: Path, warmup: int) -> dict:
    """Median over the timed steps of each scalar field of the timeline, plus per-chunk Adam/D2H/H2D medians."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["step"] >= warmup] or recs
    keys = dict.fromkeys(k for r in recs for k, v in r.items() if isinstance(v, (int, float)))
    med = {k: statistics.median(r[k] for r in recs if k in r) for k in keys}
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


RANK_KEYS = ("backward_end_host", "factor_sync_host", "cpu_done_host", "adam_host_total", "adam_gparam_s",
             "d2h_wait_host_total", "spec_adam_host", "spec_committed")


def timeline_ranks(rank0: Path, world: int, warmup: int) -> list[dict]:
    """Per rank, per timed step: the fields that show which rank's host work sets the step (its CPU Adam time and
    rate, its forward's waits on the host) and where its step started on the host's one clock."""
    out = []
    for r in range(world):
        path = rank0.with_name(rank0.name.replace(".rank0.", f".rank{r}."))
        if not path.exists():
            continue
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for rec in recs:
            if rec["step"] >= warmup:
                out.append({"rank": r, "step": rec["step"], "origin_host": rec.get("origin_host"),
                            "unit_wait_host": round(sum(rec.get("unit_wait_host", [])), 6),
                            **{k: rec[k] for k in RANK_KEYS if k in rec}})
    return out


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


# -- issue 24's suite: every config of a size, one torchrun each, within a time budget ------------------------------
TARGETS = {("2.8b", "z2"): 0.65, ("0.89b", "z2"): 0.23, ("0.89b", "z3"): 0.30}   # issue 24, s/step
SPEEDUP31 = {"z2": 1.6, "z3": 2.0}   # issue 31 item 4: x DeepSpeed, with every step <= 1.15x the median


def _torchrun(cmd: list[str], timeout: float, exact: bool = False) -> tuple[int, str]:
    """Run one config in its own session; on timeout the whole process group goes (torchrun's workers hold the
    GPU)."""
    import signal
    import subprocess
    env = dict(os.environ, **({"BENCH_OFFLOAD_EXACT": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if exact else {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, (out or "") + f"\n(killed after {timeout:.0f} s)"


def run_suite(ns) -> list[dict]:
    import sys
    start = time.monotonic()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in ns.sizes.split(","):
        shape = {"vocab": 32000, "seq": 2048, **SIZES[size], **({"seq": ns.seq} if ns.seq else {})}
        steps, warmup = (ns.steps, ns.warmup) if ns.steps else \
            (12, 3) if ns.suite == "issue31" else ((10, 3) if size != "2.8b" else (6, 2))   # issue 31: >= 12
        for name in (ns.configs.split(",") if ns.configs else SUITE[ns.suite][size]):
            left = ns.budget_s - (time.monotonic() - start)
            row = {"size": size, "config": name}
            if name.startswith("ds_") and importlib.util.find_spec("deepspeed") is None:
                rows.append({**row, "error": "deepspeed not importable"})
                continue
            if left < ns.min_left_s:
                rows.append({**row, "error": f"skipped: {left:.0f} s of the budget left"})
                continue
            js = out / f"{size}__{name}.json"
            js.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ns.nproc}",
                   __file__, "--config", name, "--json", str(js), f"--steps={steps}", f"--warmup={warmup}",
                   *[f"--{k}={v}" for k, v in shape.items()]]
            t0 = time.monotonic()
            rc, log = _torchrun(cmd, timeout=left, exact=ns.exact)
            row.update(exit_code=rc, wall_s=time.monotonic() - t0)
            if js.exists():
                row.update(json.loads(js.read_text()))
            else:
                row.update(error=f"rc={rc}", log_tail=log[-3000:])
            if rc != 0:   # a result with a bad exit (e.g. an abort at teardown) is kept, and flagged
                row["log_tail"] = log[-3000:]
            print(f"{size} {name}: rc={rc} " + (f"{row['step_s']:.3f} s/step" if "step_s" in row else row["error"]),
                  flush=True)
            rows.append(row)
    derive(rows)
    (out / ("offload24.json" if ns.suite == "issue24" else f"{ns.suite}.json")).write_text(json.dumps(rows, indent=2))
    print(json.dumps([{k: v for k, v in r.items() if k not in ("losses", "grad_norms", "log_tail",
                                                                 "timeline_median")} for r in rows]))
    print(suite_table(rows))
    return rows


def derive(rows: list[dict]) -> None:
    """Per row: DeepSpeed's time over ours, ours over the limit max(GPU step without optimizer, CPU Adam step), the
    target of issue 24, and the largest loss difference from the serial run of the same stage."""
    by = {(r["size"], r["config"]): r for r in rows if "step_s" in r}
    for r in rows:
        if "step_s" not in r or not r["config"].startswith("ours_"):
            continue
        size, stage = r["size"], "z3" if "z3" in r["config"] else "z2"
        twin = "ds_z3_offload_both" if stage == "z3" else "ds_z2_offload"
        n = threads_suffix(r["config"])   # ours_*_t<N>: DeepSpeed with the same N threads when that row ran
        ds = by.get((size, f"{twin}_t{n}")) or by.get((size, twin))
        if ds:
            r["vs_ds_config"] = ds["config"]
        if ds:
            r["speedup_vs_ds"] = ds["step_s"] / r["step_s"]
        gpu, cpu = by.get((size, "ref_gpu_noopt")), by.get((size, "ref_cpu_adam"))
        if gpu and cpu:
            r["limit_s"] = max(gpu["step_s"], cpu["step_s"])
            r["over_limit"] = r["step_s"] / r["limit_s"]
        if (size, stage) in TARGETS:
            r["target_s"] = TARGETS[(size, stage)]
        if ds:   # issue 31: the lead over DeepSpeed and the slowest step, per row
            r["issue31_met"] = bool(r["speedup_vs_ds"] >= SPEEDUP31[stage] and r["slowest_over_median"] <= 1.15)
        serial = by.get((size, f"ours_{stage}{'_both' if stage == 'z3' else ''}_serial"))
        if serial and serial is not r:
            r["max_loss_diff_vs_serial"] = max(abs(a - b) for a, b in zip(r["losses"], serial["losses"]))


def suite_table(rows: list[dict]) -> str:
    lines = ["| size | config | s/step median (min-max) | slowest / median | vs DeepSpeed | / limit | target | "
             "max loss diff vs serial | peak alloc GiB | host RSS GiB | timed steps: max page faults, new pinned "
             "blocks, other-node pages (host) | CPU threads, placement | loss first -> last | exit |", "|---" * 14 + "|"]

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"
    for r in rows:
        if "step_s" not in r:
            lines.append(f"| {r['size']} | {r['config']} | {r.get('error', '')} | | | | | | | | | | | "
                         f"{r.get('exit_code', '-')} |")
            continue
        extra = f" ({r['cpu_adam_gparam_s']:.2f} Gparam/s)" if "cpu_adam_gparam_s" in r else ""
        where = r.get("placement") or f"cpus {r.get('cpus', '?')}"
        lines.append(f"| {r['size']} | {r['config']} | {r['step_s']:.3f} ({r['step_min']:.3f}-{r['step_max']:.3f})"
                     f"{extra} | {f(r.get('slowest_over_median'), '.2f')} | {f(r.get('speedup_vs_ds'), '.2f')}x | "
                     f"{f(r.get('over_limit'), '.2f')} | "
                     f"{f(r.get('target_s'), '.2f')} | {f(r.get('max_loss_diff_vs_serial'), '.2e')} | "
                     f"{r['peak_alloc_GiB_max_over_ranks']:.2f} | {r['host_rss_GiB']:.2f} | "
                     f"{max(r.get('minor_faults_per_step') or [0]):,}, {sum(r.get('pinned_blocks_created_per_step') or [0])}, "
                     f"{r.get('numa_other_node_pages_timed_host', '-')} | "
                     f"{r.get('threads')}, {where} | "
                     f"{r['loss_first']:.4f} -> {r['loss_last']:.4f} | {r['exit_code']} |")
    return "\n".join(lines)


def suite_args(argv: list[str]):
    import argparse
    ap = argparse.ArgumentParser(add_help=False, usage="%(prog)s --suite {issue24,issue31} [suite options]")
    ap.add_argument("--suite", choices=sorted(SUITE))
    ap.add_argument("--sizes", default="0.89b,2.8b", help=f"comma-separated, of {sorted(SIZES)}")
    ap.add_argument("--configs", default=None, help="default: the suite's configs")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--out", default="out/offload24")
    ap.add_argument("--budget-s", type=float, default=560, help="stop starting configs after this many seconds")
    ap.add_argument("--min-left-s", type=float, default=45, help="do not start a config with less time left")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default 10; 6 for 2.8b)")
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default 2048)")
    ap.add_argument("--exact", action="store_true", help="BENCH_OFFLOAD_EXACT=1: deterministic kernels, to compare "
                    "the serial, overlapped and speculative runs' losses bit for bit (not for timings)")
    if {"-h", "--help"} & set(argv):   # the suite's options, then the per-config command line's help
        print(ap.format_help().replace("options:", "suite options:"))
    return ap.parse_known_args(argv)[0]


if __name__ == "__main__":
    import importlib.util
    import sys
    suite = suite_args(sys.argv[1:])
    if suite.suite:
        run_suite(suite)
    else:
        config_main(__doc__, CONFIGS, run_one, run_all, out="out/offload", timeout=400)
