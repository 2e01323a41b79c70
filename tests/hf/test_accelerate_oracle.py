"""accelerate's DeepSpeed integration on fsdpzero against accelerate + real DeepSpeed 0.19.8 (DS_ACCELERATOR=cpu,
gloo): one unchanged accelerate loop (tests/hf/accelerate_loop.py: Accelerator(deepspeed_plugin=...), prepare of
model/optimizer/dataloader/scheduler, accumulate, backward, clip_grad_norm_, gather, save_state, get_state_dict,
unwrap_model, save_model) on 2 ranks, fp32, run once by DeepSpeed and once through fsdpzero's per-rank launch entry
(fsdpzero.compat.bootstrap, what `fsdpzero launch` runs): per-step losses, grad norms and learning rates, and the
final weights within 1e-5, at stages 1/2/3, with CPU offload, with the config's optimizer/scheduler sections
(DummyOptim/DummyScheduler), with a DeepSpeedPlugin built without a file, and with two plugins (a ZeRO-3 inference
teacher prepared after the student, accelerate's several-models usage). A run resumed from its own save_state
equals the uninterrupted run bit for bit."""
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

pytestmark = [pytest.mark.oracle, pytest.mark.slow]
if importlib.util.find_spec("deepspeed") is None:      # not importorskip: the shim's ranks fork from this process
    pytest.skip("the [oracle] extra (DeepSpeed) is not installed", allow_module_level=True)

SCRIPT = str(Path(__file__).with_name("accelerate_loop.py"))
SECTIONS = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "eps": 1e-6,
                                                      "torch_adam": True}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                               "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": False}}
OFFLOAD_PARAM = {"offload_param": {"device": "cpu", "pin_memory": False}}


def _file(zero: dict, sections: dict | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": 0.5,
            "zero_optimization": {**zero, "stage3_gather_16bit_weights_on_model_save": True}, **(sections or {})}


CASES = {   # name -> (ds_config or None, script flags)
    "stage1": (_file({"stage": 1}), []),
    "stage2": (_file({"stage": 2}), []),
    "stage3": (_file({"stage": 3}), []),
    "stage2_cpu_offload": (_file({"stage": 2, **OFFLOAD_OPT}), []),
    "stage3_cpu_offload": (_file({"stage": 3, **OFFLOAD_OPT, **OFFLOAD_PARAM}), []),
    "stage2_config_sections": (_file({"stage": 2}, SECTIONS), []),
    "plugin_stage3_init": (None, ["--zero_stage", "3", "--zero3_init_flag"]),
    "stage3_with_teacher": (_file({"stage": 3}), ["--teacher_config", "TEACHER"]),
}
# the teacher's plugin (accelerate's several-plugins usage): ZeRO-3 inference, no optimizer
TEACHER = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
RESUMED = ("stage1", "stage2", "stage3", "stage3_cpu_offload")


def _argv(case: str, model: str, out: str, extra: list[str]) -> list[str]:
    ds, flags = CASES[case]
    os.makedirs(out, exist_ok=True)
    if "TEACHER" in flags:
        teacher = os.path.join(out, "teacher.json")
        write_json(teacher, TEACHER)
        flags = [teacher if f == "TEACHER" else f for f in flags]
    argv = [SCRIPT, model, out, *flags, *extra]
    if ds is not None:
        path = os.path.join(out, "ds_config.json")
        write_json(path, ds)
        argv += ["--ds_config", path]
    return argv


def _deepspeed(rank, world, case, model, out, extra):
    os.environ["DS_ACCELERATOR"] = "cpu"
    _fresh_accelerate()
    # accelerate runs DeepSpeed only with cpu=False, and then joins no process group on a machine without GPUs:
    # pick gloo as a CPU rank does (the test's patch; fsdpzero's shim does the same for its own ranks)
    from accelerate.state import PartialState
    original = PartialState._prepare_backend
    PartialState._prepare_backend = lambda self, cpu=False, sagemaker_dp=False, backend=None: original(
        self, True, sagemaker_dp, backend)
    sys.argv = _argv(case, model, out, extra)
    runpy.run_path(SCRIPT, run_name="__main__")
    return _result(out, rank)


def _ours(rank, world, case, model, out, extra):
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]           # another test module may have imported the real one in the parent
    _fresh_accelerate()
    from fsdpzero.compat import bootstrap
    bootstrap.main(_argv(case, model, out, extra))
    return _result(out, rank)


_RUNS: dict = {}


def _run(side: str, case: str, tmp_path_factory, extra=()) -> dict:
    key = (side, case, tuple(extra))
    if key not in _RUNS:
        model = _model_dir(tmp_path_factory)
        out = str(tmp_path_factory.mktemp(f"{side}_{case}"))
        fn = _deepspeed if side == "deepspeed" else _ours
        _RUNS[key] = (run_distributed(fn, 2, case, model, out, list(extra), timeout=600, init_pg=False)[0], out)
    return _RUNS[key]


def _compare(ours: dict, theirs: dict) -> None:
    assert ours["world"] == theirs["world"] == 2
    assert len(ours["history"]) == len(theirs["history"]) == 6
    for a, b in zip(ours["history"], theirs["history"]):
        for key in ("loss", "grad_norm", "lr"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, ours["history"], theirs["history"])
    assert ours["weights"].keys() == theirs["weights"].keys()
    for name, w in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], w, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", list(CASES))
def test_accelerate_loop_matches_deepspeed(tmp_path_factory, case):
    save = ["--save_at", "3"] if case in RESUMED else []
    theirs, _ = _run("deepspeed", case, tmp_path_factory)
    ours, out = _run("ours", case, tmp_path_factory, save)
    _compare(ours, theirs)
    # unwrap_model gives the module itself: fully_shard-ed from stage 2 (stage 1 keeps whole parameters)
    assert theirs["unwrapped"] == "LlamaForCausalLM"
    assert ours["unwrapped"] == ("LlamaForCausalLM" if case == "stage1" else "FSDPLlamaForCausalLM")
    # save_model wrote what get_state_dict returned, loadable by plain transformers
    from safetensors.torch import load_file
    saved = load_file(os.path.join(out, "model", "model.safetensors"))
    for name, w in ours["weights"].items():
        if name in saved:
            assert torch.equal(saved[name].float(), w), name
    assert len(saved) >= len(ours["weights"]) - 1     # the tied lm_head may be left out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", RESUMED)
def test_save_state_load_state_resumes_bit_identically(tmp_path_factory, case):
    whole, out = _run("ours", case, tmp_path_factory, ["--save_at", "3"])
    resumed, _ = _run("ours", f"{case}", tmp_path_factory, ["--resume_from", os.path.join(out, "state")])
    assert resumed["history"] == whole["history"][3:]
    for name, w in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name
