"""offload_optimizer.super_offload / cpuadam_cores_perc: DeepSpeed 0.19.8 reads them in its stage-3 optimizer only
(SuperOffloadCPUOptimizer: PyTorch gets int((1 - cpuadam_cores_perc) * n) of the n cores, CPU Adam the rest). At stage
3 fsdpzero's offload path gives its CPU step that share of this rank's threads; at stage 2 nothing changes, as in
DeepSpeed. One gloo rank, 4 torch threads (what the CPU step gets on a CPU-only run), a tiny Llama."""
import pytest
import torch

from tests.multirank import run_distributed


def _threads(rank, world, stage, super_offload, perc):
    import fsdpzero
    from tests.engine.test_oracle_deepspeed import _model
    import os
    os.environ["OMP_NUM_THREADS"] = "4"   # a CPU-only run's CPU step keeps the user's thread setting
    torch.set_num_threads(4)
    oo = {"device": "cpu", "pin_memory": False, "super_offload": super_offload, "cpuadam_cores_perc": perc}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "offload_optimizer": oo}}
    model = _model("llama")
    engine = fsdpzero.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    x = torch.randint(0, 128, (1, 8))
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    threads = engine.grad_path.threads
    engine.destroy()
    return threads


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,super_offload,perc,threads", [(3, True, 0.5, 2), (3, True, 0.8, 4), (3, True, 0.3, 2),
                                                              (3, False, 0.5, 4), (2, True, 0.5, 4)])
def test_cpuadam_cores_perc_sets_the_cpu_step_threads(stage, super_offload, perc, threads):
    """4 threads: 0.5 keeps 4 - int(0.5 x 4) = 2; 0.8 keeps 4 - int(0.8) = 4; 0.3 keeps 4 - int(2.8) = 2; without
    super_offload, or at stage 2, all 4."""
    assert run_distributed(_threads, 1, stage, super_offload, perc, timeout=240)[0] == threads
