"""Compiled training on one GPU (issue 24 items 2 and 3): DeepSpeed compiled (`engine.compile()`), fsdpzero eager and
compiled (the config's `compile` section: torch.compile per block inside FSDP2's hooks), hand-written FSDP2 eager and
compiled (torchtitan's order: `torch.compile(block)` before `fully_shard`), at ZeRO stage 2 and 3, plus fsdpzero
compiled with CPU optimizer offload (and fsdpzero eager with it, its same-call baseline). The 0.89 B Llama of shared/spec/device_anchors.md (seq 2048, micro 4, bf16
compute, fp32 masters, AdamW, clipping 1.0), 3 warm-up + 10 timed steps, median; each row is its own torchrun.

    python bench/compile.py --stages 2 --out out/compile     # one stage per call keeps a call under 10 minutes
    python bench/compile.py --stages 3 --out out/compile     # then: python bench/compile.py --summarize out/compile

Per row: step_s, compile_s (dynamo + backend time, from torch._dynamo's timers; the inductor cache is warm for a
graph an earlier row compiled: --cold-compile turns the caches off), graph_breaks (dynamo's counter), GPU peak memory,
the loss curve, and `overhead`: one extra step under torch.profiler with the forward/backward and the optimizer part
marked (host ms of each, kernels launched and host syncs in the optimizer part, .item() calls in the step), so the
engine's per-step cost beyond a hand-written loop shows (issue 24 item 3). `plain_matched` is the hand-written loop
with fsdpzero's FSDP2 settings for the same ds_config (gradients reduced in bf16, DeepSpeed's communication dtype;
the root not resharded after forward): fsdpzero_eager minus plain_matched is the engine loop's own cost;
plain_matched_compiled likewise for the compiled rows, and plain_bf16reduce_compiled (not by default) has only the
reduce dtype of the two. fsdpzero compiled also compiles HF's loss function (as torchtitan compiles its loss);
plain_matched_compiled_loss (not by default) is the hand-written loop that does the same. fsdpzero_titan_compiled (not by default): the user wraps each
block in torch.compile before initialize, as torchtitan, and the engine runs eager (where fsdpzero's compile sits).
FSDPZERO_BENCH_CPU=1: gloo/CPU, tiny preset, fp32 and backend aot_eager (the script's correctness only).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "ops"))   # fsdpzero_ops, from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its import time is the launch clock)
import torch  # noqa: E402

IMPLS = ["plain_eager", "plain_matched", "plain_compiled", "plain_matched_compiled", "plain_bf16reduce_compiled",
         "fsdpzero_eager",
         "fsdpzero_compiled", "fsdpzero_titan_compiled", "deepspeed_compiled", "fsdpzero_compiled_offload",
         "fsdpzero_eager_offload", "deepspeed_eager", "plain_matched_compiled_loss"]
DEFAULT_IMPLS = [i for i in IMPLS if i not in ("fsdpzero_titan_compiled", "deepspeed_eager",
                                               "plain_bf16reduce_compiled", "plain_matched_compiled_loss")]
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


# ---------------------------------------------------------------- worker (one implementation, under torchrun)
def plain_setup(model, stage: int, device, *, compiled: bool, matched: bool, backend: str, bf16_reduce=None):
    """The hand-written loop of bench/vs_deepspeed.py (fully_shard per layer then root, fused AdamW,
    clip_grad_norm_), compiled as torchtitan does: torch.compile(block) before fully_shard. matched: fsdpzero's
    FSDP2 settings for the same ds_config instead (reduce in the compute dtype, the root kept after forward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    bf16 = not common.CPU
    bf16_reduce = matched if bf16_reduce is None else bf16_reduce
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None if bf16_reduce else torch.float32)
          if bf16 else MixedPrecisionPolicy())
    layers = model.model.layers
    for i in range(len(layers)):
        if compiled:
            layers[i] = torch.compile(layers[i], backend=backend)
        fully_shard(layers[i], mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp)
    root_raf = (None if stage == 3 else False) if matched else stage == 3
    fully_shard(model, mesh=mesh, reshard_after_forward=root_raf, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                            weight_decay=common.WD, fused=True)

    def fwd_bwd(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        return loss.detach()

    def opt_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return fwd_bwd, opt_step


def engine_setup(engine):
    """DeepSpeed's loop: engine(x), engine.backward, engine.step (the optimizer part)."""
    def fwd_bwd(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        return loss.detach()
    return fwd_bwd, engine.step


def make_step(fwd_bwd, opt_step, batches):
    def step():
        with torch.profiler.record_function("bench.fwd_bwd"):
            loss = fwd_bwd(batches[0])
        with torch.profiler.record_function("bench.optimizer"):
            opt_step()
        return loss
    return step


def overhead(step, device) -> dict:
    """One step under torch.profiler: host ms of the forward/backward and of the optimizer part, kernels launched and
    host syncs in the optimizer part, .item() calls and host syncs in the whole step; on a GPU also the step's wall
    ms and the ms the GPU was busy (the union of kernel intervals): the difference is where the GPU waited."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    events = list(prof.events())
    host = [e for e in events if e.device_type == DeviceType.CPU]
    regions = {e.name: e for e in host if e.name in ("bench.fwd_bwd", "bench.optimizer")}

    def inside(e, region):
        r = regions.get(region)
        return r is not None and r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end

    opt = [e for e in host if inside(e, "bench.optimizer")]
    ms = lambda name: regions[name].time_range.elapsed_us() / 1e3 if name in regions else None  # noqa: E731
    out = {"fwd_bwd_host_ms": ms("bench.fwd_bwd"), "optimizer_host_ms": ms("bench.optimizer"),
           "optimizer_syncs": sum(e.name in SYNC_CALLS for e in opt),
           "step_syncs": sum(e.name in SYNC_CALLS for e in host),
           "step_item_calls": sum(e.name == "aten::_local_scalar_dense" for e in host)}
    if cuda:
        out["optimizer_kernels"] = sum(e.name in LAUNCHES for e in opt)
        spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
        busy, end = 0.0, float("-inf")
        for a, b in spans:
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        out["step_wall_ms"], out["gpu_busy_ms"] = wall_ms, busy / 1e3
    else:   # no kernel launches on a CPU: count the aten ops the optimizer part dispatches
        out["optimizer_aten_ops"] = sum(e.name.startswith("aten::") for e in opt)
    return out


def worker(args) -> None:
    import torch.distributed as dist
    from fsdpzero.compile import CompileWatch
    impl, stage = args.impl, args.stage
    p = common.PRESETS[args.preset]
    backend = args.backend or ("aot_eager" if common.CPU else "inductor")
    compiled = "compiled" in impl
    e = {"stage": stage, "dtype": "fp32" if common.CPU else "bf16", "ga": 1,
         "offload": "opt" if impl.endswith("_offload") else "none"}
    cfg = common.ds_config(e, p)
    if impl.startswith("fsdpzero") and compiled:
        cfg["compile"] = {"enabled": True, "backend": backend}
    device, rank, world = common.init_worker(deepspeed=impl.startswith("deepspeed"))
    batches = common.fixed_batches(p, rank, 1, device)
    model = common.build_model(p, device)
    # every implementation trains without HF's KV cache: it is indexed per layer, and a compiled block would
    # recompile for each layer (past torch's limit of 8 the rest run eager); fsdpzero turns it off itself too
    model.config.use_cache = False
    n = common.n_params(model)
    watch = CompileWatch(0, backend, {})
    engine = None
    if impl.startswith("plain"):
        if impl.endswith("_loss"):   # torchtitan compiles its loss as well; fsdpzero compiles HF's loss function
            model.loss_function = torch.compile(model.loss_function, backend=backend)
        fwd_bwd, opt_step = plain_setup(model, stage, device, compiled=compiled,
                                        matched=impl.startswith("plain_matched"), backend=backend,
                                        bf16_reduce=True if "bf16reduce" in impl else None)
    elif impl.startswith("deepspeed"):
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        if compiled:
            engine.compile(backend=backend)
        fwd_bwd, opt_step = engine_setup(engine)
    elif impl == "fsdpzero_titan_compiled":   # the user compiles each block first, as torchtitan; engine eager
        import fsdpzero
        from torch._dynamo.eval_frame import OptimizedModule
        for i in range(len(model.model.layers)):
            model.model.layers[i] = torch.compile(model.model.layers[i], backend=backend)
        engine, *_ = fsdpzero.initialize(model=model, config=cfg,
                                         block_predicate=lambda m: isinstance(m, OptimizedModule))
        fwd_bwd, opt_step = engine_setup(engine)
    else:
        import fsdpzero
        engine, *_ = fsdpzero.initialize(model=model, config=cfg)
        fwd_bwd, opt_step = engine_setup(engine)
    step = make_step(fwd_bwd, opt_step, batches)
    timing = common.timed_loop(step, args.warmup, args.steps, device)
    report = watch.report()
    prof = overhead(step, device)
    if rank == 0:
        r = common.row(timing, n, p["micro"] * p["seq"], config=f"z{stage}", impl=impl, stage=stage,
                       dtype=e["dtype"], offload=e["offload"], backend=backend if compiled else None,
                       world_size=world, preset=args.preset, compile_s=report["compile_s"] if compiled else None,
                       graph_breaks=report["graph_breaks"] if compiled else None,
                       graph_break_reasons=report["graph_break_reasons"] if compiled else None,
                       graphs=report["graphs"] if compiled else None, overhead=prof,
                       fsdpzero_compile_report=getattr(engine, "compile_report", None),
                       device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       torch=torch.__version__)
        Path(args.json).write_text(json.dumps(r, indent=1, default=str))
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver and summaries
def launch(impl: str, stage: int, args, out: Path, rep: int = 0) -> dict | None:
    path = out / f"z{stage}__{impl}__r{rep}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", "--impl", impl, "--stage", str(stage), "--json", str(path), "--preset", args.preset,
           "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--backend", args.backend]
                                                                         if args.backend else [])
    env = common.worker_env(**({"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"} if args.cold_compile else {}))
    print(f"--- z{stage} {impl}", flush=True)
    t0 = time.perf_counter()
    text, rc = common.run_launcher(cmd, env, args.run_timeout)
    if rc != 0 or not path.exists():
        (out / f"z{stage}__{impl}__r{rep}.log").write_text(text)
        print(f"    failed (rc {rc}); log kept: {text.strip().splitlines()[-3:]}", flush=True)
        return None
    r = json.loads(path.read_text())
    print(f"    {r['step_s']:.4f} s/step, {time.perf_counter() - t0:.0f} s wall", flush=True)
    return r


def table(rows: list[dict]) -> str:
    lines = []
    for stage in sorted({r["stage"] for r in rows}):
        by = {r["impl"]: r for r in rows if r["stage"] == stage}
        ref_c, ref_e = by.get("plain_compiled"), by.get("plain_eager")
        lines += [f"\n### ZeRO stage {stage} ({next(iter(by.values()))['device']})\n",
                  "| impl | step s | vs plain compiled | vs plain eager | compile s | graphs | graph breaks | "
                  "peak alloc GiB | max loss diff vs plain (same mode) |", "|---|---|---|---|---|---|---|---|---|"]
        for impl in IMPLS:
            r = by.get(impl)
            if r is None:
                continue
            ref = ref_c if "compiled" in impl else ref_e

            def ratio(b):
                return f"{r['step_s'] / b['step_s']:.3f}" if b else "-"

            diff = (f"{max(abs(a - b) for a, b in zip(r['losses'], ref['losses'])):.2e}"
                    if ref and ref is not r else "-")
            fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
            each = r.get("step_s_runs", [])
            runs = " (" + "/".join(f"{t:.4f}" for t in each) + ")" if len(each) > 1 else ""
            lines.append(f"| {impl} | {r['step_s']:.4f}{runs} | {ratio(ref_c)} | {ratio(ref_e)} | "
                         f"{fmt(r.get('compile_s'), '{:.1f}')} | {fmt(r.get('graphs'), '{}')} | "
                         f"{fmt(r.get('graph_breaks'), '{}')} | {r['peak_alloc_gib']:.2f} | {diff} |")
        keys = sorted({k for r in by.values() for k in r.get("overhead", {})})
        lines += ["", "per-step overhead (one profiled step): " + ", ".join(keys), "",
                  "| impl | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for impl in IMPLS:
            o = by.get(impl, {}).get("overhead")
            if o:
                lines.append(f"| {impl} | " + " | ".join("-" if o.get(k) is None else
                                                          (f"{o[k]:.2f}" if isinstance(o[k], float) else str(o[k]))
                                                          for k in keys) + " |")
    return "\n".join(lines)


def merge_repeats(runs: list[dict]) -> list[dict]:
    """One row per (stage, impl): the first run's row with step_s the median over the repeats (step_s_runs lists
    them): consecutive processes on one GPU differed by up to 8 % here, so rows are interleaved and repeated."""
    import statistics
    by: dict[tuple, list[dict]] = {}
    for r in runs:
        by.setdefault((r["stage"], r["impl"]), []).append(r)
    return [{**group[0], "step_s": statistics.median(g["step_s"] for g in group),
             "step_s_runs": [g["step_s"] for g in group]} for group in by.values()]


def summarize(out: Path) -> str:
    rows = merge_repeats([json.loads(f.read_text()) for f in sorted(out.glob("z*__*__r*.json"))])
    md = table(rows)
    (out / "summary.md").write_text(md + "\n")
    (out / "compile.json").write_text(json.dumps(rows, indent=1))
    print(md)
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[0, 2, 3])
    ap.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, choices=IMPLS)
    ap.add_argument("--out", default="out/compile")
    ap.add_argument("--summarize", metavar="DIR")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny" if common.CPU else "0.9b")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default: inductor; aot_eager on CPU)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cold-compile", action="store_true", help="disable inductor's caches (compile_s from cold)")
    ap.add_argument("--run-timeout", type=int, default=600)
    ap.add_argument("--budget-s", type=float, default=None, help="skip the remaining rows past this many seconds")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole list this many times, interleaved; a row's "
                    "step_s is the median over them")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.summarize:
        summarize(Path(args.summarize))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    has_ds = importlib.util.find_spec("deepspeed") is not None
    t0 = time.perf_counter()
    for rep, stage, impl in ((r, s, i) for r in range(args.repeat) for s in args.stages for i in args.impls):
        if impl.startswith("deepspeed") and not has_ds:
            continue
        if impl.endswith("_offload") and stage == 3:
            continue      # compiled + CPU optimizer offload: measured at stage 2 (issue 24's offload rows)
        if args.budget_s and time.perf_counter() - t0 > args.budget_s:
            print(f"--- z{stage} {impl}: skipped (past --budget-s {args.budget_s:.0f})", flush=True)
            continue
        launch(impl, stage, args, out, rep)
    summarize(out)


if __name__ == "__main__":
    main()
