"""An accelerate training loop with DeepSpeed, written as accelerate's docs write one; run unchanged by real
DeepSpeed (tests/hf/test_accelerate_oracle.py) and by `fsdpzero launch` (the shim). Nothing here knows which.

    python loop.py MODEL OUT --ds_config ds.json [--steps 6] [--save_at 3] [--resume_from DIR]
    python loop.py MODEL OUT --zero_stage 2 [--offload_optimizer_device cpu] [--gradient_accumulation_steps 2]
    accelerate launch --config_file deepspeed.yaml loop.py MODEL OUT     # neither: the launch config decides

MODEL is a from_pretrained folder (loaded after the Accelerator: at ZeRO-3, sharded as it loads).

Writes OUT/result.pt on the main process: per optimizer step the mean loss over ranks (gathered) and
clip_grad_norm_'s value, the learning rate, and the final full weights (get_state_dict)."""
import argparse
import json
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import DummyOptim, DummyScheduler, set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("out")
parser.add_argument("--ds_config", default=None)
parser.add_argument("--zero_stage", type=int, default=None)
parser.add_argument("--offload_optimizer_device", default=None)
parser.add_argument("--offload_param_device", default=None)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--zero3_init_flag", action="store_true")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save_at", type=int, default=None, help="save_state after this many optimizer steps")
parser.add_argument("--resume_from", default=None)
parser.add_argument("--teacher_config", default=None, help="a second DeepSpeedPlugin: a frozen teacher (distillation)")
parser.add_argument("--local_rank", type=int, default=-1)   # the DeepSpeed-style launchers pass it
args = parser.parse_args()

if args.ds_config is not None:
    plugin = DeepSpeedPlugin(hf_ds_config=args.ds_config, zero3_init_flag=args.zero3_init_flag or None)
elif args.zero_stage is None:
    plugin = None               # accelerate's launch config (ACCELERATE_* in the environment) says what to run
else:
    plugin = DeepSpeedPlugin(zero_stage=args.zero_stage, gradient_accumulation_steps=args.gradient_accumulation_steps,
                             gradient_clipping=0.5, offload_optimizer_device=args.offload_optimizer_device,
                             offload_param_device=args.offload_param_device, zero3_init_flag=args.zero3_init_flag,
                             zero3_save_16bit_model=True)
if args.teacher_config is not None:      # accelerate's several-plugins usage: one config per model
    plugin = {"student": plugin, "teacher": DeepSpeedPlugin(hf_ds_config=args.teacher_config)}
accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=args.gradient_accumulation_steps)
set_seed(0)

model = AutoModelForCausalLM.from_pretrained(args.model)   # after the Accelerator: zero3_init_flag applies

g = torch.Generator().manual_seed(1)
tokens = torch.randint(0, 256, (96, 32), generator=g)
loader = DataLoader(TensorDataset(tokens), batch_size=2, shuffle=False)

ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
if "optimizer" in ds_config:
    optimizer = DummyOptim(model.parameters(), lr=3e-3, weight_decay=0.1)
else:
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, eps=1e-6)
if "scheduler" in ds_config:
    scheduler = DummyScheduler(optimizer, total_num_steps=args.steps * 2, warmup_num_steps=2)
elif isinstance(optimizer, DummyOptim):
    scheduler = None
else:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))

prepared = accelerator.prepare(model, optimizer, loader, *([scheduler] if scheduler is not None else []))
model, optimizer, loader = prepared[:3]
scheduler = prepared[3] if scheduler is not None else None
teacher = None
if args.teacher_config is not None:
    accelerator.state.select_deepspeed_plugin("teacher")
    teacher = AutoModelForCausalLM.from_pretrained(args.model)
    teacher = accelerator.prepare(teacher)
    teacher.eval()
    accelerator.state.select_deepspeed_plugin("student")

done = 0
if args.resume_from:
    accelerator.load_state(args.resume_from)
    with open(os.path.join(args.resume_from, "progress.json")) as f:
        done = json.load(f)["steps"]

history = []
step_losses = []
model.train()
batches = iter(loader)
for _ in range(done * args.gradient_accumulation_steps):   # the batches the saved run consumed
    next(batches)
while done < args.steps:
    (batch,) = next(batches)
    with accelerator.accumulate(model):
        out = model(input_ids=batch, labels=batch)
        loss = out.loss
        if teacher is not None:
            with torch.no_grad():
                target = torch.softmax(teacher(input_ids=batch).logits, dim=-1)
            loss = loss + 0.5 * torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten(0, 1))
        accelerator.backward(loss)
        step_losses.append(accelerator.gather(loss.detach()).mean().item())
        if accelerator.sync_gradients:
            norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    if accelerator.sync_gradients:
        done += 1
        history.append({"loss": sum(step_losses) / len(step_losses), "grad_norm": float(norm),
                        "lr": optimizer.param_groups[0]["lr"]})
        step_losses = []
        if args.save_at == done:
            where = os.path.join(args.out, "state")
            accelerator.save_state(where)
            if accelerator.is_main_process:
                with open(os.path.join(where, "progress.json"), "w") as f:
                    json.dump({"steps": done}, f)
            accelerator.wait_for_everyone()

weights = accelerator.get_state_dict(model)
unwrapped = accelerator.unwrap_model(model)
accelerator.save_model(model, os.path.join(args.out, "model"))
if accelerator.is_main_process:
    torch.save({"history": history, "weights": {k: v.float() for k, v in weights.items()},
                "unwrapped": type(unwrapped).__name__, "world": accelerator.num_processes},
               os.path.join(args.out, "result.pt"))
accelerator.wait_for_everyone()
accelerator.end_training()
