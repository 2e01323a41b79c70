"""ZenFlow and Muon on GPUs (issue 36, item 4), each config its own torchrun, JSON + one table:

    PYTHONPATH=$PWD/.dsdist python bench/zenflow.py --out out/zenflow --budget-s 290

On N GPUs of one host (--nproc N; each rank its own data): the zenflow and offload rows then use the 0.89 B Llama
(--size 2.8b to override), issue 31's 4-GPU stage 2 + CPU offload case, so the exact-offload row compares with
BENCHMARKS.md's S14 figures; 4 warm-up + 12 timed steps (three update intervals) at 0.89 B. Issue 36's "4-GPU stage
2 + offload case with zenflow against DeepSpeed ZenFlow" (3 runs, ~4-5 minutes estimated, not yet run):
    PYTHONPATH=$PWD/.dsdist NCCL_NVLS_ENABLE=0 python bench/zenflow.py --nproc 4 \
        --configs zenflow_ours,offload_ours,zenflow_ds --out out/zenflow4 --budget-s 500

Loss gap (--steps N): zenflow_ours and offload_ours (by default) for N steps on fresh batches of a fixed Markov
chain (1024 token ids, 8 equally likely successors each: a loss floor of ln 8 = 2.079 that takes hundreds of steps
to approach, where the timing mode's 4 repeated random batches would be memorised), the loss of every step, the
median and mean step after the first update interval, and zenflow's gap to the exact offload on 10-step means: at
the end, the largest, and the step at which the exact offload first reached zenflow's final loss. Issue 36's "the
same case against our exact offload on the same host, step time and the loss gap over 200 steps" (the 1-GPU 2.8 B case;
estimated from S13/S14's step times, 0.46 s zenflow and 0.84-1.23 s exact, ~45 s setup each: 6-7.5 minutes on a
fresh host; a row is written every 10 steps, so a run stopped by the budget keeps the curve so far):
    python bench/zenflow.py --steps 200 --out out/zenflow_gap --budget-s 520
    python bench/zenflow.py --steps 200 --size 0.89b --out out/zenflow_gap   # ~3 minutes: the 0.89 B instead

The zenflow rows also give the path's own tensors by where they live (zenflow_resident_gib: device / host, the
model's weights and gradients aside).

- 2.8 B Llama (26 layers, hidden 3072, seq 2048, micro-batch 2, bf16, AdamW lr 1e-4 wd 0.01, clip 1.0), ZeRO 2 with
  CPU optimizer offload: zenflow_ours (the zenflow section of tests/ds_configs/dsex_zenflow_stage2.json: topk_ratio
  0.1, update_interval 4, overlap_step, no warm-up), offload_ours (fsdpzero's exact offload, no zenflow) and
  zenflow_ds (DeepSpeed's ZenFlow, the same config; skipped with a row when DeepSpeed is not importable: put it on
  PYTHONPATH, e.g. the checkout's .dsdist). 4 warm-up steps (one update interval) + 8 timed (two intervals): the
  median step, the mean over the timed steps (a ZenFlow interval has 3 cheap steps and 1 with the CPU update, so
  the mean is the throughput figure), and the loss per step.
- 0.89 B Llama (16 layers, hidden 2048, micro-batch 4), ZeRO 2 without offload: muon_z2_ours against adamw_z2_ours
  (Muon: lr 0.02 for the matrices, 1e-4 for the rest), and muon_z2_ds / adamw_z2_ds when DeepSpeed is importable.
  3 warm-up + 10 timed steps. muon_offload_z2_ours / muon_offload_z2_ds: the same Muon with CPU optimizer offload
  (fsdpzero/offload/muon.py against DeepSpeed's _apply_muon_updates_cpu_offload). adamw_z3_ours, muon_z3_ours and
  muon_z3_ds: the same at ZeRO 3 (issue 36 asks stage 2 and 3).

Each config gets what is left of --budget-s (a config that would start with under --min-left-s is skipped with a
row), so the call ends in time. One config alone:
    torchrun --standalone --nproc_per_node=1 bench/zenflow.py --config zenflow_ours --json out/zenflow_ours.json
FSDPZERO_BENCH_CPU=1 runs the tiny preset on CPU/gloo (the script's correctness only).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "ops"))
CPU = os.environ.get("FSDPZERO_BENCH_CPU") == "1"
SIZES = {"2.8b": dict(layers=26, hidden=3072, micro=2, seq=2048, vocab=32000),
         "0.89b": dict(layers=16, hidden=2048, micro=4, seq=2048, vocab=32000),
         "tiny": dict(layers=2, hidden=64, micro=2, seq=32, vocab=512)}
CONFIGS = {"zenflow_ours": "2.8b", "offload_ours": "2.8b", "zenflow_ds": "2.8b",
           "adamw_z2_ours": "0.89b", "muon_z2_ours": "0.89b", "adamw_z2_ds": "0.89b", "muon_z2_ds": "0.89b",
           "muon_offload_z2_ours": "0.89b", "muon_offload_z2_ds": "0.89b",
           "adamw_z3_ours": "0.89b", "muon_z3_ours": "0.89b", "muon_z3_ds": "0.89b"}
HYPER = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
MARKOV_STATES, MARKOV_NEXT = 1024, 8   # the loss-gap data: token ids < 1024, 8 successors each


def ds_config(name: str, p: dict) -> dict:
    """The DeepSpeed config of a row: fsdpzero and DeepSpeed read the same dict."""
    zero = {"stage": 3 if "_z3_" in name else 2, "overlap_comm": True, "contiguous_gradients": True}
    if "zenflow" in name or "offload" in name:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": not CPU}
    if "zenflow" in name:
        corpus = json.loads((ROOT / "tests" / "ds_configs" / "dsex_zenflow_stage2.json").read_text())
        zero["zenflow"] = corpus["zero_optimization"]["zenflow"]
    opt = {"type": "AdamW", "params": dict(HYPER)}
    if name.startswith("muon") and zero["stage"] == 3:
        zero["reduce_scatter"] = False   # DeepSpeed 0.19.8's stage 3 refuses Muon with its reduce-scatter
    if name.startswith("muon"):
        opt = {"type": "Muon", "params": {"lr": HYPER["lr"], "muon_lr": 0.02, "adam_lr": HYPER["lr"],
                                          "weight_decay": HYPER["weight_decay"]}}
    return {"train_micro_batch_size_per_gpu": p["micro"], "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": zero, "optimizer": opt,
            "zero_allow_untested_optimizer": True}


def build_model(p: dict, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=16 if not CPU else 4,
                      num_key_value_heads=8 if not CPU else 2, intermediate_size=p["hidden"] * 11 // 4,
                      vocab_size=p["vocab"], tie_word_embeddings=False, max_position_embeddings=max(2048, p["seq"]))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)   # the same weights on every rank and for every config
    with device:
        return LlamaForCausalLM(cfg)


def size_of(name: str, nproc: int, override: str | None) -> str:
    """The model of a config: the zenflow/offload rows' 2.8 B on one GPU, the 0.89 B on several (issue 31's multi-GPU
    offload case), unless --size says otherwise; the tiny preset on CPU."""
    if CPU:
        return "tiny"
    if CONFIGS[name] == "2.8b":
        return override or ("0.89b" if nproc > 1 else "2.8b")
    return override or CONFIGS[name]


def markov_batch(step: int, rank: int, p: dict):
    """Step `step`'s batch on `rank` for the loss-gap mode: sequences of a fixed Markov chain over the first
    MARKOV_STATES token ids (each with MARKOV_NEXT equally likely successors), new every step: learnable structure
    that hundreds of steps approach (the floor is ln MARKOV_NEXT), not a batch to memorise."""
    import torch
    states = min(MARKOV_STATES, p["vocab"])
    table = torch.randint(0, states, (states, MARKOV_NEXT), generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(10 ** 6 + 1000 * step + rank)
    pick = torch.randint(0, MARKOV_NEXT, (p["micro"], p["seq"]), generator=g)
    tokens = torch.empty(p["micro"], p["seq"], dtype=torch.long)
    tokens[:, 0] = torch.randint(0, states, (p["micro"],), generator=g)
    for t in range(1, p["seq"]):
        tokens[:, t] = table[tokens[:, t - 1], pick[:, t]]
    return tokens


def run_one(ns) -> dict:
    import torch
    size = ns.size or size_of(ns.config, 1, None)
    p = SIZES[size]
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if CPU else torch.device("cuda", local)
    if not CPU:
        torch.cuda.set_device(device)
    config = ds_config(ns.config, p)
    # the zenflow/offload rows: one update interval of warm-up, whole intervals timed (three at 0.89 B: issue 31's
    # >= 12 timed steps for the several-GPU offload case)
    warmup, timed = ((4, 8) if size == "2.8b" or CPU else (4, 12)) if CONFIGS[ns.config] == "2.8b" else (3, 10)
    if ns.steps:   # the loss-gap mode: every step's loss; times after the first update interval
        warmup, timed = min(4, ns.steps - 1), ns.steps - min(4, ns.steps - 1)
    if ns.config.endswith("_ds"):
        if CPU:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from common import prepare_deepspeed_build   # Muon's FusedAdam JIT build: the arch list it can parse
        prepare_deepspeed_build()
        import deepspeed  # the bench may import DeepSpeed; the library never does
        model = build_model(p, device)
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    else:
        import fsdpzero
        engine = fsdpzero.initialize(model=build_model(p, device), config=copy.deepcopy(config))[0]
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else 1
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, p["vocab"], (p["micro"], p["seq"]), generator=g).to(device) for _ in range(4)]
    losses, times = [], []

    def result() -> dict:
        step = times[warmup:] or times
        row = {"config": ns.config, "size": size, "world": world, "warmup": warmup, "timed": timed,
               "steps_done": len(times), "final": len(times) == warmup + timed,
               "median_step_s": statistics.median(step),
               "mean_step_s": statistics.mean(step), "losses": losses, "steps_s": times}
        if ns.steps:
            row["data"] = (f"markov: {min(MARKOV_STATES, p['vocab'])} token ids, {MARKOV_NEXT} successors each "
                           f"(loss floor ln {MARKOV_NEXT} = {math.log(MARKOV_NEXT):.3f})")
        if not CPU:
            row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
            row["gpu"] = torch.cuda.get_device_name()
        path = getattr(engine, "grad_path", None)
        if hasattr(path, "resident_bytes"):   # ZenFlow's own tensors by where they live (weights and grads aside)
            row["zenflow_resident_gib"] = {k: v / 2 ** 30 for k, v in path.resident_bytes().items()}
        import resource
        row["peak_host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        return row

    for i in range(warmup + timed):
        x = markov_batch(i, rank, p).to(device) if ns.steps else batches[i % len(batches)]
        if not CPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))   # the host sync ends the step (as a training loop's logging does)
        if not CPU:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if ns.steps and ns.json and rank == 0 and len(times) % 10 == 0 and len(times) < warmup + timed:
            write_row(ns.json, result())   # a run the budget stops keeps its curve so far
    return result()


def write_row(path: str, row: dict) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(row))
    tmp.replace(path)   # whole rows only: the driver may read it after a kill


def table(rows: list[dict]) -> str:
    out = [f"{'config':16} {'size':6} {'median s':>9} {'mean s':>8} {'first loss':>10} {'last loss':>10} "
           f"{'GPU GiB':>8} {'host GiB':>8}  note"]
    for r in rows:
        if "median_step_s" not in r:
            out.append(f"{r['config']:16} {r.get('size', ''):6} {'-':>9} {'-':>8} {'-':>10} {'-':>10} {'-':>8} "
                       f"{'-':>8}  {r.get('skipped', '')}")
            continue
        out.append(f"{r['config']:16} {r['size']:6} {r['median_step_s']:9.3f} {r['mean_step_s']:8.3f} "
                   f"{r['losses'][0]:10.4f} {r['losses'][-1]:10.4f} {r.get('peak_gpu_gib', 0):8.1f} "
                   f"{r['peak_host_rss_gib']:8.1f}  {r.get('note', '')}")
    return "\n".join(out)


def loss_gap(zen: list[float], exact: list[float], window: int = 10) -> dict:
    """zenflow's loss against the exact offload's over the steps both ran, on trailing means of `window` steps (one
    step's loss is noisier than a few steps' progress): the gap at the end, the largest gap, and the first step at
    which the exact offload's mean was at or below zenflow's final one: how many exact steps zenflow's run is worth
    (None: not within these steps)."""
    n = min(len(zen), len(exact))
    w = max(1, min(window, n))
    zs = [statistics.mean(zen[max(0, i + 1 - w):i + 1]) for i in range(n)]
    es = [statistics.mean(exact[max(0, i + 1 - w):i + 1]) for i in range(n)]
    reached = next((i + 1 for i in range(w - 1, n) if es[i] <= zs[-1]), None)
    return {"steps": n, "window": w, "gap_final": zs[-1] - es[-1], "gap_max": max(z - e for z, e in zip(zs, es)),
            "exact_steps_to_zenflow_final": reached}


def curve_table(rows: list[dict]) -> str:
    """The loss-gap mode's curves, every tenth of the run (the JSON has every step)."""
    by = {r["config"]: r for r in rows if r.get("losses")}
    names = [n for n in ("zenflow_ours", "offload_ours", "zenflow_ds") if n in by] or sorted(by)
    if not names:
        return ""
    n = max(len(by[k]["losses"]) for k in names)
    marks = sorted({min(n, max(1, round(n * k / 10))) for k in range(11)})
    out = ["step " + " ".join(f"{k:>13}" for k in names)]
    for m in marks:
        out.append(f"{m:4d} " + " ".join(f"{by[k]['losses'][m - 1]:13.4f}" if len(by[k]["losses"]) >= m
                                         else f"{'-':>13}" for k in names))
    return "\n".join(out)


def derive(rows: list[dict]) -> None:
    by = {r["config"]: r for r in rows if "median_step_s" in r}
    if "zenflow_ours" in by and "offload_ours" in by and by["zenflow_ours"].get("data"):   # the loss-gap mode
        by["zenflow_ours"]["loss_gap_vs_offload_ours"] = loss_gap(by["zenflow_ours"]["losses"],
                                                                  by["offload_ours"]["losses"])
    for ours, ref in (("zenflow_ours", "zenflow_ds"), ("zenflow_ours", "offload_ours"), ("muon_z2_ours", "adamw_z2_ours"),
                      ("muon_z2_ours", "muon_z2_ds"), ("muon_offload_z2_ours", "muon_offload_z2_ds"),
                      ("muon_z3_ours", "adamw_z3_ours"), ("muon_z3_ours", "muon_z3_ds")):
        if ours in by and ref in by:
            by[ours].setdefault("note", "")
            by[ours]["note"] += (f"mean {by[ours]['mean_step_s'] / by[ref]['mean_step_s']:.2f}x {ref} "
                                 f"(median {by[ours]['median_step_s'] / by[ref]['median_step_s']:.2f}x); ")


def final_row(path: Path) -> bool:
    try:
        return bool(json.loads(path.read_text()).get("final"))
    except (OSError, ValueError):
        return False


def wait_run(proc, path: Path, left: float, grace: float) -> str | None:
    """Wait for one config's torchrun; None when it ended by itself. Its process group is killed past `left` seconds,
    or `grace` seconds after its final row appeared: DeepSpeed's ZenFlow process wrote its row and then did not exit
    in S13, which took the rest of the call's budget."""
    start, done = time.monotonic(), None
    while proc.poll() is None:
        now = time.monotonic()
        if done is None and final_row(path):
            done = now
        if now - start > left or (done is not None and now - done > grace):
            os.killpg(proc.pid, 9)
            proc.wait()
            return f"killed after {left:.0f} s" if done is None else f"killed {grace:.0f} s after its final row"
        time.sleep(0.5)
    return None


def drive(ns) -> None:
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    start, rows = time.monotonic(), []
    if ns.configs is None:
        ns.configs = "zenflow_ours,offload_ours" if ns.steps else ",".join(CONFIGS)
    has_ds = importlib.util.find_spec("deepspeed") is not None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "ops"),
                                                                     os.environ.get("PYTHONPATH")]))}
    for name in ns.configs.split(","):
        left = ns.budget_s - (time.monotonic() - start)
        size = size_of(name, ns.nproc, ns.size)
        if name.endswith("_ds") and not has_ds:
            rows.append({"config": name, "size": size, "skipped": "DeepSpeed not importable"})
            continue
        if left < ns.min_left_s:
            rows.append({"config": name, "size": size, "skipped": f"budget: {left:.0f} s left"})
            continue
        path = out / f"{name}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ns.nproc}",
               __file__, "--config", name, "--json", str(path), "--size", size, "--steps", str(ns.steps)]
        log = out / f"{name}.log"
        path.unlink(missing_ok=True)
        # its own session: a timeout ends the whole group (DeepSpeed's optimizer process included)
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
            late = wait_run(proc, path, left, ns.exit_grace_s)
        tail = log.read_text(errors="replace")[-300:]
        if path.exists():   # the worker writes its row after the timed steps (in the loss-gap mode every 10
            row = json.loads(path.read_text())   # steps too): a late exit still measured them
            if late or proc.returncode:
                row["note"] = (f"{late or f'exit {proc.returncode}'} after writing its row at step "
                               f"{row.get('steps_done', '?')} (log: {log.name}); ")
            rows.append(row)
        else:
            rows.append({"config": name, "size": size,
                         "skipped": f"{late or f'exit {proc.returncode}'} (log: {log.name}): {tail!r}"})
    derive(rows)
    (out / "zenflow.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps([{k: v for k, v in r.items() if k not in ("losses", "steps_s")} for r in rows]))
    print(table(rows))
    if ns.steps:
        print(curve_table(rows))
        gap = next((r["loss_gap_vs_offload_ours"] for r in rows if "loss_gap_vs_offload_ours" in r), None)
        if gap:
            print(f"zenflow_ours - offload_ours over {gap['steps']} steps (means of {gap['window']} steps): at the "
                  f"end {gap['gap_final']:+.4f}, largest {gap['gap_max']:+.4f}; offload_ours reached zenflow's final "
                  f"loss at step {gap['exact_steps_to_zenflow_final']}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), help="run one config (under torchrun)")
    ap.add_argument("--json", help="with --config: where its row goes")
    ap.add_argument("--configs", default=None, help="the driver's configs, in order (default: all; with --steps: "
                    "zenflow_ours,offload_ours)")
    ap.add_argument("--out", default="out/zenflow")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) of this host per config")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="the zenflow/offload rows' model (default: "
                    "2.8b on one GPU, 0.89b on several)")
    ap.add_argument("--steps", type=int, default=0, help="the loss-gap mode: this many steps on Markov-chain data, "
                    "every step's loss")
    ap.add_argument("--budget-s", type=float, default=290)
    ap.add_argument("--min-left-s", type=float, default=40)
    ap.add_argument("--exit-grace-s", type=float, default=45, help="kill a run that has not exited this many seconds "
                    "after writing its final row")
    ns = ap.parse_args(argv)
    if ns.nproc < 1 or ns.steps < 0 or ns.steps == 1:
        ap.error(f"--nproc {ns.nproc} / --steps {ns.steps}: give --nproc >= 1 and --steps 0 (timing mode) or >= 2")
    if ns.config:
        row = run_one(ns)
        if ns.json and int(os.environ.get("RANK", 0)) == 0:
            write_row(ns.json, row)
        return
    drive(ns)


if __name__ == "__main__":
    main()
