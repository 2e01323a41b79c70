"""Checkpoint save/load time: fsdpzero (DCP) vs DeepSpeed, same model, same ZeRO-3 bf16 config, same ranks.

    torchrun --standalone --nproc_per_node=2 bench/ckpt.py --impl fsdpzero --dir /tmp/ckb
    torchrun --standalone --nproc_per_node=2 bench/ckpt.py --impl deepspeed --dir /tmp/ckb

Default model: the 0.89 B Llama of shared/spec/device_anchors.md. One training step fills the Adam state, then
`--repeats` x (save, fresh-engine load) are timed on rank 0 between barriers (cuda synchronized); fsdpzero also
times async_save's blocking part and save_16bit_model. Prints one JSON line per measurement on rank 0.
`--tiny` runs a small model on CPU/gloo (smoke test; DeepSpeed needs DS_ACCELERATOR=cpu there).
Loads follow their save at once, so they may read from the page cache (the same for both implementations).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "ops"))   # fsdpzero_ops, from the checkout


def ds_config(micro: int) -> dict:
    torch_adam = {} if torch.cuda.is_available() else {"torch_adam": True}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_gather_16bit_weights_on_model_save": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, **torch_adam}},
            "steps_per_print": 10**9}


def make_model(tiny: bool) -> torch.nn.Module:
    torch.manual_seed(1234)
    if tiny:
        cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=256, bos_token_id=0, eos_token_id=1)
    else:
        cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                          intermediate_size=5632, vocab_size=32000, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def build(impl: str, tiny: bool, micro: int):
    model = make_model(tiny)
    if impl == "deepspeed":
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(micro))
    else:
        from fsdpzero.api import wrap
        engine = wrap(model, ds_config(micro))
    return engine


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["fsdpzero", "deepspeed"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.impl == "deepspeed":
        import deepspeed
        if not torch.cuda.is_available():  # CPU smoke: skip JIT builds of a shm all-reduce and FusedAdam
            # the module itself: `import deepspeed.comm.torch as m` binds torch, which deepspeed.comm re-exports
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed()
    else:   # gloo on a CPU-only torch: the default group's backend is "undefined" there, which fsdpzero takes for NCCL
        dist.init_process_group(None if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank = dist.get_rank()
    root = Path(args.dir) / args.impl
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    micro, seq = (2, 16) if args.tiny else (1, 512)
    engine = build(args.impl, args.tiny, micro)
    ids = torch.randint(0, engine.module.config.vocab_size, (micro, seq), device=engine.device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    n_params = sum(p.numel() for p in make_model(args.tiny).parameters()) if rank == 0 else 0
    results = {"save_s": [], "load_s": []}
    size = 0
    for i in range(args.repeats):
        results["save_s"].append(timed(lambda: engine.save_checkpoint(str(root), tag=f"t{i}")))
        fresh = build(args.impl, args.tiny, micro)
        results["load_s"].append(timed(lambda: fresh.load_checkpoint(str(root), tag=f"t{i}")))
        fresh = None  # free the loaded engine before the next build (`del` reads to pyflakes as an undefined name)
        if rank == 0:  # keep the disk bounded: a 0.89 B model's checkpoint is ~11 GB
            size = sum(f.stat().st_size for f in (root / f"t{i}").rglob("*") if f.is_file())
            shutil.rmtree(root / f"t{i}")
        dist.barrier()
    if args.impl == "fsdpzero":
        from fsdpzero.checkpoint.dcp import wait_for_pending_save
        results["async_blocking_s"] = [timed(lambda: engine.save_checkpoint(str(root), tag="async", async_save=True))]
        results["async_total_s"] = [results["async_blocking_s"][0] + timed(wait_for_pending_save)]
    results["save_16bit_s"] = [timed(lambda: engine.save_16bit_model(str(root / "hf")))]
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        summary = {k: round(statistics.median(v), 3) for k, v in results.items()}
        print(json.dumps({"impl": args.impl, "world": dist.get_world_size(), "params": n_params,
                          "ckpt_bytes": size, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                          else "cpu", **summary, "raw": results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
