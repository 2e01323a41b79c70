"""fsdpzero vs DeepSpeed vs hand-written FSDP2 over a matrix of ds_config entries (one torchrun per run).

    python bench/vs_deepspeed.py --matrix core --nproc 2 --out out/vs_ds          # run + table + plots
    python bench/vs_deepspeed.py --scaling 1 2 4 --out out/scaling                 # weak scaling, stages 2/3
    python bench/vs_deepspeed.py --summarize out/vs_ds                            # table + plots from JSON
    python bench/vs_deepspeed.py --matrix nvme --nvme-path /tmp/nv --preset 0.25b  # ZeRO-Infinity: opt + params
                                                                                  # on NVMe, state vs host RSS
    --only z2_fp16_ga1 z3_bf16_ga4 ... picks matrix entries (to split a matrix over GPU pairs of one host)
DeepSpeed's NVMe entries need its async_io op: without libaio-dev, first eval "$(sh bench/libaio_shim/build.sh DIR)".
FSDPZERO_BENCH_CPU=1 uses gloo/CPU, the tiny preset and fp32 (DeepSpeed with DS_ACCELERATOR=cpu).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "ops"))   # fsdpzero_ops, from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its import time is the launch clock)
import torch  # noqa: E402

IMPLS = ["fsdpzero", "deepspeed", "plain_fsdp2"]


def entry(stage, dtype="bf16", ga=1, offload="none", hpz=0, impls=tuple(IMPLS)):
    name = f"z{stage}_{dtype}_ga{ga}" + (f"_off-{offload}" if offload != "none" else "") + (f"_hpz{hpz}" if hpz else "")
    return dict(name=name, stage=stage, dtype=dtype, ga=ga, offload=offload, hpz=hpz, impls=list(impls))


def matrix(kind: str, nvme_path: str | None, nproc: int) -> list[dict]:
    if kind == "smoke":
        return [entry(2, impls=("fsdpzero", "plain_fsdp2", "deepspeed"))]
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
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=e["stage"] == 3, mp_policy=mp, offload_policy=off)
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
    device, rank, world = common.init_worker(deepspeed=args.impl == "deepspeed")
    batches = common.fixed_batches(p, rank, e["ga"], device)
    model = common.build_model(p, device)
    n = common.n_params(model)
    if args.impl == "plain_fsdp2":
        step = plain_step(model, e, p, device, batches)
    elif args.impl == "deepspeed":
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        step = common.engine_step(engine, batches)
    else:
        import fsdpzero
        engine, *_ = fsdpzero.initialize(model=model, config=cfg)
        step = common.engine_step(engine, batches)
    timing = common.timed_loop(step, args.warmup, args.steps, device)
    if rank == 0:
        r = common.row(timing, n, p["micro"] * p["seq"] * e["ga"], config=e["name"], impl=args.impl,
                       stage=e["stage"], dtype=e["dtype"], ga=e["ga"], offload=e["offload"], hpz=e["hpz"],
                       world_size=world, preset=args.preset,
                       # fp32 master + two Adam moments per parameter, this rank's share: what NVMe offload keeps
                       # off the host; compare with host_rss_gib (peak resident set of rank 0)
                       opt_state_gib_per_rank=12 * n / world / 2**30,
                       device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
        Path(args.json).write_text(json.dumps(r, indent=1))
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver (one torchrun per run) and summaries
def launch(e, impl, nproc, args, out: Path) -> dict | None:
    path = out / f"{e['name']}__{impl}__n{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           __file__, "--worker", "--impl", impl, "--entry", json.dumps(e), "--json", str(path),
           "--preset", args.preset, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    print(f"--- {e['name']} {impl} n={nproc}", flush=True)
    text, rc = common.run_launcher(cmd, common.worker_env(), args.run_timeout)
    if rc != 0 or not path.exists():
        (out / f"{e['name']}__{impl}__n{nproc}.log").write_text(text)
        print(f"    failed (rc {rc}); log kept: {text.strip().splitlines()[-1:]}")
        return None
    return json.loads(path.read_text())


def load_rows(out: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob("*__*__n*.json"))]


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
    md = table(rows)
    if len({r["world_size"] for r in rows}) > 1:
        md += "\n\n### weak scaling\n\n" + scaling_table(rows)
    (out / "summary.md").write_text(md + "\n")
    print(md)
    plots(rows, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--matrix", choices=["smoke", "core", "full", "nvme"])
    ap.add_argument("--scaling", type=int, nargs="+")
    ap.add_argument("--summarize", metavar="DIR")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default="out/vs_ds")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these matrix entries (e.g. z2_fp16_ga1)")
    ap.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny" if common.CPU else "0.9b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--entry", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.summarize:
        return summarize(Path(args.summarize))
    if not (args.matrix or args.scaling):
        ap.error("give --matrix {smoke,core,full,nvme}, --scaling N [N ...] or --summarize DIR")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    has_ds = importlib.util.find_spec("deepspeed") is not None
    runs = ([(e, n) for n in args.scaling for e in (entry(2), entry(3))] if args.scaling
            else [(e, args.nproc) for e in matrix(args.matrix, args.nvme_path, args.nproc)])
    runs = [(e, n) for e, n in runs if not args.only or e["name"] in args.only]
    for e, n in runs:
        for impl in e["impls"]:
            if impl not in args.impls or (impl == "deepspeed" and not has_ds):
                continue
            if impl == "plain_fsdp2" and (e["stage"] in (0, 1) or e["dtype"] == "fp16" or e["hpz"]
                                          or e["offload"] in ("opt", "nvme", "optnvme")):
                continue   # FSDP2 has no such feature: no row rather than a mislabelled one
            launch(e, impl, n, args, out)
    summarize(out)


if __name__ == "__main__":
    main()
