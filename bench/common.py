"""Shared bench pieces: model presets, fixed random data, the ds_config of a matrix entry, the timed loop, one JSON row.

Setup of shared/spec/device_anchors.md (0.89 B Llama, seq 2048, micro 4/GPU, AdamW 1e-4, clip 1.0, 3 warm-up + 10
timed steps, rank-0 median). FSDPZERO_BENCH_CPU=1 runs on gloo/CPU (tiny preset) to prove a script before GPU time.
"""
from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch

import fsdpzero.dist  # noqa: F401  the exit hand-over of the GIL to gloo's workers (docs/engine.md "Shutdown") for
# every bench process, DeepSpeed's and the hand-written loops' included: without it they can abort at exit (-6)

START = time.perf_counter()   # process start, near enough: the first bench import (launch-to-first-step)
CPU = os.environ.get("FSDPZERO_BENCH_CPU") == "1"
PRESETS = {
    "0.9b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=5632, vocab_size=32000, seq=2048, micro=4),
    "0.25b": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=2816, vocab_size=32000, seq=2048, micro=4),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, seq=32, micro=2),
}
LR, BETAS, EPS, WD, CLIP = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0
COMPILE_BACKEND = "aot_eager" if CPU else "inductor"   # CPU smoke runs check the script, not inductor's C++ build


def llama_config(p: dict):
    from transformers import LlamaConfig
    cfg = LlamaConfig(hidden_size=p["hidden_size"], num_hidden_layers=p["num_hidden_layers"],
                      num_attention_heads=p["num_attention_heads"], num_key_value_heads=p["num_key_value_heads"],
                      intermediate_size=p["intermediate_size"], vocab_size=p["vocab_size"],
                      max_position_embeddings=p["seq"], tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(p: dict, device: torch.device, dtype=torch.float32) -> torch.nn.Module:
    from transformers import LlamaForCausalLM
    torch.manual_seed(1234)   # same init on every rank and every implementation
    with device:
        return LlamaForCausalLM(llama_config(p)).to(dtype)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def fixed_batches(p: dict, rank: int, ga: int, device) -> list[torch.Tensor]:
    """ga fixed micro-batches per rank, reused every step (data loading is not what is measured)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, p["vocab_size"], (p["micro"], p["seq"]), generator=g).to(device) for _ in range(ga)]


def ds_config(entry: dict, p: dict) -> dict:
    """The one DeepSpeed config both fsdpzero and DeepSpeed get for a matrix entry
    (keys: stage, dtype in bf16/fp16/fp32, ga, offload in none/opt/both/nvme/optnvme, hpz, nvme_path)."""
    zero = {"stage": entry["stage"]}
    if entry.get("offload") in ("opt", "both"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": not CPU}
    if entry.get("offload") == "both":
        zero["offload_param"] = {"device": "cpu", "pin_memory": not CPU}
    if entry.get("offload") in ("nvme", "optnvme"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": entry["nvme_path"]}
    if entry.get("offload") == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": entry["nvme_path"]}
    if entry.get("hpz"):
        zero["zero_hpz_partition_size"] = entry["hpz"]
    cfg = {"train_micro_batch_size_per_gpu": p["micro"], "gradient_accumulation_steps": entry.get("ga", 1),
           "gradient_clipping": CLIP, "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                     "weight_decay": WD}},
           "zero_optimization": zero}
    dtype = entry.get("dtype", "bf16")
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return cfg


def prepare_deepspeed_build() -> None:
    """Before importing DeepSpeed: its JIT-built ops (CPU Adam, FusedAdam) go to the project's extension cache, and
    on a GPU the arch list names the device's capability (DeepSpeed 0.19.8 cannot parse an entry such as "9.0a",
    which the GPU image sets)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"


def init_worker(deepspeed: bool) -> tuple[torch.device, int, int]:
    """A bench worker under a launcher (torchrun, fsdpzero launch): this rank's GPU, or the CPU under
    FSDPZERO_BENCH_CPU=1, and the process group (DeepSpeed's init_distributed for a DeepSpeed run, its op builds
    prepared; torch's otherwise). Returns (device, rank, world size)."""
    import torch.distributed as dist
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if CPU else torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if CPU else "nccl"
    if deepspeed:
        prepare_deepspeed_build()
        import deepspeed as ds
        if CPU:   # DeepSpeed JIT-builds a shared-memory all-reduce for inference on CPU (~40 s); unused here
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        ds.init_distributed(dist_backend=backend)
    else:
        dist.init_process_group(backend)
    return device, dist.get_rank(), dist.get_world_size()


def engine_step(engine, batches):
    """One optimizer step of a DeepSpeed-shaped engine (DeepSpeed's, fsdpzero's) over the micro-batches `batches`:
    the gradient-accumulation boundaries are the engine's business. Returns the mean loss."""
    def step():
        total = 0.0
        for x in batches:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / len(batches)
        return total
    return step


def step_timer(sync, times: list[float], first: list[float] | None = None):
    """A transformers TrainerCallback that appends each training step's wall time (between `sync()` calls) to
    `times`, and, when `first` is given, the time from process start to the first step's end to it once."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            times.append(time.perf_counter() - self.t0)
            if first is not None and not first:
                first.append(time.perf_counter() - START)
    return StepTimer()


def worker_env(**extra: str) -> dict[str, str]:
    """The environment a bench's launcher command runs in: this one's, `extra`, one OpenMP thread per rank unless
    the user set OMP_NUM_THREADS (torchrun's default), and DeepSpeed on its CPU accelerator under
    FSDPZERO_BENCH_CPU=1."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **extra)
    if CPU:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def run_launcher(cmd: list[str], env: dict[str, str], timeout: float, cwd=None) -> tuple[str, int | str]:
    """Run a launcher command (torchrun, fsdpzero launch) to its end: (its stdout and stderr, the exit code, or
    "timeout"). At the timeout it gets SIGTERM, so that torchrun stops its workers (each in its own session) on
    the way out (SIGKILL would orphan them with their GPUs); SIGKILL only if it has not finished 60 s later."""
    import signal
    import subprocess
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        return proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            text = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            text = proc.communicate()[0]
        return text + f"\ntimed out after {timeout} s", "timeout"


def host_rss_gib() -> float:
    """Peak resident set of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def timed_loop(step, warmup: int, steps: int, device) -> dict:
    """Run warmup + steps calls of step() -> loss (float); cuda-synchronised wall time of the timed ones (each step's
    in steps_s: S15's stage-2 row was bimodal and only its median, min and max came back)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses, first_step_s = [], [], None
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        losses.append(float(step()))
        sync()
        if i == 0:
            first_step_s = time.perf_counter() - START
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = [torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30] if cuda else [0, 0]
    return {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps_s": times,
            "launch_to_first_step_s": first_step_s, "losses": losses,
            "peak_alloc_gib": peak[0], "peak_reserved_gib": peak[1], "host_rss_gib": host_rss_gib()}


def row(timing: dict, n: int, tokens_per_step_per_gpu: int, **meta) -> dict:
    """One JSON row: timing + tokens/s/GPU + model TFLOP/s/GPU (6 * N * tokens / step time)."""
    t = timing["step_s"]
    return {**meta, **timing, "n_params": n, "tokens_per_s_per_gpu": tokens_per_step_per_gpu / t,
            "tflops_per_gpu": 6 * n * tokens_per_step_per_gpu / t / 1e12}


SHAPE_ARGS = ("layers", "hidden", "vocab", "seq", "micro", "steps", "warmup")


def run_configs(script: str, args, summary_name: str) -> list[dict]:
    """`--all`: each config of args.configs in its own torchrun of `script` (nothing leaks between runs), DeepSpeed
    configs (ds_*) only when deepspeed imports; rows (or {"config", "error"}) also saved to out/<summary_name>."""
    import subprocess
    import sys
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.configs.split(","):
        if name.startswith("ds_") and importlib.util.find_spec("deepspeed") is None:
            rows.append({"config": name, "error": "deepspeed not importable"})
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               script, "--config", name, "--json", str(out / f"{name}.json")]
        cmd += [f"--{k}={getattr(args, k)}" for k in SHAPE_ARGS]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not (out / f"{name}.json").exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            rows.append({"config": name, "error": f"rc={proc.returncode}", "log_tail": tail})
            print(f"{name}: FAILED rc={proc.returncode}\n{tail}", flush=True)
            continue
        rows.append({**json.loads((out / f"{name}.json").read_text()), "wall_s": time.perf_counter() - t0})
        print(f"{name}: {rows[-1]['step_s']:.3f} s/step", flush=True)
    (out / summary_name).write_text(json.dumps(rows, indent=2))
    return rows


def config_main(doc: str, configs: list[str], run_one, run_all, *, out: str, timeout: int) -> None:
    """The command line shared by the per-config benches: `--config NAME` under torchrun, or `--all`."""
    import argparse
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=configs)
    ap.add_argument("--all", action="store_true", help="run --configs one torchrun each and print one table")
    ap.add_argument("--configs", default=",".join(configs))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=out)
    ap.add_argument("--json", default=None)
    for name, default in zip(SHAPE_ARGS, (16, 2048, 32000, 2048, 4, 10, 3)):   # device_anchors.md's setup
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--timeout", type=int, default=timeout, help="seconds per config (--all)")
    args = ap.parse_args()
    if args.all:
        run_all(args)
    elif args.config:
        run_one(args)
    else:
        ap.error("give --config NAME (under torchrun) or --all")
