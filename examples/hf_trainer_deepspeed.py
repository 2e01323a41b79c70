"""A Hugging Face Trainer script written for DeepSpeed, with nothing of fsdpzero in it. Both run it as it is:

    deepspeed --num_gpus 2 examples/hf_trainer_deepspeed.py --deepspeed tests/ds_configs/hf_transformers_zero3.json
    fsdpzero launch --num_gpus 2 examples/hf_trainer_deepspeed.py --deepspeed tests/ds_configs/hf_transformers_zero3.json

(`fsdpzero launch` on a machine without GPUs: 2 gloo processes.) A ~0.2M-parameter Llama, built from a config,
learns the bytes of CPython's own documentation (`pydoc_data.topics`, always installed) for --max_steps steps
(default 20), then `save_model` writes a folder plain `from_pretrained` loads. Any TrainingArguments flag works
(--output_dir, --learning_rate, --bf16, ...); the config's "auto" values are filled from them. To resume, save
checkpoints (`--save_strategy steps --save_steps 10`) and pass `--resume_from_checkpoint OUTPUT_DIR/checkpoint-10`,
as Hugging Face's example scripts do.
"""
import sys

import deepspeed
import torch
from pydoc_data.topics import topics
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

SEQ = 64


def byte_windows(n: int) -> list[dict]:
    data = torch.tensor(list("\n".join(topics[k] for k in sorted(topics)).encode()[: n * SEQ]))
    return [{"input_ids": w, "labels": w} for w in data.view(n, SEQ)]


def main() -> None:
    defaults = ["--output_dir", "outputs/hf_trainer_deepspeed", "--max_steps", "20", "--learning_rate", "3e-3",
                "--per_device_train_batch_size", "4", "--logging_steps", "5", "--save_strategy", "no",
                "--report_to", "none"]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(defaults + sys.argv[1:])
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=SEQ, tie_word_embeddings=False))
    trainer = Trainer(model=model, args=args, train_dataset=byte_windows(512))
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)   # None: from the start
    trainer.save_model(f"{args.output_dir}/final")
    # DeepSpeed's idiom for reading a ZeRO-3-partitioned weight whole (every rank enters: it is collective)
    with deepspeed.zero.GatheredParameters(model.lm_head.weight):
        head = model.lm_head.weight
        gathered = f"{type(head).__name__} {tuple(head.shape)}, norm {head.detach().float().norm().item():.6f}"
    if args.process_index == 0:
        print(f"train loss {result.training_loss:.3f} after {result.global_step} steps on {args.world_size} "
              f"process(es) (deepspeed {deepspeed.__version__}); model saved to {args.output_dir}/final")
        print(f"lm_head.weight gathered: {gathered}")


if __name__ == "__main__":
    main()
