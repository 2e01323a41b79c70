"""accelerate's own DeepSpeed ALST door on fsdpzero: Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...),
parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)) in the user's loop, the loop written as
accelerate's ALST script writes it (tests/hf/accelerate_alst_loop.py, unchanged between runs), on 2 forked gloo ranks
through fsdpzero's per-rank launch entry (fsdpzero.compat.bootstrap, what `fsdpzero launch` runs): accelerate's
prepare registers the Ulysses attention and wraps the loader through the `deepspeed.*` stand-ins
(fsdpzero/compat/sequence_parallel.py), the loop reads its sp group from deepspeed.utils.groups.

Reference: the unsharded run, one process, a plain transformers loop over the same samples in the same order (the
adapter hands the group rank 0's sample, then rank 1's), each step's loss the mean over the real tokens of the whole
sequence, torch.optim.Adam. Per-step losses and grad norms, and the final weights, within 1e-5 (fp32) at ZeRO 2 and
3. Oracle (slow): the same loop under accelerate + real DeepSpeed 0.19.8 (DS_ACCELERATOR=cpu; accelerate joins gloo
through the small CPU patch test_accelerate_oracle.py keeps) at ZeRO 3: same losses, norms and weights.
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  imported before forking ranks
import accelerate  # noqa: F401

from tests.hf.cases import tiny_llama_dir as _model_dir
from tests.hf.cases import fresh_accelerate as _fresh_accelerate
from tests.hf.cases import loop_result as _result
from tests.hf.cases import write_json
from tests.multirank import run_distributed

SCRIPT = str(Path(__file__).with_name("accelerate_alst_loop.py"))
TOL = 1e-5
STEPS = 6   # the loop's samples: one whole sequence a step


def config(stage: int) -> dict:
    # no clipping: at ZeRO 1/2 DeepSpeed's ALST norm is sp x the unsharded one (tests/parallel/test_ulysses_oracle.py)
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}


def _argv(model: str, out: str, stage: int, flags: list[str]) -> list[str]:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "ds_config.json")
    write_json(path, config(stage))
    return [SCRIPT, model, out, "--ds_config", path, *flags]


def _ours(rank, world, model, out, stage, flags):
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]           # another test module may have imported the real one in the parent
    _fresh_accelerate()
    from fsdpzero.compat import bootstrap
    bootstrap.main(_argv(model, out, stage, flags))
    from fsdpzero.compat import sequence_parallel   # the mpu deepspeed.utils.groups handed the loop
    result = _result(out, rank)
    if result is not None:
        result["loss_in_loop"] = sequence_parallel.mpu.loss_in_loop
    return result


def _deepspeed(rank, world, model, out, stage, flags):
    os.environ["DS_ACCELERATOR"] = "cpu"
    _fresh_accelerate()
    # accelerate runs DeepSpeed only with cpu=False and then joins no process group without GPUs: gloo, as a CPU rank
    from accelerate.state import PartialState
    original = PartialState._prepare_backend
    PartialState._prepare_backend = lambda self, cpu=False, sagemaker_dp=False, backend=None: original(
        self, True, sagemaker_dp, backend)
    sys.argv = _argv(model, out, stage, flags)
    runpy.run_path(SCRIPT, run_name="__main__")
    return _result(out, rank)


def _reference(rank, world, model, out):
    """The unsharded run: the loop's samples in the loop's order, whole sequences, the model's own loss."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(42)
    m = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa")
    samples, seqlen = 6, 32
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 250, (samples, seqlen), generator=g)
    labels = input_ids.clone()
    for i in range(samples):
        labels[i, : 3 + 4 * i] = -100
    optimizer = torch.optim.Adam(m.parameters(), lr=1e-3)
    history = []
    for i in range(samples):
        loss = m(input_ids=input_ids[i:i + 1], position_ids=torch.arange(seqlen)[None], labels=labels[i:i + 1]).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        history.append({"loss": loss.item(), "grad_norm": float(norm)})
    return {"history": history, "weights": {k: v.detach().clone() for k, v in m.state_dict().items()}}


_RUNS: dict = {}


def _run(side: str, stage: int, tmp_path_factory, flags=()):
    key = (side, stage, tuple(flags))
    if key not in _RUNS:
        model = _model_dir(tmp_path_factory)
        out = str(tmp_path_factory.mktemp(f"alst_{side}_{stage}"))
        if side == "reference":
            _RUNS[key] = run_distributed(_reference, 1, model, out, timeout=300, init_pg=False)[0]
        else:
            fn = _deepspeed if side == "deepspeed" else _ours
            _RUNS[key] = run_distributed(fn, 2, model, out, stage, list(flags), timeout=500, init_pg=False)[0]
    return _RUNS[key]


def _compare(ours: dict, theirs: dict) -> float:
    assert len(ours["history"]) == len(theirs["history"]) == STEPS, (ours["history"], theirs["history"])
    worst = 0.0
    for a, b in zip(ours["history"], theirs["history"]):
        for key in ("loss", "grad_norm"):
            worst = max(worst, abs(a[key] - b[key]))
            assert abs(a[key] - b[key]) <= TOL, (key, ours["history"], theirs["history"])
    for name, w in theirs["weights"].items():
        if name in ours["weights"]:
            torch.testing.assert_close(ours["weights"][name], w, rtol=TOL, atol=TOL, msg=name)
    assert len(ours["weights"]) >= len(theirs["weights"]) - 1   # the tied lm_head may be left out
    return worst


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_accelerate_alst_loop_matches_unsharded(tmp_path_factory, stage):
    ours = _run("ours", stage, tmp_path_factory)
    ref = _run("reference", 0, tmp_path_factory)
    assert ours["world"] == 2 and ours["batches"] == STEPS   # the adapter: 3 batches a rank x sp 2
    assert ours["loss_in_loop"]    # DeepSpeed's engine semantics: the model computes no loss, the loop aggregates
    losses = [h["loss"] for h in ref["history"]]
    assert max(losses) - min(losses) > 100 * TOL             # the steps differ: the comparison can see an error
    print(f"ZeRO {stage}: largest loss / grad-norm difference from the unsharded run {_compare(ours, ref):.2e}")


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_accelerate_alst_loop_matches_deepspeed(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the [oracle] extra (DeepSpeed) is not installed")
    theirs = _run("deepspeed", 3, tmp_path_factory)
    ours = _run("ours", 3, tmp_path_factory)
    print(f"fsdpzero vs DeepSpeed ALST: {_compare(ours, theirs):.2e}")
    _compare(theirs, _run("reference", 0, tmp_path_factory))   # and DeepSpeed's ALST is the unsharded run
    # accelerate's script as shipped (no model.train(): from_pretrained's eval mode, where accelerate's
    # disable_in_eval=True turns the all-to-alls off): DeepSpeed computes each slice's attention alone, and so does
    # fsdpzero; neither is the unsharded run
    theirs = _run("deepspeed", 3, tmp_path_factory, ["--eval_mode"])
    ours = _run("ours", 3, tmp_path_factory, ["--eval_mode"])
    print(f"eval mode, fsdpzero vs DeepSpeed ALST: {_compare(ours, theirs):.2e}")
    ref = _run("reference", 0, tmp_path_factory)["history"]
    assert abs(theirs["history"][0]["loss"] - ref[0]["loss"]) > 1e-3, (theirs["history"], ref)


def test_stand_in_checks():
    """The accelerate-door refusals, pure: the attention named in sp_handler must be the model's (DeepSpeed's
    check), AutoTP x accelerate's sp is refused, sizes must agree, and accelerate's train_batch_size from a
    ParallelismConfig without dp sizes names the setting."""
    from types import SimpleNamespace

    from fsdpzero.compat.sequence_parallel import check_attention, check_batch_triad, engine_config
    from fsdpzero.parallel.ulysses import SequenceParallel
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="eager"))
    with pytest.raises(ValueError, match=r"^ParallelismConfig sp_handler sp_attn_implementation='sdpa' but the model "
                                         r"was loaded with attn_implementation='eager': set both the same"):
        check_attention(model, "sdpa")
    check_attention(SimpleNamespace(config=SimpleNamespace(_attn_implementation="fsdpzero_ulysses-1a-sdpa")), "sdpa")
    sp = SequenceParallel(size=2, rank=0, group=None, key="k")
    assert engine_config({"zero_optimization": {"stage": 3}}, sp)["sequence_parallel_size"] == 2
    with pytest.raises(ValueError, match=r"^tensor_parallel.autotp_size = 2 with accelerate's ParallelismConfig "
                                         r"sp_size = 2: AutoTP x Ulysses is not provided in accelerate's door"):
        engine_config({"tensor_parallel": {"autotp_size": 2}}, sp)
    with pytest.raises(ValueError, match=r"^sequence_parallel_size = 4 in the DeepSpeed config but ParallelismConfig "
                                         r"sp_size = 2"):
        engine_config({"sequence_parallel_size": 4}, sp)
    check_batch_triad({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2},
                      4, 2)
    with pytest.raises(ValueError, match=r"set ParallelismConfig\(dp_shard_size=2, sp_size=2\)"):
        check_batch_triad({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
                           "gradient_accumulation_steps": 1}, 4, 2)



def test_heads_not_divisible_named_as_accelerate_sets_it():
    """A model whose heads sp_size does not divide: refused before any sp group (and with no process group at all
    here), naming the setting accelerate's users set (ParallelismConfig sp_size), not the DeepSpeed key they may not
    have. It was refused after the sp groups were created, as `sequence_parallel_size = 2 does not divide ...`."""
    from fsdpzero.compat.sequence_parallel import UlyssesSPAttentionHF
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"^ParallelismConfig sp_size = 2 does not divide the model's 3 attention "
                                         r"heads \(num_attention_heads\): use a divisor of 3$"):
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, max_length=16)

def test_engine_passes_batches_through_as_deepspeed():
    """The mpu of accelerate's door gives DeepSpeed's engine semantics: the adapter's batch (shift_labels, no labels)
    reaches the model as it is, so the model computes no loss and the loop's aggregation is the only one; fsdpzero's
    own door keeps computing the whole sequence's loss in forward."""
    from fsdpzero.parallel.ulysses import SequenceParallel
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None],
             "shift_labels": torch.ones(1, 4, dtype=torch.long)}
    door = SequenceParallel(size=2, rank=0, group=None, key="k", loss_in_loop=True)
    assert door.model_inputs(batch) == batch
    out = {"loss": torch.tensor(1.0)}
    assert door.reduce_output(out, batch) is out and out["loss"].item() == 1.0
    own = SequenceParallel(size=2, rank=0, group=None, key="k")
    assert own.model_inputs(batch)["labels"] is batch["shift_labels"]


def test_launch_config_parallelism_section_names_where_the_sizes_go():
    from fsdpzero.compat.accelerate_config import translate
    with pytest.raises(ValueError, match=r"^--config_file acc.yaml: parallelism_config = '\{...\}': fsdpzero launch "
                                         r"does not pass a launch config's parallel sizes to the ranks; .*your own "
                                         r"loop: Accelerator\(parallelism_config=ParallelismConfig\(sp_backend="
                                         r"\"deepspeed\", sp_size=N\)\)"):
        translate({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3},
                   "parallelism_config": {"parallelism_config_sp_size": 2}}, "acc.yaml")


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_sp2_dp2_matches_deepspeed_4gpu(tmp_path, tmp_path_factory):
    """sp 2 x dp 2 (ParallelismConfig(dp_shard_size=2, sp_size=2), accelerate's 2D case) on 4 GPUs over NCCL, the
    same loop under `fsdpzero launch` and under `fsdpzero launch --no_shim` (accelerate + real DeepSpeed 0.19.8),
    ZeRO 3: rank 0's per-step losses (its group's sequences), the grad norms and the final weights. Not on CPU: the
    loop's torch.distributed.nn.functional.all_gather backward on gloo scatters with global ranks as group ranks and
    fails in the second sp group ("Global rank 0 is not part of group", torch 2.13; NCCL reduce-scatters). Run with

        pytest -m gpu tests/hf/test_accelerate_ulysses.py -k 4gpu
    """
    import subprocess
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the [oracle] extra (DeepSpeed) is not installed")
    root = Path(__file__).resolve().parents[2]
    model = _model_dir(tmp_path_factory)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
           and not k.startswith("ACCELERATE_")}
    # the checkout first, the caller's path kept (a GPU image's wheels and DeepSpeed's copy live there)
    env.update(PYTHONPATH=os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")
    results = {}
    for side, flags in (("ours", []), ("deepspeed", ["--no_shim"])):
        out = tmp_path / side
        argv = _argv(model, str(out), 3, ["--dp_shard_size", "2"])
        cmd = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())", "launch",
               "--num_gpus", "4", *flags, *argv]
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (side, p.stderr[-5000:])
        results[side] = torch.load(out / "result.pt", weights_only=True)
    ours, theirs = results["ours"], results["deepspeed"]
    assert ours["world"] == 4 and ours["batches"] == theirs["batches"]
    for a, b in zip(ours["history"], theirs["history"], strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, ours["history"], theirs["history"])
    for name, w in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_training_in_eval_mode_warns_once():
    """accelerate registers the attention with disable_in_eval=True: a training forward (grad enabled) of a model left
    in from_pretrained's eval mode runs each slice alone (as DeepSpeed does), and says so once; inference does not."""
    import logging
    from types import SimpleNamespace

    from fsdpzero.parallel.ulysses import UlyssesAttention
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("fsdpzero")
    log.addHandler(handler)
    level, log.level = log.level, logging.INFO
    try:
        attention = UlyssesAttention("sdpa", None, 2, 4, 4)   # no group: the eval branch never communicates
        attention.disable_in_eval = True
        module = SimpleNamespace(training=False, is_causal=True, num_key_value_groups=1)
        q = torch.randn(1, 4, 8, 16)
        with torch.no_grad():
            attention(module, q, q, q, None)
        assert records == []
        for _ in range(2):
            out, _ = attention(module, q, q, q, None)
        assert out.shape == (1, 8, 4, 16)
        assert len(records) == 1 and "call model.train() before training" in records[0].getMessage()
    finally:
        log.removeHandler(handler)
        log.level = level
