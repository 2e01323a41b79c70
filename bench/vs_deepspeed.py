"""fsdpzero vs DeepSpeed vs hand-written FSDP2 over a matrix of ds_config entries (one torchrun per run).

    python bench/vs_deepspeed.py --matrix core --nproc 2 --out out/vs_ds          # run + table + plots
    python bench/vs_deepspeed.py --scaling 1 2 4 --out out/scaling                 # weak scaling, stages 2/3
    python bench/vs_deepspeed.py --summarize out/vs_ds                            # table + plots from JSON
    python bench/vs_deepspeed.py --matrix nvme --nvme-path /tmp/nv --preset 0.25b  # ZeRO-Infinity: opt + params
                                                                                  # on NVMe, state vs host RSS
Issue 31 item 6, the 4-GPU matrix (0.89 B, 3 warm-up + 12 timed steps: item 4 asks medians of >= 12; 15 runs):
    PYTHONPATH=$PWD/.dsdist NCCL_NVLS_ENABLE=0 python bench/vs_deepspeed.py --matrix issue31 --nproc 4 \
        --out out/vs31 --budget-s 470 --run-timeout 240
  On 4x H200 (S16, 10 timed steps then) the first 11 runs (stages 1-3, compiled) took 432 s, the first DeepSpeed
  run and the compiled ones the longest (launch to first step: DeepSpeed 49-60 s, JIT-building FusedAdam or
  compiling); the budget left the four offload runs out; they ran in a second call, inside its 260 s budget:
    ... --only z2_bf16_ga1_off-opt z3_bf16_ga1_off-both --impls fsdpzero deepspeed --budget-s 260 --run-timeout 150
  --budget-s bounds the call: no run starts with less than
  --min-left-s (60) of it left and each run is stopped at its end (SIGTERM, SIGKILL 60 s later), so the call ends
  within budget + 60 s; the runs not started are listed under the table: run them with --only NAME ... into the same
  --out in a second call (its summary.md covers both calls' rows).
  rows: z1/z2/z3 bf16 (z1: no plain FSDP2 twin), z2 compiled (fsdpzero and DeepSpeed: the same config and
  `engine.compile()`, DeepSpeed's API; plain FSDP2: torch.compile per block before fully_shard, as torchtitan),
  z2 + CPU optimizer offload, z3 + CPU optimizer and parameter offload (fsdpzero and DeepSpeed). summary.md starts
  with one line per row (DeepSpeed / fsdpzero / plain FSDP2 step s, DeepSpeed's over ours, slowest step over the
  median, first loss), then each row's full metrics.
    --only z2_fp16_ga1 z3_bf16_ga4 ... picks matrix entries (to split a matrix over GPU pairs of one host)
DeepSpeed's NVMe entries need its async_io op: without libaio-dev, first eval "$(sh bench/libaio_shim/build.sh DIR)".
FSDPZERO_BENCH_CPU=1 uses gloo/CPU, the tiny preset and fp32 (DeepSpeed with DS_ACCELERATOR=cpu).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "ops"))   # fsdpzero_ops, from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its import time is the launch clock)
import torch  # noqa: E402

IMPLS = ["fsdpzero", "deepspeed", "plain_fsdp2"]


def entry(stage, dtype="bf16", ga=1, offload="none", hpz=0, impls=tuple(IMPLS), compiled=False):
    name = (f"z{stage}_{dtype}_ga{ga}" + (f"_off-{offload}" if offload != "none" else "")
            + (f"_hpz{hpz}" if hpz else "") + ("_compiled" if compiled else ""))
    return dict(name=name, stage=stage, dtype=dtype, ga=ga, offload=offload, hpz=hpz, impls=list(impls),
                compiled=compiled)


def matrix(kind: str, nvme_path: str | None, nproc: int) -> list[dict]:
    if kind == "smoke":
        return [entry(2, impls=("fsdpzero", "plain_fsdp2", "deepspeed"))]
    if kind == "issue31":   # issue 31 item 6's table, in its order
        return [entry(1, impls=("fsdpzero", "deepspeed")), entry(2), entry(3), entry(2, compiled=True),
                entry(2, offload="opt", impls=("fsdpzero", "deepspeed")),
                entry(3, offload="both", impls=("fsdpzero", "deepspeed"))]
    if kind == "nvme":
        if not nvme_path:
            raise SystemExit("--matrix nvme needs --nvme-path DIR (a directory on the disk to swap to)")
        return [dict(entry(3, offload=o, impls=("fsdpzero", "deepspeed")), nvme_path=nvme_path)
                for o in ("optnvme", "nvme")]       # optimizer states on NVMe; and the parameters too
    core = [entry(s) for s in (1, 2, 3)] + [entry(2, offload="opt", impls=("fsdpzero", "deepspeed"))]
    if kind == "core":
        return core
    full = [entry(s, d, ga) for s in (0, 1, 2, 3) for d in ("bf16", "fp16") for ga in (1, 4)]
    full += [entry(2, offload="opt", impls=("fsdpzero", "deepspeed")),
             entry(3, offload="both", impls=("fsdpzero", "deepspeed", "plain_fsdp2"))]
    if nproc >= 2:
        full.append(entry(3, hpz=max(1, nproc // 2), impls=("fsdpzero", "deepspeed")))
    if nvme_path:   # ZeRO-Infinity rows
        full += matrix("nvme", nvme_path, nproc)
    return full


# ---------------------------------------------------------------- worker (one implementation, under torchrun)
def plain_step(model, e, p, device, batches):
    """What a user writes by hand: fully_shard per layer then root, fused AdamW, clip_grad_norm_, no_sync for GA."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    if e["stage"] == 0 or e["dtype"] == "fp16" or e["hpz"] or e["offload"] in ("opt", "nvme", "optnvme"):
        raise SystemExit(f"plain_fsdp2 has no equivalent of {e['name']}")   # driver skips such entries
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if e["dtype"] == "bf16"
          else MixedPrecisionPolicy())
    off = CPUOffloadPolicy(pin_memory=device.type == "cuda") if e["offload"] == "both" else OffloadPolicy()
    layers = model.model.layers
    for i in range(len(layers)):
        if e.get("compiled"):   # torchtitan's order: compile the block, then shard it
            layers[i] = torch.compile(layers[i], backend=common.COMPILE_BACKEND)
        fully_shard(layers[i], mesh=mesh, reshard_after_forward=e["stage"] == 3, mp_policy=mp, offload_policy=off)
    fully_shard(model, mesh=mesh, reshard_after_forward=e["stage"] == 3, mp_policy=mp, offload_policy=off)
    opt = torch.optim.AdamW(model.parameters(), lr=common.LR, betas=common.BETAS, eps=common.EPS,
                            weight_decay=common.WD, fused=device.type == "cuda" and e["offload"] == "none")

    def step():
        total = 0.0
        for i, x in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            loss = model(input_ids=x, labels=x).loss / len(batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total
    return step


def worker(args) -> None:
    import torch.distributed as dist
    e = json.loads(args.entry)
    p = common.PRESETS[args.preset]
    if common.CPU:
        e["dtype"] = "fp32"   # CPU: fp32 so that fsdpzero and plain FSDP2 losses can be compared
    cfg = common.ds_config(e, p)
    if e["offload"] != "none" and args.impl == "deepspeed" and not common.CPU:
        # torchrun leaves OMP_NUM_THREADS=1, and DeepSpeed's CPU Adam (an OpenMP loop on torch's libgomp, run on the
        # main thread) stepped on one core (S15: 1.45 s a step). It gets the host's CPUs / local ranks, what `deepspeed
        # --bind_cores_to_rank` gives each rank (its launcher sets nothing without the flag, and every rank then
        # takes torch's default of all cores). set_num_threads is what counts (libgomp is loaded, the variable read,
        # with torch); the variable is for a runtime loaded later. fsdpzero places its own CPU step (fsdpzero/host.py)
        share = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)
    device, rank, world = common.init_worker(deepspeed=args.impl == "deepspeed")
    batches = common.fixed_batches(p, rank, e["ga"], device)
    model = common.build_model(p, device)
    n = common.n_params(model)
    watch = None
    if e.get("compiled"):
        from fsdpzero.compile import CompileWatch   # dynamo's counters: compile time and graph breaks, any impl
        # HF's KV cache is indexed per layer: a compiled block would recompile per layer (bench/compile.py)
        model.config.use_cache = False
        watch = CompileWatch(0, common.COMPILE_BACKEND, {})
    if args.impl == "plain_fsdp2":
        step = plain_step(model, e, p, device, batches)
    else:
        if args.impl == "deepspeed":
            import deepspeed
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        else:
            import fsdpzero
            engine, *_ = fsdpzero.initialize(model=model, config=cfg)
        if e.get("compiled"):   # the same user code for both: DeepSpeed's API, after initialize
            engine.compile(backend=common.COMPILE_BACKEND)
        step = common.engine_step(engine, batches)
    timing = common.timed_loop(step, args.warmup, args.steps, device)
    compiled = watch.report() if watch else {}
    if rank == 0:
        r = common.row(timing, n, p["micro"] * p["seq"] * e["ga"], config=e["name"], impl=args.impl,
                       stage=e["stage"], dtype=e["dtype"], ga=e["ga"], offload=e["offload"], hpz=e["hpz"],
                       world_size=world, preset=args.preset,
                       # fp32 master + two Adam moments per parameter, this rank's share: what NVMe offload keeps
                       # off the host; compare with host_rss_gib (peak resident set of rank 0)
                       opt_state_gib_per_rank=12 * n / world / 2**30, cpu_threads=torch.get_num_threads(),
                       compiled=bool(e.get("compiled")),
                       compile_s=compiled.get("compile_s"), graph_breaks=compiled.get("graph_breaks"),
                       graphs=compiled.get("graphs"),
                       device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
        Path(args.json).write_text(json.dumps(r, indent=1))
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver (one torchrun per run) and summaries
def launch(e, impl, nproc, args, out: Path, timeout: float) -> dict | None:
    path = out / f"{e['name']}__{impl}__n{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           __file__, "--worker", "--impl", impl, "--entry", json.dumps(e), "--json", str(path),
           "--preset", args.preset, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    print(f"--- {e['name']} {impl} n={nproc}", flush=True)
    log = out / f"{e['name']}__{impl}__n{nproc}.log"
    path.unlink(missing_ok=True)   # an earlier call's row in the same --out is not this run's
    log.unlink(missing_ok=True)
    text, rc = common.run_launcher(cmd, common.worker_env(), timeout)
    if rc != 0 or not path.exists():
        log.write_text(text)
        print(f"    failed (rc {rc}); log kept: {text.strip().splitlines()[-1:]}")
        return None
    return json.loads(path.read_text())


def load_rows(out: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob("*__*__n*.json"))]


def overview(rows: list[dict]) -> str:
    """One line per (config, ranks), as issue 31's table: the three implementations' median step, DeepSpeed's over
    ours, each one's slowest timed step over its median, the first loss of each (the same data and init)."""
    by: dict[tuple, dict] = {}
    for r in rows:
        by.setdefault((r["config"], r["world_size"]), {})[r["impl"]] = r
    lines = ["| config | ranks | DeepSpeed s | fsdpzero s | DeepSpeed / fsdpzero | plain FSDP2 s | "
             "slowest / median (DS, ours, plain) | compile s (DS, ours, plain) | first loss (DS, ours, plain) |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = ("deepspeed", "fsdpzero", "plain_fsdp2")
    for (cfg, world), impls in sorted(by.items()):
        d, o, pl = (impls.get(i) for i in order)

        def each(fmt, get):
            return " / ".join(fmt.format(get(impls[i])) if i in impls and get(impls[i]) is not None else "-"
                              for i in order)
        step = lambda r: f"{r['step_s']:.4f}" if r else "-"  # noqa: E731
        lines.append(f"| {cfg} | {world} | {step(d)} | {step(o)} | "
                     + (f"{d['step_s'] / o['step_s']:.2f}x" if d and o else "-") + f" | {step(pl)} | "
                     + each("{:.2f}", lambda r: r["max_s"] / r["step_s"]) + " | "
                     + each("{:.1f}", lambda r: r.get("compile_s")) + " | "
                     + each("{:.4f}", lambda r: r["losses"][0]) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["config"], r["world_size"]), {})[r["impl"]] = r
    fields = [("step_s", "step s", "{:.4f}"), ("tokens_per_s_per_gpu", "tok/s/GPU", "{:.0f}"),
              ("tflops_per_gpu", "TFLOP/s/GPU", "{:.1f}"), ("peak_alloc_gib", "peak alloc GiB", "{:.2f}"),
              ("peak_reserved_gib", "peak resv GiB", "{:.2f}"), ("host_rss_gib", "host RSS GiB", "{:.2f}"),
              ("opt_state_gib_per_rank", "opt state GiB/rank", "{:.2f}"),
              ("launch_to_first_step_s", "launch->step0 s", "{:.1f}")]
    lines = []
    for (cfg, world), impls in sorted(by.items()):
        lines += [f"\n### {cfg} ({world} ranks)\n", "| metric | fsdpzero | DeepSpeed | ours/DS | plain FSDP2 |",
                  "|---|---|---|---|---|"]
        o, d, pl = impls.get("fsdpzero"), impls.get("deepspeed"), impls.get("plain_fsdp2")
        for key, label, fmt in fields:
            cell = lambda r: fmt.format(r[key]) if r and r.get(key) is not None else "-"  # noqa: E731
            ratio = f"{o[key] / d[key]:.2f}" if o and d and d.get(key) else "-"
            lines.append(f"| {label} | {cell(o)} | {cell(d)} | {ratio} | {cell(pl)} |")
        if o and pl:
            diff = max(abs(a - b) for a, b in zip(o["losses"], pl["losses"]))
            lines.append(f"| max loss diff ours vs plain | {diff:.2e} | | | |")
    return "\n".join(lines)


def scaling_table(rows: list[dict]) -> str:
    """Weak scaling (fixed tokens per GPU): tokens/s/GPU at N over N=1, for the configs that have an N=1 run."""
    lines = ["| config | impl | N | step s | tok/s/GPU | efficiency vs N=1 |", "|---|---|---|---|---|---|"]
    base = {(r["config"], r["impl"]): r["tokens_per_s_per_gpu"] for r in rows if r["world_size"] == 1}
    for r in sorted(rows, key=lambda r: (r["config"], r["impl"], r["world_size"])):
        b = base.get((r["config"], r["impl"]))
        if b:
            lines.append(f"| {r['config']} | {r['impl']} | {r['world_size']} | {r['step_s']:.4f} | "
                         f"{r['tokens_per_s_per_gpu']:.0f} | {r['tokens_per_s_per_gpu'] / b:.2f} |")
    return "\n".join(lines)


def plots(rows: list[dict], out: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib not importable: plots skipped")
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(r["config"], r["world_size"]) for r in rows})
    labels = [f"{c} x{w}" for c, w in keys]
    impls = ("fsdpzero", "deepspeed", "plain_fsdp2")
    for key, label in (("tokens_per_s_per_gpu", "tokens/s/GPU"), ("peak_alloc_gib", "peak alloc GiB")):
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(keys)), 4))
        for k, impl in enumerate(impls):
            vals = [next((r[key] for r in rows if (r["config"], r["world_size"]) == ck and r["impl"] == impl), 0)
                    for ck in keys]
            ax.bar([i + 0.28 * k for i in range(len(keys))], vals, width=0.28, label=impl)
        ax.set_xticks([i + 0.28 for i in range(len(keys))], labels, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend(ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, frameon=False)
        fig.tight_layout()
        fig.savefig(out / f"{key}.png", dpi=120)
        plt.close(fig)


def summarize(out: Path) -> None:
    rows = load_rows(out)
    md = overview(rows) + "\n" + table(rows)
    skipped = sorted(f.name[:-len(".skipped")] for f in out.glob("*.skipped"))
    if skipped:
        md += "\n\nnot run (--budget-s spent): " + ", ".join(skipped)
    failed = sorted(f.name[:-len(".log")] for f in out.glob("*__*__n*.log"))
    if failed:
        md += "\n\nfailed (log kept as NAME.log): " + ", ".join(failed)
    if len({r["world_size"] for r in rows}) > 1:
        md += "\n\n### weak scaling\n\n" + scaling_table(rows)
    (out / "summary.md").write_text(md + "\n")
    print(md)
    plots(rows, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--matrix", choices=["smoke", "core", "full", "nvme", "issue31"])
    ap.add_argument("--scaling", type=int, nargs="+")
    ap.add_argument("--summarize", metavar="DIR")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default="out/vs_ds")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these matrix entries (e.g. z2_fp16_ga1)")
    ap.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny" if common.CPU else "0.9b")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 12 for --matrix issue31, else 10)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--budget-s", type=float, default=None, help="the runs' time in all: a run starts only with "
                    "--min-left-s of it left and is stopped at its end; the rest are listed as not run")
    ap.add_argument("--min-left-s", type=float, default=60)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--entry", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.summarize:
        return summarize(Path(args.summarize))
    if args.steps is None:
        args.steps = 12 if args.matrix == "issue31" else 10
    if not (args.matrix or args.scaling):
        ap.error("give --matrix {smoke,core,full,nvme,issue31}, --scaling N [N ...] or --summarize DIR")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    has_ds = importlib.util.find_spec("deepspeed") is not None
    runs = ([(e, n) for n in args.scaling for e in (entry(2), entry(3))] if args.scaling
            else [(e, args.nproc) for e in matrix(args.matrix, args.nvme_path, args.nproc)])
    runs = [(e, n) for e, n in runs if not args.only or e["name"] in args.only]
    t0 = time.perf_counter()
    for e, n in runs:
        for impl in e["impls"]:
            if impl not in args.impls or (impl == "deepspeed" and not has_ds):
                continue
            if impl == "plain_fsdp2" and (e["stage"] in (0, 1) or e["dtype"] == "fp16" or e["hpz"]
                                          or e["offload"] in ("opt", "nvme", "optnvme")):
                continue   # FSDP2 has no such feature: no row rather than a mislabelled one
            marker = out / f"{e['name']}__{impl}__n{n}.skipped"
            marker.unlink(missing_ok=True)
            left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - t0)
            if left is not None and left < args.min_left_s:
                print(f"--- {e['name']} {impl} n={n}: not run ({left:.0f} s of --budget-s left)", flush=True)
                marker.write_text("")
                continue
            launch(e, impl, n, args, out, args.run_timeout if left is None else min(args.run_timeout, left))
    summarize(out)


if __name__ == "__main__":
    main()
