"""accelerate's DeepSpeed ALST / Ulysses sequence-parallel loop, written as accelerate 1.15 writes it (its test script
accelerate/test_utils/scripts/external_deps/test_ds_alst_ulysses_sp.py, examples/alst_ulysses_sequence_parallelism/
sp-alst.py): ParallelismConfig(sp_backend="deepspeed") in the Accelerator, prepare(model, optimizer, dl), the sp
group from deepspeed.utils.groups, each rank's loss over its slice from `shift_labels`, and the differentiable
weighted aggregation over the group. Run unchanged by accelerate + real DeepSpeed and by `fsdpzero launch`
(tests/hf/test_accelerate_ulysses.py); nothing here knows which.

    python accelerate_alst_loop.py MODEL OUT --ds_config ds.json [--sp_size 2]

Additions to accelerate's script: the DeepSpeed config goes in through DeepSpeedPlugin(hf_ds_config=...) (the
issue's spelling; accelerate's script takes it from `accelerate launch`'s YAML), the samples mask a prompt of growing
length (-100 labels: the SFT case the aggregation is written for; in the later samples the first slice has no real
token), model.train() before the loop (--eval_mode leaves it out, as accelerate's script does), and rank 0 writes OUT/result.pt: per step the aggregated loss and accelerator.clip_grad_norm_ (under
DeepSpeed: the engine's norm of the step backward ran), and the final full weights.
"""
import argparse
import os

import torch
from deepspeed.runtime.utils import move_to_device
from transformers import AutoModelForCausalLM

from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import ParallelismConfig, set_seed
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("out")
parser.add_argument("--ds_config", required=True)
parser.add_argument("--sp_size", type=int, default=2)
parser.add_argument("--dp_shard_size", type=int, default=1, help="ranks / sp_size (accelerate's docs: 2D SP x DP)")
parser.add_argument("--eval_mode", action="store_true", help="no model.train(), as accelerate's script")
parser.add_argument("--local_rank", type=int, default=-1)   # the DeepSpeed-style launchers pass it
args = parser.parse_args()

set_seed(42)

micro_batch_size = 1

parallelism_config = ParallelismConfig(
    sp_backend="deepspeed",
    sp_size=args.sp_size,
    dp_shard_size=args.dp_shard_size,
    sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length=256,
        sp_seq_length_is_variable=True,
        sp_attn_implementation="sdpa",
    ),
)

accelerator = Accelerator(
    deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=args.ds_config),
    parallelism_config=parallelism_config,
)

model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")

samples = 6
seqlen = 32
g = torch.Generator().manual_seed(1)
input_ids = torch.randint(3, 250, (samples, seqlen), generator=g)
position_ids = torch.arange(seqlen).repeat(samples, 1)
labels = input_ids.clone()
for i in range(samples):
    labels[i, : 3 + 4 * i] = -100   # the prompt

ds = torch.utils.data.TensorDataset(input_ids, position_ids, labels)


def collate_fn(batch):
    input_ids, position_ids, labels = batch[0]
    return dict(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        labels=labels.unsqueeze(0),
    )


dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)

optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

rank = torch.distributed.get_rank()

if rank == 0:
    print(f"DL orig: {len(dl)} samples")

model, optimizer, dl = accelerator.prepare(model, optimizer, dl)

if rank == 0:
    print(f"DL w/ adapter: {len(dl)} samples")

sp_size = parallelism_config.sp_size if parallelism_config else 1
if sp_size > 1:
    from deepspeed.utils import groups

    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = parallelism_config.sp_size

unwrapped_model = accelerator.unwrap_model(model)
if not args.eval_mode:
    # accelerate's script leaves the model in from_pretrained's eval mode, where accelerate's disable_in_eval=True
    # turns sequence parallelism off in attention (each rank attends within its own slice), with DeepSpeed too
    model.train()

history = []
# Normal training loop
for iter, batch in enumerate(dl):
    optimizer.zero_grad()

    if rank == 0:
        print(f"batch {iter}: seqlen: {len(batch['input_ids'][0])}")
    batch = move_to_device(batch, model.device)
    outputs = model(**batch)

    shift_labels = batch["shift_labels"]
    loss = unwrapped_model.loss_function(
        logits=outputs.logits,
        labels=None,
        shift_labels=shift_labels,
        vocab_size=unwrapped_model.config.vocab_size,
    )

    if sp_size > 1:
        # differentiable weighted per-shard-loss aggregation across ranks
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        # special dealing with SFT that has prompt tokens that aren't used in loss computation
        good_tokens = (shift_labels != -100).view(-1).sum()
        good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
        total_loss = sum(
            losses_per_rank[rank] * good_tokens_per_rank[rank]
            for rank in range(sp_world_size)
            if good_tokens_per_rank[rank] > 0
        )
        total_good_tokens = sum(good_tokens_per_rank)
        loss = total_loss / max(total_good_tokens, 1)

    if rank == 0:
        accelerator.print(f"{iter}: {loss=}")
    accelerator.log(dict(train_loss=loss, step=iter))

    accelerator.backward(loss)
    optimizer.step()
    history.append({"loss": loss.item(), "grad_norm": float(accelerator.clip_grad_norm_(model.parameters(), 1.0))})

weights = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    torch.save({"history": history, "weights": {k: v.float() for k, v in weights.items()},
                "world": accelerator.num_processes, "batches": len(dl)}, os.path.join(args.out, "result.pt"))
accelerator.wait_for_everyone()
accelerator.end_training()
