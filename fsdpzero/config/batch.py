"""The batch-size triad, exactly as DeepSpeed 0.19 fills and checks it (same order, same messages).

train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * data_parallel_size,
with the missing member filled by floor division first, so inconsistent inputs fail the final check.
"""
from __future__ import annotations

from fsdpzero.config.errors import ConfigError, Problem


def resolve_batch(train: int | None, micro: int | None, grad_acc: int | None,
                  world_size: int) -> tuple[int, int, int]:
    """Returns (train_batch_size, micro_batch_size, gradient_accumulation_steps) or raises ConfigError."""
    w = world_size
    if train is not None and micro is not None and grad_acc is not None:
        pass
    elif train is not None and micro is not None:
        grad_acc = train // micro // w
    elif train is not None and grad_acc is not None:
        micro = train // w // grad_acc
    elif micro is not None and grad_acc is not None:
        train = micro * grad_acc * w
    elif train is not None:
        grad_acc, micro = 1, train // w
    elif micro is not None:
        train, grad_acc = micro * w, 1
    else:
        raise ConfigError(Problem("train_batch_size",
                                  "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
                                  "set train_micro_batch_size_per_gpu (and gradient_accumulation_steps)"))
    problems = []
    if train <= 0:
        problems.append(Problem("train_batch_size", f"Train batch size: {train} has to be greater than 0",
                                f"train_batch_size must be at least the data-parallel size {w}"))
    if micro <= 0:
        problems.append(Problem("train_micro_batch_size_per_gpu",
                                f"Micro batch size per gpu: {micro} has to be greater than 0",
                                f"train_batch_size {train} is smaller than world size {w} x accumulation "
                                f"{grad_acc}; raise it or set train_micro_batch_size_per_gpu"))
    if grad_acc <= 0:
        problems.append(Problem("gradient_accumulation_steps",
                                f"Gradient accumulation steps: {grad_acc} has to be greater than 0",
                                f"train_batch_size must be at least micro batch x world size = {micro * w}"))
    if not problems and train != micro * grad_acc * w:
        fix = train // w
        problems.append(Problem(
            "train_batch_size",
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {train} != {micro} * {grad_acc} * {w}",
            f"use train_batch_size = {micro * grad_acc * w}, or drop it and let it be computed"
            + (f" (or a multiple of {w}, e.g. {fix * w})" if fix > 0 and fix * w != micro * grad_acc * w else "")))
    if problems:
        raise ConfigError(problems)
    return train, micro, grad_acc
