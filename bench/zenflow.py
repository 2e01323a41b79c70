"""ZenFlow and Muon on one GPU (issue 36, item 4), each config its own torchrun, JSON + one table:

    PYTHONPATH=$PWD/.dsdist python bench/zenflow.py --out out/zenflow --budget-s 290

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
  (fsdpzero/offload/muon.py against DeepSpeed's _apply_muon_updates_cpu_offload).

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
           "muon_offload_z2_ours": "0.89b", "muon_offload_z2_ds": "0.89b"}
HYPER = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def ds_config(name: str, p: dict) -> dict:
    """The DeepSpeed config of a row: fsdpzero and DeepSpeed read the same dict."""
    zero = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}
    if "zenflow" in name or "offload" in name:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": not CPU}
    if "zenflow" in name:
        corpus = json.loads((ROOT / "tests" / "ds_configs" / "dsex_zenflow_stage2.json").read_text())
        zero["zenflow"] = corpus["zero_optimization"]["zenflow"]
    opt = {"type": "AdamW", "params": dict(HYPER)}
    if name.startswith("muon"):
        opt = {"type": "Muon", "params": {"lr": HYPER["lr"], "muon_lr": 0.02, "adam_lr": HYPER["lr"],
                                          "weight_decay": HYPER["weight_decay"]}}
    return {"train_micro_batch_size_per_gpu": p["micro"], "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": zero, "optimizer": opt,
            "zero_allow_untested_optimizer": True}


def build_model(p: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=16 if not CPU else 4,
                      num_key_value_heads=8 if not CPU else 2, intermediate_size=p["hidden"] * 11 // 4,
                      vocab_size=p["vocab"], tie_word_embeddings=False, max_position_embeddings=max(2048, p["seq"]))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    with torch.device("cpu" if CPU else "cuda"):
        return LlamaForCausalLM(cfg)


def run_one(ns) -> dict:
    import torch
    size = "tiny" if CPU else CONFIGS[ns.config]
    p = SIZES[size]
    device = torch.device("cpu" if CPU else "cuda", 0)
    if not CPU:
        torch.cuda.set_device(0)
    config = ds_config(ns.config, p)
    warmup, timed = (4, 8) if size == "2.8b" or CPU else (3, 10)
    if ns.config.endswith("_ds"):
        if CPU:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # the bench may import DeepSpeed; the library never does
        model = build_model(p)
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    else:
        import fsdpzero
        engine = fsdpzero.initialize(model=build_model(p), config=copy.deepcopy(config))[0]
    g = torch.Generator().manual_seed(1000)
    batches = [torch.randint(0, p["vocab"], (p["micro"], p["seq"]), generator=g).to(device) for _ in range(4)]
    losses, times = [], []
    for i in range(warmup + timed):
        if not CPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = batches[i % len(batches)]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))   # the host sync ends the step (as a training loop's logging does)
        if not CPU:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = times[warmup:]
    row = {"config": ns.config, "size": size, "warmup": warmup, "timed": timed,
           "median_step_s": statistics.median(step), "mean_step_s": statistics.mean(step),
           "losses": losses, "steps_s": times}
    if not CPU:
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        row["gpu"] = torch.cuda.get_device_name()
    path = getattr(engine, "grad_path", None)
    if hasattr(path, "resident_bytes"):   # ZenFlow's own tensors by where they live (weights and grads aside)
        row["zenflow_resident_gib"] = {k: v / 2 ** 30 for k, v in path.resident_bytes().items()}
    import resource
    row["peak_host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return row


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


def derive(rows: list[dict]) -> None:
    by = {r["config"]: r for r in rows if "median_step_s" in r}
    for ours, ref in (("zenflow_ours", "zenflow_ds"), ("zenflow_ours", "offload_ours"), ("muon_z2_ours", "adamw_z2_ours"),
                      ("muon_z2_ours", "muon_z2_ds"), ("muon_offload_z2_ours", "muon_offload_z2_ds")):
        if ours in by and ref in by:
            by[ours].setdefault("note", "")
            by[ours]["note"] += (f"mean {by[ours]['mean_step_s'] / by[ref]['mean_step_s']:.2f}x {ref} "
                                 f"(median {by[ours]['median_step_s'] / by[ref]['median_step_s']:.2f}x); ")


def drive(ns) -> None:
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    start, rows = time.monotonic(), []
    has_ds = importlib.util.find_spec("deepspeed") is not None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "ops"),
                                                                     os.environ.get("PYTHONPATH")]))}
    for name in ns.configs.split(","):
        left = ns.budget_s - (time.monotonic() - start)
        if name.endswith("_ds") and not has_ds:
            rows.append({"config": name, "size": CONFIGS[name], "skipped": "DeepSpeed not importable"})
            continue
        if left < ns.min_left_s:
            rows.append({"config": name, "size": CONFIGS[name], "skipped": f"budget: {left:.0f} s left"})
            continue
        path = out / f"{name}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", __file__,
               "--config", name, "--json", str(path)]
        log = out / f"{name}.log"
        path.unlink(missing_ok=True)
        # its own session: a timeout ends the whole group (DeepSpeed's optimizer process included)
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=left)
                late = None
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                late = f"killed after {left:.0f} s"
        tail = log.read_text(errors="replace")[-300:]
        if path.exists():   # the worker writes its row after the timed steps: a late exit still measured them
            row = json.loads(path.read_text())
            if late or proc.returncode:
                row["note"] = f"{late or f'exit {proc.returncode}'} after writing its row (log: {log.name}); "
            rows.append(row)
        else:
            rows.append({"config": name, "size": CONFIGS[name],
                         "skipped": f"{late or f'exit {proc.returncode}'} (log: {log.name}): {tail!r}"})
    derive(rows)
    (out / "zenflow.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps([{k: v for k, v in r.items() if k not in ("losses", "steps_s")} for r in rows]))
    print(table(rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), help="run one config (under torchrun)")
    ap.add_argument("--json", help="with --config: where its row goes")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="the driver's configs, in order")
    ap.add_argument("--out", default="out/zenflow")
    ap.add_argument("--budget-s", type=float, default=290)
    ap.add_argument("--min-left-s", type=float, default=40)
    ns = ap.parse_args(argv)
    if ns.config:
        row = run_one(ns)
        if ns.json:
            Path(ns.json).write_text(json.dumps(row))
        return
    drive(ns)


if __name__ == "__main__":
    main()
