"""Make the DeepSpeed checkpoint fixtures in tests/assets/deepspeed_ckpts/ with real DeepSpeed (0.19.8).

Two sets: deepspeed_ckpts/ made on the CPU machine (DS_ACCELERATOR=cpu, gloo, 2 ranks, stages 0-3) and
deepspeed_ckpts_gpu/ made on 2 GPUs with NCCL (stages 1-3, `--gpu`), so the reader is proven on files written by
DeepSpeed's GPU code paths too (FusedAdam-free: torch_adam, so both sets hold torch AdamW states). For every variant
this script

  1. trains a tiny GPT-2 (tied wte/lm_head, a frozen wpe) for SAVE_STEP optimizer steps, gradient accumulation 2,
  2. saves a checkpoint (tag global_step{SAVE_STEP}),
  3. trains CONT_STEPS more steps and records the losses DeepSpeed sees (the curve a resume must continue),
  4. on rank 0, runs DeepSpeed's own zero_to_fp32 on the checkpoint and stores its result as safetensors.

Run from the repository root (needs deepspeed from the [oracle] extra; this script is the only place that imports it):
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/generators/make_ds_ckpts.py
    torchrun --standalone --nproc_per_node=2 tests/generators/make_ds_ckpts.py --gpu      # on a 2-GPU machine
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

GPU = "--gpu" in sys.argv
OUT = Path(__file__).resolve().parents[1] / "assets" / ("deepspeed_ckpts_gpu" if GPU else "deepspeed_ckpts")
SAVE_STEP, CONT_STEPS, GA, MICRO, SEQ, WORLD = 3, 3, 2, 2, 16, 2
VOCAB, HIDDEN, HEADS = 63, 15, 3  # odd sizes: parameters with odd numel exercise DeepSpeed's partition padding
LR, WD = 1e-2, 0.01
# (name, zero stage, precision)
VARIANTS = [("z0_fp32", 0, "fp32"), ("z0_bf16", 0, "bf16"), ("z0_fp16", 0, "fp16"),
            ("z1_fp32", 1, "fp32"), ("z2_fp32", 2, "fp32"), ("z3_fp32", 3, "fp32"),
            ("z1_bf16", 1, "bf16"), ("z2_bf16", 2, "bf16"), ("z3_bf16", 3, "bf16"),
            ("z1_fp16", 1, "fp16"), ("z2_fp16", 2, "fp16"), ("z3_fp16", 3, "fp16")]
if GPU:
    VARIANTS = [v for v in VARIANTS if v[1] > 0]


def model_config() -> GPT2Config:
    return GPT2Config(n_layer=2, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(model_config()).float()
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter: exercises DS's frozen-param paths
    return model


def make_data() -> torch.Tensor:
    """Token ids [step, micro-step, rank, micro-batch, seq] for SAVE_STEP + CONT_STEPS steps."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (SAVE_STEP + CONT_STEPS, GA, WORLD, MICRO, SEQ), generator=g)


def ds_config(stage: int, precision: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.999],
                                                  "eps": 1e-8, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10_000, "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":  # a small initial scale and window, so the saved scaler state is not the default one
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
    if stage == 3:  # shard every parameter (the default threshold would keep all of this tiny model whole)
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0)
    return cfg


def train_steps(engine, data: torch.Tensor, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        total = torch.zeros((), device=data.device)
        for micro in range(GA):
            ids = data[step, micro, rank]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (GA * WORLD))
    return losses


def main() -> None:
    import deepspeed
    import importlib
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if GPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        deepspeed.init_distributed(dist_backend="nccl")
    else:
        # skip a 40 s JIT build of a CPU all-reduce we do not need (the module itself: `import deepspeed.comm.torch
        # as m` binds torch, which deepspeed.comm re-exports)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        # DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels; the checkpoint format does
        # not depend on that, and the tiny model trains fine in the slow fp16 path, so allow it for the fixtures.
        type(get_accelerator()).is_fp16_supported = lambda self: True
        torch.set_num_threads(1)
        deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    data = make_data()
    record = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if GPU else "cpu", "save_step": SAVE_STEP,
              "cont_steps": CONT_STEPS, "grad_accum": GA, "lr": LR, "weight_decay": WD, "variants": {}}
    if rank == 0:
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir(parents=True)
        save_file({"input_ids": data.contiguous()}, OUT / "data.safetensors")  # CPU tensor: before the move
        model_config().save_pretrained(OUT)  # config.json of the model all variants train
    dist.barrier()
    if GPU:
        data = data.cuda()
    for name, stage, precision in VARIANTS:
        model = make_model().to(data.device)
        cfg = ds_config(stage, precision)
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
        before = train_steps(engine, data, range(SAVE_STEP), rank)
        save_dir = OUT / name
        engine.save_checkpoint(str(save_dir))  # tag global_step{SAVE_STEP}, writes `latest`
        after = train_steps(engine, data, range(SAVE_STEP, SAVE_STEP + CONT_STEPS), rank)
        dist.barrier()
        entry = {"stage": stage, "precision": precision, "config": cfg, "losses_before_save": before,
                 "losses_after_save": after, "tag": f"global_step{engine.global_steps - CONT_STEPS}"}
        if precision == "fp16":
            entry["loss_scale_at_end"] = float(engine.optimizer.loss_scale)
        if rank == 0:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DS copies its scripts in; not needed here
                (save_dir / script).unlink(missing_ok=True)
            if stage > 0:
                sd = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
                # zero_to_fp32 re-aliases tied params to one tensor; safetensors wants distinct storage
                save_file({k: v.detach().clone().contiguous() for k, v in sd.items()},
                          save_dir / "zero_to_fp32.safetensors")
            record["variants"][name] = entry
        del engine, model
        dist.barrier()
    if rank == 0:
        (OUT / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    if not GPU:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
