"""Two nodes simulated on one host: hpZ and MiCS, fsdpzero vs DeepSpeed 0.19.8, step time and loss curve.

    python bench/multinode.py --out out/multinode                     # 4-GPU host: two launches of 2 GPUs each
    FSDPZERO_BENCH_CPU=1 python bench/multinode.py --out out/mn_cpu   # the same on CPU (gloo, tiny preset, fp32)

Each run is two `fsdpzero launch --num_nodes 2 --node_rank K --master_addr 127.0.0.1 --master_port P` processes
started at once, node K on GPUs 2K, 2K+1 (CUDA_VISIBLE_DEVICES; on CPU 2 gloo ranks each), as DeepSpeed users run
`deepspeed --no_ssh --node_rank K` (or srun) on each node. Every run uses --no_shim, so `deepspeed` rows are DeepSpeed
itself. Runs: fsdpzero and DeepSpeed with zero_hpz_partition_size 2 (the secondary shard within a node), fsdpzero with
mics_shard_size 2 (DeepSpeed 0.19.8 removed MiCS: its config refuses the key, so its row is ZeRO-3 without hpZ,
which MiCS matches in math), and DeepSpeed ZeRO-3 without hpZ. Each rank checks that its hpZ / MiCS shard group is its
own node's ranks. Prints a table and writes one JSON per run (median step time of rank 0 over the timed steps, and the
per-step loss curve of every step, warm-up included) to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "ops"))
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402  (first: its import time is the launch clock)
import torch  # noqa: E402

RUNS = {   # name: (implementation, zero_optimization keys beyond stage 3)
    "fsdpzero_hpz2": ("fsdpzero", {"zero_hpz_partition_size": 2}),
    "deepspeed_hpz2": ("deepspeed", {"zero_hpz_partition_size": 2}),
    "fsdpzero_mics2": ("fsdpzero", {"mics_shard_size": 2}),
    "deepspeed_z3": ("deepspeed", {}),
}


def shard_group(engine, impl: str) -> list[int] | None:
    """The ranks this rank shares its hpZ (secondary) or MiCS shards with."""
    import torch.distributed as dist
    if impl == "deepspeed":
        from deepspeed.utils import groups
        g = groups._get_zero_param_intra_parallel_group()
        return dist.get_process_group_ranks(g) if g is not None else None
    if "shard" in (engine.mesh.mesh_dim_names or ()):
        return dist.get_process_group_ranks(engine.mesh["shard"].get_group())
    from fsdpzero import fsdp2_internals
    for unit in fsdp2_internals.fsdp_units(engine.module)[1:]:
        for g in fsdp2_internals.param_groups(unit):
            if g.post_forward_mesh_info is not None:
                return dist.get_process_group_ranks(g.post_forward_mesh_info.shard_process_group)
    return None


def worker(args) -> None:
    import torch.distributed as dist
    impl, zero = RUNS[args.bench_case]
    p = common.PRESETS[args.preset]
    entry = {"stage": 3, "dtype": "fp32" if common.CPU else "bf16", "ga": 1}
    cfg = common.ds_config(entry, p)
    cfg["zero_optimization"].update(zero)
    # torch's AdamW on both sides: DeepSpeed's FusedAdam would JIT-build (~60 s) on a fresh host; what is compared
    # here is where the shards live and move
    cfg["optimizer"]["params"]["torch_adam"] = True
    if common.CPU:   # the tiny preset's blocks are below the default 1e5-parameter threshold: shard them all
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    device, rank, world = common.init_worker(deepspeed=impl == "deepspeed")
    batches = common.fixed_batches(p, rank, 1, device)
    model = common.build_model(p, device)
    n = common.n_params(model)
    if impl == "deepspeed":
        import deepspeed as lib
    else:
        import fsdpzero as lib
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step():
        loss = engine(input_ids=batches[0], labels=batches[0]).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        return total / world

    timing = common.timed_loop(step, args.warmup, args.steps, device)
    group, node = shard_group(engine, impl), int(os.environ["GROUP_RANK"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    node_ranks = list(range(node * local_world, (node + 1) * local_world))
    if group is not None and not set(group) <= set(node_ranks):
        raise SystemExit(f"rank {rank}: shard group {group} leaves node {node} (ranks {node_ranks})")
    if rank == 0:
        r = common.row(timing, n, p["micro"] * p["seq"], run=args.bench_case, impl=impl, zero=zero,
                       world_size=world,
                       nodes=int(os.environ["WORLD_SIZE"]) // local_world, shard_group_of_rank0=group,
                       preset=args.preset, dtype=entry["dtype"],
                       device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       torch=torch.__version__,
                       deepspeed=__import__("deepspeed").__version__ if impl == "deepspeed" else None)
        Path(args.json).write_text(json.dumps(r, indent=1))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(name: str, args, out: Path) -> dict | None:
    """Start node 0 and node 1 (one `fsdpzero launch` each) and wait for both."""
    path, port = out / f"{name}.json", str(free_port())
    procs = []
    for k in (0, 1):
        env = common.worker_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        if common.CPU:
            per_node = ["--num_gpus", "2"]
        else:
            env["CUDA_VISIBLE_DEVICES"] = f"{2 * k},{2 * k + 1}"   # this "node"'s two GPUs
            per_node = []
        cmd = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())", "launch",
               "--num_nodes", "2", "--node_rank", str(k), *per_node,
               "--master_addr", "127.0.0.1", "--master_port", port, "--no_shim", "--no_local_rank", __file__,
               "--worker", "--bench_case", name, "--json", str(path), "--preset", args.preset,
               "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    print(f"--- {name}", flush=True)
    t0, logs, failed = time.perf_counter(), [], False
    for k, proc in enumerate(procs):
        try:
            logs.append(proc.communicate(timeout=max(1, args.run_timeout - (time.perf_counter() - t0)))[0])
        except subprocess.TimeoutExpired:
            for q in procs:   # SIGTERM: torchrun stops its workers on the way out
                if q.poll() is None:
                    q.send_signal(signal.SIGTERM)
            logs.append((proc.communicate(timeout=60)[0] or "") + f"\ntimed out after {args.run_timeout} s")
        failed |= proc.returncode != 0
    if failed or not path.exists():
        (out / f"{name}.log").write_text("\n=== node 1 ===\n".join(logs))
        print(f"    failed; logs kept in {out / (name + '.log')}: {logs[-1].strip().splitlines()[-1:]}")
        return None
    row = json.loads(path.read_text())
    row["wall_s"] = time.perf_counter() - t0
    path.write_text(json.dumps(row, indent=1))
    return row


def table(rows: dict) -> str:
    lines = ["| run | step s (median) | min / max s | tok/s/GPU | peak alloc GiB | rank 0's shard group | "
             "loss first / last |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if r is None:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        lines.append(f"| {name} | {r['step_s']:.4f} | {r['min_s']:.4f} / {r['max_s']:.4f} | "
                     f"{r['tokens_per_s_per_gpu']:.0f} | {r['peak_alloc_gib']:.2f} | {r['shard_group_of_rank0']} | "
                     f"{r['losses'][0]:.5f} / {r['losses'][-1]:.5f} |")
    pairs = [("fsdpzero_hpz2", "deepspeed_hpz2"), ("fsdpzero_mics2", "deepspeed_z3")]
    for a, b in pairs:
        if rows.get(a) and rows.get(b):
            diff = max(abs(x - y) for x, y in zip(rows[a]["losses"], rows[b]["losses"]))
            lines.append(f"\n{a} vs {b}: max loss difference {diff:.2e}, step time ratio DeepSpeed/fsdpzero "
                         f"{rows[b]['step_s'] / rows[a]['step_s']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/multinode")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny" if common.CPU else "0.25b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--run-timeout", type=int, default=240)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bench_case", choices=list(RUNS), help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if not common.CPU and torch.cuda.device_count() < 4:
        raise SystemExit(f"bench/multinode.py: needs 4 GPUs (two nodes of 2), found {torch.cuda.device_count()}; "
                         "FSDPZERO_BENCH_CPU=1 runs it on CPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {name: two_nodes(name, args, out) for name in args.runs}
    md = table(rows)
    (out / "summary.md").write_text(md + "\n")
    print(json.dumps(rows, default=str))
    print(md)


if __name__ == "__main__":
    main()
