"""Unchanged DeepSpeed scripts on fsdpzero, for processes started by `fsdpzero launch` only.

`fsdpzero launch` runs each rank as `python -m fsdpzero.compat.bootstrap SCRIPT ARGS`, which calls
`shim.install()` and then runs the script as `__main__`. Nothing here is imported by the library, and nothing
changes a Python process that `fsdpzero launch` did not start: a plain `import deepspeed` elsewhere is DeepSpeed.

- `shim.py`: import hooks. `deepspeed` (and `deepspeed.zero`, `deepspeed.comm`) become fsdpzero's stand-ins;
  when `transformers.training_args` loads, TrainingArguments keeps `deepspeed=` for fsdpzero instead of DeepSpeed;
  when `transformers.trainer` loads, `Trainer` becomes fsdpzero.hf's Trainer (so every Trainer subclass defined
  afterwards, Seq2SeqTrainer or a user's, runs on fsdpzero too).
- `deepspeed.py`: what the stand-in `deepspeed` module offers (initialize, init_distributed, add_config_arguments,
  zero, comm, DeepSpeedEngine); `submodules.py`: the deepspeed.* names accelerate imports; `comm.py`: deepspeed.comm.
- `accelerate_config.py`: accelerate's launch YAML for DeepSpeed, read by `fsdpzero launch --config_file` (pure).
- `bootstrap.py`: the per-rank entry point.
"""
