"""Ulysses (`sequence_parallel_size`) under the Hugging Face Trainer door (fsdpzero.hf.Trainer, `deepspeed=` a
DeepSpeed config), through transformers' own ALST hooks, as transformers 5 + accelerate run DeepSpeed's ALST: the
accelerator's ParallelismConfig(sp_backend="deepspeed") makes the Trainer count batches and steps over world / sp,
wrap the train loader in the Ulysses adapter after preparing it (fsdpzero's UlyssesSPDataLoaderAdapter here), and
take the loss as the mean over the real tokens of each whole sequence; evaluation runs unsplit (accelerate's
disable_in_eval).

2 forked gloo ranks, sp 2 (dp 1), ZeRO 3, a real transformers Llama (4 heads, 2 KV heads, sdpa) in fp32; samples with
right padding, -100 prompt labels and halves with no real label; the size from the config, then from
ParallelismConfig. And (slow) 4 ranks, tensor_parallel.autotp_size 2 x sp 2. Reference: the plain transformers
Trainer, one process, the same seed, data and arguments, its loss per micro-batch a mean over its tokens averaged
over the accumulation window (what transformers' DeepSpeed SP path computes: it turns model_accepts_loss_kwargs off).
Each micro-step's loss (unrounded), each step's grad norm and the eval loss within 1e-5 (fp32; measured <= 4.8e-7 for
both), the same epochs and learning rates, the logged (4-decimal) losses within 1e-4, and the Trainer's total train
batch size counting world / tp / sp. Over 2 epochs: the adapter restarts its pass for the second (DeepSpeed's
hands the Trainer a spent one there, and one optimizer step is lost: 7 steps, not 8).
"""
from __future__ import annotations

import pytest
import torch

from tests.engine_cases import SEQ, VOCAB, build_model
from tests.multirank import run_distributed
from tests.parallel.test_ulysses import dataset

MICRO, GAS, STEPS, SP = 2, 2, 8, 2   # 2 epochs of 16 samples
TOL = 1e-5


def arguments(cls, out: str, **extra):
    return cls(output_dir=out, use_cpu=True, per_device_train_batch_size=MICRO, per_device_eval_batch_size=MICRO,
               gradient_accumulation_steps=GAS, num_train_epochs=2, learning_rate=5e-4, max_grad_norm=1.0,
               lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to="none",
               seed=0, disable_tqdm=True, dataloader_num_workers=0, **extra)


def _train(trainer) -> dict:
    """Train; the per-step log (its loss rounded to 4 decimals by the Trainer), each micro-step's loss unrounded
    (training_step's value), the eval loss and the Trainer's total train batch size."""
    micro, training_step = [], trainer.training_step

    def recorded(*args, **kwargs):
        loss = training_step(*args, **kwargs)
        micro.append(float(loss))
        return loss
    trainer.training_step = recorded
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    return {"steps": [(h["loss"], h["grad_norm"], h["epoch"], h["learning_rate"]) for h in steps], "micro": micro,
            "eval": trainer.evaluate()["eval_loss"], "total batch": trainer.get_total_train_batch_size(trainer.args)}


def check(ours: dict, ref: dict) -> None:
    assert len(ours["steps"]) == len(ref["steps"]) == STEPS, (ours, ref)
    assert len(ours["micro"]) == len(ref["micro"]) == STEPS * GAS, (ours["micro"], ref["micro"])
    for a, b in zip(ours["micro"], ref["micro"]):   # each micro-step: the same sequences (dp 1)
        assert abs(a - b) <= TOL, (ours["micro"], ref["micro"])
    for (loss, norm, epoch, lr), (r_loss, r_norm, r_epoch, r_lr) in zip(ours["steps"], ref["steps"]):
        assert abs(loss - r_loss) <= 1e-4 and abs(norm - r_norm) <= TOL, (ours["steps"], ref["steps"])
        assert epoch == r_epoch and lr == r_lr, (ours["steps"], ref["steps"])
    assert abs(ours["eval"] - ref["eval"]) <= TOL, (ours["eval"], ref["eval"])
    assert ours["total batch"] == ref["total batch"] == MICRO * GAS   # dp = world / tp / sp = 1
    assert all(lr > 0 for *_, lr in ours["steps"])


CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _sequence_parallel(rank, world, out):
    """Twice: the size from the DeepSpeed config, then from accelerate's ParallelismConfig in TrainingArguments (the
    way transformers documents ALST), the config without the key."""
    from accelerate import ParallelismConfig

    from fsdpzero.hf.trainer import Trainer, TrainingArguments
    runs = []
    for config, extra in (({**CONFIG, "sequence_parallel_size": SP}, {}),
                          (CONFIG, {"parallelism_config": ParallelismConfig(sp_backend="deepspeed", sp_size=SP)})):
        model = build_model("llama")
        model.set_attn_implementation("sdpa")
        trainer = Trainer(model=model, args=arguments(TrainingArguments, out, deepspeed=config, **extra),
                          train_dataset=dataset(16), eval_dataset=dataset(4, seed=99))
        assert trainer.engine.plan.sequence_parallel.size == SP
        runs.append(_train(trainer))
    return runs


def _tp_sequence_parallel(rank, world, out):
    """tensor_parallel.autotp_size 2 x sequence_parallel_size 2 on 4 ranks: the loader sharded over the 2 data
    replicas, each sp group joining the 2 replicas' ranks of one tp rank."""
    from fsdpzero.hf.trainer import Trainer, TrainingArguments
    model = build_model("llama")
    model.set_attn_implementation("sdpa")
    config = {**CONFIG, "sequence_parallel_size": SP, "tensor_parallel": {"autotp_size": 2}}
    trainer = Trainer(model=model, args=arguments(TrainingArguments, out, deepspeed=config),
                      train_dataset=dataset(16), eval_dataset=dataset(4, seed=99))
    return _train(trainer)


def _reference(rank, world, out):
    import transformers
    model = build_model("llama")
    model.set_attn_implementation("sdpa")
    trainer = transformers.Trainer(model=model, args=arguments(transformers.TrainingArguments, out),
                                   train_dataset=dataset(16), eval_dataset=dataset(4, seed=99))
    trainer.model_accepts_loss_kwargs = False   # a mean per micro-batch, as under DeepSpeed SP
    return _train(trainer)


@pytest.mark.timeout(600)
def test_trainer_sp2_matches_unsharded(tmp_path):
    import accelerate  # noqa: F401  imported before the ranks fork
    import transformers  # noqa: F401
    ours = run_distributed(_sequence_parallel, 2, str(tmp_path / "sp"), timeout=400)
    ref = run_distributed(_reference, 1, str(tmp_path / "ref"), timeout=300, init_pg=False)[0]
    assert ours[0][0]["steps"] == ours[1][0]["steps"]   # the logged losses are gathered over the ranks
    ours, from_accelerate = ours[0]
    assert from_accelerate == ours
    check(ours, ref)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_tp2_sp2_matches_unsharded(tmp_path):
    import accelerate  # noqa: F401  imported before the ranks fork
    import transformers  # noqa: F401
    ours = run_distributed(_tp_sequence_parallel, 4, str(tmp_path / "tp_sp"), timeout=500)
    ref = run_distributed(_reference, 1, str(tmp_path / "ref"), timeout=300, init_pg=False)[0]
    assert all(o["steps"] == ours[0]["steps"] for o in ours)
    check(ours[0], ref)


def test_auto_values_count_world_over_sp(monkeypatch):
    """The "auto" values: the triad over world / sp ranks, and the schedule's step count over the batches the
    Ulysses adapter hands out (sp per batch of a rank's loader): 16 samples, micro 2, GA 2 -> 4 steps an epoch, as
    the Trainer counts them (len(loader) x sp)."""
    from types import SimpleNamespace

    from fsdpzero.hf.trainer import trainer_context
    monkeypatch.setenv("WORLD_SIZE", "2")
    # TrainingArguments' fields (a real one would set up accelerate's process state in the test process)
    args = SimpleNamespace(per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS, learning_rate=5e-4,
                           weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                           warmup_steps=0, bf16=False, fp16=False, max_steps=-1, num_train_epochs=1,
                           dataloader_drop_last=False)
    ctx = trainer_context(args, build_model("llama"), dataset(16), sp_size=SP)
    assert ctx["world_size"] == 1 and ctx["num_training_steps"] == 4


def test_size_from_either_place_must_agree():
    from types import SimpleNamespace

    from accelerate import ParallelismConfig

    from fsdpzero.hf.trainer import sequence_parallel_size
    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=2)
    raw = {}
    assert sequence_parallel_size(raw, SimpleNamespace(parallelism_config=pc)) == (2, pc)
    assert raw == {"sequence_parallel_size": 2}
    size, made = sequence_parallel_size({"sequence_parallel_size": 2}, SimpleNamespace(parallelism_config=None))
    assert size == 2 and (made.sp_size, made.sp_backend) == (2, "deepspeed")
    assert sequence_parallel_size({}, SimpleNamespace(parallelism_config=None)) == (1, None)
    with pytest.raises(ValueError, match=r"^sequence_parallel_size = 4 in the DeepSpeed config but TrainingArguments "
                                         r"parallelism_config sp_size = 2: make them equal"):
        sequence_parallel_size({"sequence_parallel_size": 4}, SimpleNamespace(parallelism_config=pc))
    with pytest.raises(ValueError, match=r"\{'tp_size': 2\} with sp_size = 2: under fsdpzero only sp_size"):
        sequence_parallel_size({}, SimpleNamespace(parallelism_config=ParallelismConfig(sp_size=2, tp_size=2)))


def test_size_not_dividing_the_world_is_named_under_auto(monkeypatch):
    """sequence_parallel_size larger than the world, the triad "auto" (as HF configs have it): the error names
    sequence_parallel_size, before any process group. It said `train_batch_size: input should be greater than 0,
    got 0` (world // sp counted no data-parallel rank), which names neither the key nor the fix."""
    from types import SimpleNamespace

    from fsdpzero.api import launch_env, make_plan
    from fsdpzero.hf.trainer import trainer_context
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = SimpleNamespace(per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS, learning_rate=5e-4,
                           weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                           warmup_steps=0, bf16=False, fp16=False, max_steps=-1, num_train_epochs=1,
                           dataloader_drop_last=False)
    for sp in (3, 4):
        context = trainer_context(args, build_model("llama"), dataset(16), sp_size=sp)
        with pytest.raises(ValueError, match=rf"sequence_parallel_size: {sp} does not divide the world size 2"):
            make_plan({**CONFIG, "sequence_parallel_size": sp}, launch_env("cpu"), context)
