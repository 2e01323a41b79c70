"""The consolidated 16-bit export (engine.save_16bit_model): time and host memory, streamed vs whole on rank 0.

    python bench/export.py --dir /tmp/exb --nproc 2                  # GPUs (NCCL), the 0.89 B Llama of bench/ckpt.py
    python bench/export.py --dir /tmp/exb --nproc 2 --tiny           # CPU smoke (gloo)

Each implementation runs in its own torchrun (a clean VmHWM), on the same model (seed 1234, ZeRO-3 bf16, no step):
- `streamed`: fsdpzero's save_16bit_model (one parameter all-gathered, cast and appended to its file at a time);
- `in_memory`: the reference it replaced, kept here: get_model_state_dict(full_state_dict, cpu_offload) on rank 0,
  then the same safetensors files (DeepSpeed's shape of the job);
- `deepspeed`: DeepSpeed 0.19.8's own engine.save_16bit_model (pytorch_model.bin), where deepspeed imports.
Per rank: VmHWM is reset through /proc/self/clear_refs before the export; the row gives the peak RSS and what the
export added above the RSS before it, and the GPU memory it added. The driver then checks that every output holds the
same tensors (bit for bit), prints one JSON line per implementation and a table.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "ops"), str(HERE)]
GIB = 2**30


def export_in_memory(model, out: Path) -> None:
    """The pre-streaming export: the full fp32 state dict on rank 0's CPU, then cast and written."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdpzero.checkpoint.export import save_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_state_dict(full, out, dtype=torch.bfloat16)
    dist.barrier()


def worker(args) -> None:
    from ckpt import build
    from host_memory import proc_status
    if args.impl == "deepspeed":
        import deepspeed
        if not torch.cuda.is_available():   # CPU smoke: skip the JIT build of DeepSpeed's shm all-reduce
            # (the module itself: `import deepspeed.comm.torch as m` binds torch, which deepspeed.comm re-exports)
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed()
    else:
        dist.init_process_group()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    engine = build("deepspeed" if args.impl == "deepspeed" else "fsdpzero", args.tiny, 1)
    out = Path(args.dir) / args.impl
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    gpu0 = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    before = proc_status()
    t0 = time.perf_counter()
    if args.impl == "in_memory":
        export_in_memory(engine.module, out)
    else:
        engine.save_16bit_model(str(out))
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = proc_status()["VmHWM"]
    mine = torch.tensor([peak, peak - before["VmRSS"],
                         (torch.cuda.max_memory_allocated() - gpu0) / GIB if cuda else 0.0], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        row = {"impl": args.impl, "world": dist.get_world_size(),
               "device": torch.cuda.get_device_name() if cuda else "cpu", "save_s": round(seconds, 3),
               "rank0_peak_rss_gib": round(float(every[0][0]), 3), "rank0_added_rss_gib": round(float(every[0][1]), 3),
               "max_added_rss_gib": round(max(float(e[1]) for e in every), 3),
               "max_added_gpu_gib": round(max(float(e[2]) for e in every), 3),
               "bytes_on_disk": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
               "torch": torch.__version__}
        Path(args.json).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def tensors_of(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(out.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(f).items()}
    return torch.load(out / "pytorch_model.bin", weights_only=True, map_location="cpu")


def driver(args) -> None:
    impls = [i for i in args.impls if i != "deepspeed" or importlib.util.find_spec("deepspeed") is not None]
    rows, root = [], Path(args.dir)
    for impl in impls:
        js = root / f"{impl}.json"
        js.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--impl", impl, "--dir", args.dir, "--json", str(js)] + (["--tiny"] if args.tiny else [])
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
        if not torch.cuda.is_available() and impl == "deepspeed":
            env["DS_ACCELERATOR"] = "cpu"
        if impl == "deepspeed" and "TORCH_CUDA_ARCH_LIST" in env:   # DeepSpeed's op builder cannot parse "9.0a"
            env["TORCH_CUDA_ARCH_LIST"] = env["TORCH_CUDA_ARCH_LIST"].replace("a", "")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        if not js.exists():
            text = proc.stdout + proc.stderr
            rows.append({"impl": impl, "error": [ln for ln in text.splitlines() if "Error" in ln][-3:] or text[-500:]})
        else:   # a nonzero exit after the row was written (at teardown) is kept in the row, not hidden
            rows.append({**json.loads(js.read_text()), "exit_code": proc.returncode})
        print(json.dumps(rows[-1]), flush=True)
    done = [r for r in rows if "error" not in r]
    if done:   # every output holds the first one's tensors, bit for bit
        ref = tensors_of(root / done[0]["impl"])
        for r in done:
            got = tensors_of(root / r["impl"])
            r["same_tensors_as_" + done[0]["impl"]] = got.keys() == ref.keys() and all(
                got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]) for k in ref)
            del got
    print("\n| impl | save s | rank-0 peak RSS GiB | added by the export, rank 0 / max rank GiB "
          "| GPU added GiB | on disk GiB | same tensors |\n|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['impl']} | failed: {str(r['error'])[-300:]!r} | | | | | |")
            continue
        same = next((v for k, v in r.items() if k.startswith("same_tensors_as_")), "")
        print(f"| {r['impl']} | {r['save_s']:.2f} | {r['rank0_peak_rss_gib']:.2f} | {r['rank0_added_rss_gib']:.2f} / "
              f"{r['max_added_rss_gib']:.2f} | {r['max_added_gpu_gib']:.2f} | {r['bytes_on_disk'] / GIB:.2f} "
              f"| {same} |")
    for r in done:
        shutil.rmtree(root / r["impl"], ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--impls", nargs="+", default=["streamed", "in_memory", "deepspeed"],
                    choices=["streamed", "in_memory", "deepspeed"])
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--impl", help=argparse.SUPPRESS)   # set by the driver for each torchrun
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    worker(args) if args.impl else driver(args)


if __name__ == "__main__":
    main()
