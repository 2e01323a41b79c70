"""Run by tests/engine/test_clean_exit.py under torchrun (2 gloo ranks): a short training run that ends the way
scripts do, without engine.destroy(), while work still runs beside the loop: an NVMe-offload engine (aio engines,
swap files), a CPU-offload engine whose overlapped CPU step (FSDPZERO_OFFLOAD_OVERLAP=1) is still running when the
script returns, a checkpoint saved and loaded, and a last async save in flight. The process must exit 0.

    torchrun --nproc_per_node 2 tests/engine/exit_script.py <workdir> <hidden size>
"""
import dataclasses
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fsdpzero  # noqa: E402
from fsdpzero.plan import OffloadPlan  # noqa: E402
from tests.engine_cases import batches, build_model, make_plan  # noqa: E402


def offload_plan(stage, device, world, nvme_path=None):
    return dataclasses.replace(make_plan(stage=stage, world=world), offload=OffloadPlan(
        optimizer_device=device, optimizer_nvme_path=nvme_path, pin_memory=False))


def train(engine, rank, steps, on_step=None):
    for i, step in enumerate(batches(steps, 1, 4)):
        x = step[0][rank * 2:(rank + 1) * 2]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        if on_step is not None:
            on_step(i)


def main():
    workdir, hidden = sys.argv[1], int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    nvme = os.path.join(workdir, f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    nvme_engine = fsdpzero.wrap(build_model("llama"), offload_plan(3, "nvme", world, nvme))
    train(nvme_engine, rank, 2)

    torch.manual_seed(0)   # big enough that the last CPU step is still running when the script returns
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                         max_position_embeddings=64))
    engine = fsdpzero.wrap(model, offload_plan(2, "cpu", world))
    ckpt = os.path.join(workdir, "ckpt")

    def save_and_load(i):
        if i == 1:
            engine.save_checkpoint(ckpt)
            engine.load_checkpoint(ckpt)
        if i == 2:
            engine.save_checkpoint(ckpt, tag="async", async_save=True)   # completed at exit
    train(engine, rank, 4, save_and_load)
    worker = getattr(engine.grad_path, "_worker", None)
    print(f"finished rank {rank} step_running={worker is not None and worker.is_alive()}", flush=True)


if __name__ == "__main__":
    main()
