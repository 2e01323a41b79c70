"""NVMe offload under a host memory budget (issue #6): a model whose optimizer state per rank (fp32 master + two Adam
moments, 12 B/param / world) is larger than the host memory budget trains with ZeRO-Infinity offload, fsdpzero and
DeepSpeed on one ds_config, same disk, same run.

    eval "$(sh bench/libaio_shim/build.sh /tmp/libaio_shim)"       # DeepSpeed's async_io op without libaio-dev
    python bench/nvme_budget.py --nvme-path /tmp/nvme_budget --budget-gib 10 --out out/nvme_budget

Variants (--variants): `nvme` = stage 3, offload_optimizer and offload_param on NVMe; `optnvme` = the optimizer only
(parameters stay on the GPU). Neither implementation ever holds the full model in host memory: fsdpzero wraps a
meta-device model (`fsdpzero.wrap` materialises only the shards) and DeepSpeed builds it under `deepspeed.zero.Init`
with `remote_device` nvme (its ZeRO-Infinity way). Weights: a counter-based hash of (name, element index), so each
rank computes only its own rows and both implementations start from the same values (bf16).

Per rank: peak RSS (VmHWM), RSS after setup and at the end, pinned host bytes (torch's pinned allocator, CUDA only),
the optimizer state bytes (computed), swap bytes on disk, median step time, losses. Budget: when the driver can
create a cgroup v2 child with memory.max, the whole torchrun runs under memory.max = nproc x budget (+0.5 GiB for
the agent), a hard cap; in every case a rank whose VmHWM exceeds --budget-gib marks the row "over budget".
FSDPZERO_BENCH_CPU=1: gloo/CPU, tiny model, no pinning (proves the script; numbers mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "ops"))   # fsdpzero_ops, from the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its import time is the launch clock)
from host_memory import (GIB, cgroup_events, checkpoint_round_trip, disk_bytes, make_cgroup,  # noqa: E402
                         pinned_gib, proc_status)
import torch  # noqa: E402

# 2.92 B Llama: 12 B/param / 2 ranks = 16.3 GiB of optimizer state per rank; seq/micro small (the step is disk bound)
PRESETS = {"3b": dict(hidden_size=2560, num_hidden_layers=40, num_attention_heads=20, num_key_value_heads=4,
                      intermediate_size=6912, vocab_size=32000, seq=512, micro=1),
           "tiny": common.PRESETS["tiny"]}
AIO = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}   # the aio section of conf/zero/stage3_offload_nvme.yaml (DeepSpeed's defaults)


def shape(args) -> dict:
    p = dict(PRESETS[args.preset])
    for key, arg in (("num_hidden_layers", "layers"), ("vocab_size", "vocab"), ("seq", "seq"), ("micro", "micro")):
        if getattr(args, arg):
            p[key] = getattr(args, arg)
    if args.hidden and args.hidden != p["hidden_size"]:
        heads = max(1, args.hidden // 128)
        p.update(hidden_size=args.hidden, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                 intermediate_size=-(-args.hidden * 11 // 4 // 64) * 64)
    return p


def n_params(p: dict) -> int:
    h, f, v, layers = p["hidden_size"], p["intermediate_size"], p["vocab_size"], p["num_hidden_layers"]
    kv = h // p["num_attention_heads"] * p["num_key_value_heads"]
    return layers * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + 2 * v * h + h


def ds_config(args, p: dict, variant: str, nvme_path: str) -> dict:
    """The one ds_config both implementations run (stage 3, bf16, AdamW, clip 1.0); prefetch: one block ahead."""
    h, kv = p["hidden_size"], p["hidden_size"] // p["num_attention_heads"] * p["num_key_value_heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * p["intermediate_size"] + 2 * h
    zero = {"stage": 3, "sub_group_size": int(args.sub_group_size), "stage3_prefetch_bucket_size": block,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": not common.CPU,
                                  "buffer_count": 4, "pipeline_read": args.pipeline, "pipeline_write": args.pipeline}}
    if variant == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": not common.CPU,
                                 "buffer_count": 5, "buffer_size": int(args.param_buffer_size),
                                 "max_in_cpu": int(args.max_in_cpu)}
    return {"train_micro_batch_size_per_gpu": p["micro"], "gradient_accumulation_steps": 1,
            "gradient_clipping": common.CLIP, "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "bf16": {"enabled": True}, "aio": dict(AIO),
            "optimizer": {"type": "AdamW", "params": {"lr": common.LR, "betas": list(common.BETAS),
                                                      "eps": common.EPS, "weight_decay": common.WD}},
            "zero_optimization": zero}


def merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        else:
            dst[k] = v


# ---------------------------------------------------------------- deterministic weights, computable per row range
def init_rows(name: str, shape_: tuple, rows: slice, dtype) -> torch.Tensor:
    """Rows `rows` of parameter `name`: norms 1, else uniform with std 0.02 from a hash of the element index (the
    same values whichever rank computes them, without the full tensor)."""
    cols = 1
    for n in shape_[1:]:
        cols *= n
    start, stop = rows.start * cols, rows.stop * cols
    out = torch.empty(stop - start, dtype=dtype)
    if len(shape_) == 1 and "norm" in name:
        return out.fill_(1.0).view(rows.stop - rows.start, *shape_[1:])
    seed, mask, bound = zlib.crc32(name.encode()), 0xFFFFFFFF, 0.02 * 3 ** 0.5
    step = 1 << 20                       # 8 MiB of int64 temporaries at a time
    for a in range(start, stop, step):
        h = torch.arange(a, min(stop, a + step), dtype=torch.int64)
        h.mul_(0x9E3779B1).add_(seed).bitwise_and_(mask)
        for mul, shift in ((0x85EBCA6B, 16), (0xC2B2AE35, 13)):
            h.bitwise_xor_(h >> shift).mul_(mul).bitwise_and_(mask)
        h.bitwise_xor_(h >> 16)
        out[a - start:a - start + h.numel()] = h.double().mul_(2.0 / 2**32).sub_(1.0).mul_(bound)
    return out.view(rows.stop - rows.start, *shape_[1:])


@torch.no_grad()
def init_fsdpzero(engine) -> None:
    """Fill each rank's shards (FSDP2 shards dim 0) through the module's state_dict / load_state_dict, which the
    engine supports for new weights: the swapped shards come back, and the masters on disk follow the load."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    sd = engine.module.state_dict()
    for name, t in sd.items():
        if not t.is_floating_point():
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(t, DTensor):
            lshape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            assert tuple(lshape[1:]) == tuple(t.shape[1:]), f"{name}: only dim-0 shards are handled"
            rows = slice(offset[0], offset[0] + lshape[0])
        else:
            rows = slice(0, t.shape[0])
        if local.numel():
            local.copy_(init_rows(name, tuple(t.shape), rows, local.dtype).view(local.shape))
    engine.module.load_state_dict(sd)


@torch.no_grad()
def init_deepspeed(model, rank: int) -> None:
    """Same values under zero.Init: gather one parameter at a time, rank 0 writes it, DeepSpeed re-partitions."""
    import deepspeed
    for name, prm in model.named_parameters():
        with deepspeed.zero.GatheredParameters([prm], modifier_rank=0):
            if rank == 0:
                prm.data.copy_(init_rows(name, tuple(prm.shape), slice(0, prm.shape[0]), prm.dtype))


# ---------------------------------------------------------------- worker (one implementation, under torchrun)
def worker(args) -> None:
    import torch.distributed as dist
    p = shape(args)
    cfg = ds_config(args, p, args.variant, args.run_dir)
    if args.impl == "deepspeed" and args.ds_zero_override:   # what DeepSpeed needs to run at all (see --help)
        merge(cfg["zero_optimization"], json.loads(args.ds_zero_override))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if common.CPU else torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # torchrun sets OMP_NUM_THREADS=1: each implementation's CPU Adam gets this rank's share of the cores
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        major, minor = torch.cuda.get_device_capability()
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST") or f"{major}.{minor}"
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch.replace("a", "")   # DS 0.19.8 cannot parse "9.0a"
    mem = {"start": proc_status()}
    if args.impl == "deepspeed":
        import deepspeed
        from transformers import LlamaForCausalLM
        deepspeed.init_distributed(dist_backend="gloo" if common.CPU else "nccl")
        rank = dist.get_rank()
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme" if args.variant == "nvme" else None,
                                 pin_memory=not common.CPU):
            model = LlamaForCausalLM(common.llama_config(p))
        init_deepspeed(model, rank)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        import fsdpzero
        from transformers import LlamaForCausalLM
        with torch.device("meta"):
            model = LlamaForCausalLM(common.llama_config(p)).to(torch.bfloat16)   # bf16 like zero.Init's
        engine = fsdpzero.wrap(model, cfg)
        rank = dist.get_rank()
        init_fsdpzero(engine)
    world = dist.get_world_size()
    mem["setup"] = proc_status()
    pinned_setup = pinned_gib()
    batches = common.fixed_batches(p, rank, 1, device)
    if rank == 0:   # progress lines: a run cut off by --run-timeout still says how far it got
        print(f"[rank 0] setup done {time.perf_counter() - common.START:.1f} s after launch, "
              f"VmHWM {mem['setup']['VmHWM']:.2f} GiB", flush=True)
    done = [0]

    def step():
        t0 = time.perf_counter()
        loss = engine(input_ids=batches[0], labels=batches[0]).loss
        engine.backward(loss)
        engine.step()
        done[0] += 1
        if rank == 0:
            print(f"[rank 0] step {done[0]} done in {time.perf_counter() - t0:.1f} s, VmHWM "
                  f"{proc_status()['VmHWM']:.2f} GiB", flush=True)
        return loss.detach()
    timing = common.timed_loop(step, args.warmup, args.steps, device)
    mem["end"] = proc_status()
    swap = disk_bytes(Path(args.run_dir))
    mine = {"rank": rank, "mem": mem, "pinned_setup": pinned_setup, "pinned_end": pinned_gib()}
    if args.checkpoint:   # save, then load back into the same engine; each with its own peak RSS
        mine["checkpoint"] = checkpoint_round_trip(engine, Path(args.run_dir) / "checkpoint", mem)
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        n = n_params(p)
        budget = args.budget_gib
        hwm = max(v["VmHWM"] for r in ranks for v in r["mem"].values())   # training, save and load
        hwm_setup = max(r["mem"]["setup"]["VmHWM"] for r in ranks)
        state = 12 * n / world / GIB
        r = {"impl": args.impl, "variant": args.variant, "world_size": world, "n_params": n,
             "shape": p, "budget_gib": budget, "opt_state_gib_per_rank": state,
             "state_over_budget": state / budget, "max_vmhwm_gib": hwm,
             "max_vmhwm_after_setup_gib": hwm_setup,
             "status": "ok" if hwm <= budget else "over budget",
             "swap_disk_gib_total": swap / GIB, "swap_disk_gib_per_rank": swap / world / GIB,
             "ranks": ranks, "ds_config": cfg, "steps": args.steps, "warmup": args.warmup,
             "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
             **{k: timing[k] for k in ("step_s", "min_s", "max_s", "losses", "peak_alloc_gib",
                                       "peak_reserved_gib", "launch_to_first_step_s")}}
        Path(args.json).write_text(json.dumps(r, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver
def launch(impl: str, variant: str, args, out: Path) -> dict:
    name = f"{variant}__{impl}"
    run_dir = Path(args.nvme_path) / f"nvme_budget.{os.getpid()}.{name}"   # ours: removed after the run
    run_dir.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", "--impl", impl, "--variant", variant, "--json", str(path), "--run-dir", str(run_dir)]
    cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("preset", "layers", "hidden", "vocab", "seq", "micro", "steps", "warmup", "budget_gib",
             "sub_group_size", "param_buffer_size", "max_in_cpu")]
    cmd += [] if args.pipeline else ["--no-pipeline"]
    cmd += ["--checkpoint"] if args.checkpoint else []
    cmd += [f"--ds-zero-override={args.ds_zero_override}"] if args.ds_zero_override else []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if common.CPU:
        env["DS_ACCELERATOR"] = "cpu"
    child, how = (None, "VmHWM check per rank (--enforce check)")
    if args.enforce == "auto":
        child, why = make_cgroup(int((args.budget_gib * args.nproc + 0.5) * GIB), name)
        how = why + "; and VmHWM check per rank" if child else f"VmHWM check per rank ({why})"
    procs = child / "cgroup.procs" if child else None
    print(f"--- {name}: budget {args.budget_gib} GiB/rank, {how}", flush=True)
    t0 = time.perf_counter()
    popen = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:   # the child moves itself into the cgroup before exec: torchrun and its workers inherit it
        proc = subprocess.Popen(cmd, **popen, preexec_fn=(lambda: procs.write_text("0")) if procs else None)
    except (OSError, subprocess.SubprocessError) as e:
        if not procs:
            raise
        child.rmdir()
        child, how = None, f"VmHWM check per rank (joining {child} failed: {e})"
        proc = subprocess.Popen(cmd, **popen)
    try:
        text, rc = proc.communicate(timeout=args.run_timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:   # as bench/vs_deepspeed.py: SIGTERM lets torchrun stop its workers
        proc.send_signal(signal.SIGTERM)
        try:
            text = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text = proc.communicate()[0]
        text, rc = text + f"\ntimed out after {args.run_timeout} s", "timeout"
    wall = time.perf_counter() - t0
    extra = cgroup_events(child) if child else {}
    disk_left = disk_bytes(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    if child:
        try:
            child.rmdir()
        except OSError:
            pass
    (out / f"{name}.log").write_text(text)
    if rc != 0 or not path.exists():
        oom = extra.get("cgroup_oom_kill", 0) > 0
        row = {"impl": impl, "variant": variant, "budget_gib": args.budget_gib,
               "status": "over budget (killed by memory.max)" if oom else "failed", "rc": rc,
               "error": "\n".join(text.strip().splitlines()[-15:])}
        print(f"    {row['status']} (rc {rc}): {text.strip().splitlines()[-1:] if text.strip() else ''}", flush=True)
    else:
        row = json.loads(path.read_text())
        print(f"    {row['status']}: {row['step_s']:.3f} s/step, max VmHWM {row['max_vmhwm_gib']:.2f} GiB", flush=True)
    row.update(extra, enforcement=how, wall_s=wall, disk_left_after_run_gib=disk_left / GIB)
    path.write_text(json.dumps(row, indent=1))
    return row


def table(rows: list[dict]) -> str:
    lines = ["| variant | impl | status | opt state GiB/rank | budget GiB/rank | VmHWM GiB after setup / end (max "
             "rank) | RSS end GiB (rank 0) | pinned GiB held / peak (rank 0) | swap on disk GiB/rank | step s | "
             "loss first -> last |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "step_s" not in r:
            err = r.get("error", "").strip().splitlines()[-1:] or [""]
            lines.append(f"| {r['variant']} | {r['impl']} | {r['status']}: {err[0][:120]} | | {r['budget_gib']} "
                         "| | | | | | |")
            continue
        m0, pin = r["ranks"][0]["mem"], r["ranks"][0]["pinned_end"]
        pinned = (f"{pin['pinned_allocated_bytes_current_gib']:.2f} / {pin['pinned_allocated_bytes_peak_gib']:.2f}"
                  if "pinned_allocated_bytes_current_gib" in pin else "-")
        lines.append(f"| {r['variant']} | {r['impl']} | {r['status']} | {r['opt_state_gib_per_rank']:.2f} | "
                     f"{r['budget_gib']} | {r['max_vmhwm_after_setup_gib']:.2f} / {r['max_vmhwm_gib']:.2f} | "
                     f"{m0['end']['VmRSS']:.2f} | {pinned} | {r['swap_disk_gib_per_rank']:.2f} | {r['step_s']:.3f} | "
                     f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    for r in rows:
        if r.get("ranks") and "checkpoint" in r["ranks"][0]:
            c, peak = r["ranks"][0]["checkpoint"], {w: max(x["mem"][w]["VmHWM"] for x in r["ranks"])
                                                    for w in ("save", "load")}
            lines.append(f"\n{r['variant']} {r['impl']} checkpoint ({c['checkpoint_disk_gib']:.2f} GiB on disk): "
                         f"save {c['save_s']:.1f} s at peak RSS {peak['save']:.2f} GiB, load {c['load_s']:.1f} s at "
                         f"peak RSS {peak['load']:.2f} GiB (max rank; budget {r['budget_gib']} GiB)")
    by = {(r["variant"], r["impl"]): r for r in rows}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        a, b = by.get((variant, "fsdpzero")), by.get((variant, "deepspeed"))
        if a and b and "step_s" in a and "step_s" in b:
            lines.append(f"\n{variant}: step time fsdpzero / DeepSpeed = {a['step_s'] / b['step_s']:.2f}, "
                         f"first loss {a['losses'][0]:.4f} vs {b['losses'][0]:.4f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gib", type=float, default=10.0, help="host memory budget per rank")
    ap.add_argument("--nvme-path", required=False, help="a directory on the disk to swap to")
    ap.add_argument("--impls", nargs="+", default=["fsdpzero", "deepspeed"], choices=["fsdpzero", "deepspeed"])
    ap.add_argument("--variants", nargs="+", default=["nvme"], choices=["nvme", "optnvme"])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny" if common.CPU else "3b")
    for name in ("layers", "hidden", "vocab", "seq", "micro"):
        ap.add_argument(f"--{name}", type=int, default=0, help="override the preset")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sub-group-size", type=float, default=2.5e7,
                    help="zero_optimization.sub_group_size: the NVMe optimizer's 4 buffers hold 4 x 12 B x this")
    ap.add_argument("--param-buffer-size", type=float, default=1e8, help="offload_param.buffer_size")
    ap.add_argument("--max-in-cpu", type=float, default=2e8, help="offload_param.max_in_cpu")
    ap.add_argument("--no-pipeline", dest="pipeline", action="store_false",
                    help="offload_optimizer.pipeline_read/_write false (DeepSpeed's default; fsdpzero always overlaps)")
    ap.add_argument("--ds-zero-override", default="",
                    help="JSON merged into DeepSpeed's zero_optimization only, e.g. a larger offload_param buffer pool: "
                         "DeepSpeed 0.19.8 asserts 'Not enough swap in buffers' on step 2 with buffer_count 5 "
                         "(deepspeedai/DeepSpeed#3062); recorded in the row")
    ap.add_argument("--checkpoint", action="store_true",
                    help="after the steps: save a checkpoint and load it back, peak RSS of each (under --nvme-path)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default="out/nvme_budget")
    ap.add_argument("--enforce", choices=["auto", "check"], default="auto",
                    help="auto: a cgroup v2 memory.max when one can be made, plus the VmHWM check; check: VmHWM only")
    ap.add_argument("--run-timeout", type=int, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if not args.nvme_path:
        ap.error("--nvme-path DIR is required (a directory on the disk to swap to)")
    p = shape(args)
    n = n_params(p)
    print(f"model: {n / 1e9:.2f} B params; optimizer state {12 * n / args.nproc / GIB:.2f} GiB/rank; "
          f"budget {args.budget_gib} GiB/rank", flush=True)
    if 12 * n / args.nproc / GIB <= args.budget_gib:
        print("warning: the optimizer state fits the budget: this run demonstrates nothing", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [launch(impl, variant, args, out) for variant in args.variants for impl in args.impls]
    md = table(rows)
    (out / "summary.md").write_text(md + "\n")
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(md)


if __name__ == "__main__":
    main()
