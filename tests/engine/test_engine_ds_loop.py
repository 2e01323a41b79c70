"""A DeepSpeed training loop (examples/ds_cifar_style.py, DeepSpeedExamples' CIFAR shape) runs with fsdpzero when
only its import changes, and gives DeepSpeed's own losses (2 ranks, ZeRO-2, grad accumulation 2, clipping 1.0,
torch AdamW). DeepSpeed runs the very same source with `import deepspeed` put back."""
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401

from tests.multirank import run_distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ds_cifar_style.py"
IMPORT = "import fsdpzero as deepspeed   # the DeepSpeed version: `import deepspeed`"
CONFIG = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
          "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "steps_per_print": 4}


def _load(use_deepspeed: bool):
    src = EXAMPLE.read_text()
    assert IMPORT in src
    if use_deepspeed:
        src = src.replace(IMPORT, "import deepspeed")
    mod = types.ModuleType("ds_cifar_style")
    exec(compile(src, str(EXAMPLE), "exec"), mod.__dict__)
    return mod


def _run(rank, world, use_deepspeed):
    os.environ["DS_ACCELERATOR"] = "cpu"
    sys.argv = ["ds_cifar_style.py", f"--local_rank={rank}"]     # as DeepSpeed's launcher passes it
    return _load(use_deepspeed).main(argv=sys.argv[1:], config=dict(CONFIG))


def test_deepspeed_loop_runs_unchanged_but_for_the_import():
    ours = run_distributed(_run, 2, False, timeout=180, init_pg=False)
    assert len(ours[0]) == 16 and all(torch.isfinite(torch.tensor(r)).all() for r in ours)
    pytest.importorskip("deepspeed")
    theirs = run_distributed(_run, 2, True, timeout=300, init_pg=False)
    for rank in range(2):
        diff = max(abs(a - b) for a, b in zip(ours[rank], theirs[rank]))
        assert diff <= 1e-5, f"rank {rank}: losses differ from DeepSpeed by {diff:.3g}\n{ours[rank]}\n{theirs[rank]}"
