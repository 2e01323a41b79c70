"""The Hugging Face wing: `from fsdpzero.hf import Trainer, TrainingArguments` runs a DeepSpeed Trainer script on
fsdpzero; `from_pretrained` loads a model sharded from the first byte; `generate` keeps ranks in step;
`HfDeepSpeedConfig(ds_config)`, kept alive, makes transformers' own `from_pretrained` load sharded (the guide's
Trainer-less ZeRO-3 inference). Needs the `[hf]` extra (transformers, accelerate)."""
from fsdpzero.hf.lora import save_merged_model  # noqa: F401
from fsdpzero.hf.trainer import (  # noqa: F401
    Trainer, TrainingArguments, from_pretrained, generate, load_sharded_safetensors, trainer_context,
)
from fsdpzero.hf.zero3 import HfDeepSpeedConfig, is_deepspeed_zero3_enabled  # noqa: F401
