#!/usr/bin/env python
# The Hugging Face DeepSpeed guide's ZeRO inference script (t0.py: "Non-Trainer DeepSpeed integration"), run on
# fsdpzero. Changed from the guide: the two imports (marked), the model name may come from $T0_MODEL (the tests use
# a small local model), the two CUDA-only lines are guarded so that CPU ranks (gloo) run it too, and ranks past 1 take
# the second text (the guide's `elif rank == 1` left them without one: a NameError on 4 or 8 GPUs). The ds_config is
# the guide's, with its non-integer `0.9 * d_model**2` bucket size (rounded, with a note in the startup report).
#
# To deploy on 2 GPUs (or 2 CPU processes):
#
#   torchrun --nproc_per_node=2 examples/zero_inference_t0.py
#
# The model is built on the meta device while `dschf` is alive and each rank reads only its shard of every tensor
# at initialize; ZeRO-3 with the parameters offloaded to the CPU, the ranks generating in step (synced_gpus).

from transformers import AutoTokenizer, AutoConfig, AutoModelForSeq2SeqLM
from fsdpzero.hf import HfDeepSpeedConfig          # was: from transformers.integrations import HfDeepSpeedConfig
import fsdpzero as deepspeed                       # was: import deepspeed
import os
import torch

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # To avoid warnings about parallelism in tokenizers

# distributed setup
local_rank = int(os.getenv("LOCAL_RANK", "0"))
world_size = int(os.getenv("WORLD_SIZE", "1"))
if torch.cuda.is_available():
    torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
deepspeed.init_distributed()

model_name = os.environ.get("T0_MODEL", "bigscience/T0_3B")

config = AutoConfig.from_pretrained(model_name)
model_hidden_size = config.d_model

# batch size has to be divisible by world_size, but can be bigger than world_size
train_batch_size = 1 * world_size

ds_config = {
    "fp16": {
        "enabled": False
    },
    "bf16": {
        "enabled": False
    },
    "zero_optimization": {
        "stage": 3,
        "offload_param": {
            "device": "cpu",
            "pin_memory": True
        },
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": model_hidden_size * model_hidden_size,
        "stage3_prefetch_bucket_size": 0.9 * model_hidden_size * model_hidden_size,
        "stage3_param_persistence_threshold": 10 * model_hidden_size
    },
    "steps_per_print": 2000,
    "train_batch_size": train_batch_size,
    "train_micro_batch_size_per_gpu": 1,
    "wall_clock_breakdown": False
}

# it has to be run before loading the model AutoModelForSeq2SeqLM.from_pretrained(model_name)
dschf = HfDeepSpeedConfig(ds_config)  # keep this object alive

# now a model can be loaded.
model = AutoModelForSeq2SeqLM.from_pretrained(model_name)

# initialise Deepspeed ZeRO and store only the engine object
ds_engine = deepspeed.initialize(model=model, config_params=ds_config)[0]
ds_engine.module.eval()  # inference

# Deepspeed ZeRO can process unrelated inputs on each GPU. So for 2 gpus you process 2 inputs at once.
rank = torch.distributed.get_rank()
if rank == 0:
    text_in = "Is this review positive or negative? Review: this is the best cast iron skillet you will ever buy"
else:  # was: elif rank == 1:
    text_in = "Is this review positive or negative? Review: this is the worst restaurant ever"

tokenizer = AutoTokenizer.from_pretrained(model_name)
inputs = tokenizer.encode(text_in, return_tensors="pt").to(device=device)
with torch.no_grad():
    outputs = ds_engine.module.generate(inputs, synced_gpus=True)
text_out = tokenizer.decode(outputs[0], skip_special_tokens=True)
print(f"rank{rank}:\n   in={text_in}\n  out={text_out}")
