"""Each config section is declared once, in the schema (fsdpzero/config): the plan's type for it is derived from
the schema model (or, where the plan renames and merges sections, its defaults are read from it), and the docs that
list its keys print them from the schema."""
import dataclasses
from pathlib import Path

import pytest

from fsdpzero.cli.migrate import section_keys_markdown, with_section_keys
from fsdpzero.config import load_config
from fsdpzero.config.schema import FP16, OffloadOptimizer, OffloadParam, ZenFlow, ZeroOptimization
from fsdpzero.config.sections import ActivationCheckpointing, Aio, Checkpoint, Compile
from fsdpzero.plan import Env
from fsdpzero.plan.translate import translate
from fsdpzero.plan.types import (ActivationCheckpointPlan, AioPlan, CheckpointPlan, CompilePlan, LossScalePlan,
                                  OffloadPlan, ShardPlan, ZenFlowPlan)

DOCS = Path(__file__).resolve().parents[2] / "docs"
# every aio key away from DeepSpeed's default (use_gds=true is refused, so it stays false)
AIO = {"block_size": 2 * 1_048_576, "queue_depth": 3, "intra_op_parallelism": 2, "single_submit": True,
       "overlap_events": False, "use_gds": False}


def test_the_aio_plan_is_the_schema_section():
    declared = {key: (f.annotation, f.default) for key, f in Aio.model_fields.items()}
    planned = {f.name: (f.type, f.default) for f in dataclasses.fields(AioPlan)}
    assert planned == declared
    assert set(AIO) == set(declared), "AIO above no longer sets every aio key"


def test_translate_carries_every_aio_key_into_the_plan():
    cfg = {"train_batch_size": 8, "aio": AIO,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}
    assert dataclasses.asdict(translate(load_config(cfg), Env()).offload.aio) == AIO


def test_docs_print_the_aio_keys_from_the_schema():
    doc = (DOCS / "nvme.md").read_text()
    keys = section_keys_markdown("aio")
    assert [line.split("`")[1] for line in keys.splitlines() if line.startswith("- ")] == list(Aio.model_fields)
    assert keys in doc, "docs/nvme.md's aio keys differ from the schema: python -m fsdpzero.cli.migrate --write-docs"
    assert with_section_keys(doc) == doc


# OffloadPlan's fields renamed from their sections (the plan merges offload_optimizer, offload_param and
# zero_optimization.sub_group_size): each default must be the schema's
OFFLOAD_KEYS = {"optimizer_device": (OffloadOptimizer, "device"), "param_device": (OffloadParam, "device"),
                "pin_memory": (OffloadParam, "pin_memory"), "optimizer_nvme_path": (OffloadOptimizer, "nvme_path"),
                "param_nvme_path": (OffloadParam, "nvme_path"), "buffer_count": (OffloadOptimizer, "buffer_count"),
                "param_buffer_count": (OffloadParam, "buffer_count"),
                "param_buffer_size": (OffloadParam, "buffer_size"), "max_in_cpu": (OffloadParam, "max_in_cpu"),
                "ratio": (OffloadOptimizer, "ratio"), "sub_group_size": (ZeroOptimization, "sub_group_size")}


def test_offload_plan_defaults_are_the_schemas():
    plan = OffloadPlan()
    # a new field names its schema key above, or is computed from several keys (not a default to copy)
    computed = {"aio", "cpuadam_cores_perc"}   # cpuadam_cores_perc: set only with super_offload at stage 3
    assert {f.name for f in dataclasses.fields(OffloadPlan)} == set(OFFLOAD_KEYS) | computed
    assert {k: getattr(plan, k) for k in OFFLOAD_KEYS} == {k: m.model_fields[key].default
                                                           for k, (m, key) in OFFLOAD_KEYS.items()}
    # a config without the offload sections is translated to the schema's defaults, not to a copy of them
    assert translate(load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3}}), Env()).offload == plan


def test_translate_carries_every_offload_key():
    opt = {"device": "nvme", "nvme_path": "/tmp/a", "buffer_count": 6, "ratio": 0.5}
    par = {"device": "nvme", "nvme_path": "/tmp/b", "buffer_count": 7, "buffer_size": 12_345_678,
           "max_in_cpu": 7_654_321, "pin_memory": False}
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "sub_group_size": 4321, "offload_optimizer": opt,
                                                        "offload_param": par}}
    got = translate(load_config(cfg), Env()).offload
    sections = {OffloadOptimizer: opt, OffloadParam: par, ZeroOptimization: {"sub_group_size": 4321}}
    assert {k: getattr(got, k) for k in OFFLOAD_KEYS} == {k: sections[m][key] for k, (m, key) in OFFLOAD_KEYS.items()
                                                          if key in sections[m]} | {
        k: m.model_fields[key].default for k, (m, key) in OFFLOAD_KEYS.items() if key not in sections[m]}


# zero_optimization keys the ShardPlan carries under the schema's field names (the stage3_ ones by their aliases)
SHARD_KEYS = ("stage", "prefetch_bucket_size", "param_persistence_threshold", "reduce_bucket_size",
              "allgather_bucket_size", "ignore_unused_parameters", "gather_16bit_weights_on_model_save")


def test_shard_plan_defaults_are_the_schemas():
    defaults = {k: ZeroOptimization.model_fields[k].default for k in SHARD_KEYS}
    assert {k: getattr(ShardPlan(), k) for k in SHARD_KEYS} == defaults
    got = translate(load_config({"train_batch_size": 8}), Env()).shard
    assert {k: getattr(got, k) for k in SHARD_KEYS} == defaults
    values = {"stage": 1, "stage3_prefetch_bucket_size": 123, "stage3_param_persistence_threshold": 45,
              "reduce_bucket_size": 678, "allgather_bucket_size": 910, "ignore_unused_parameters": False,
              "stage3_gather_16bit_weights_on_model_save": True}
    got = translate(load_config({"train_batch_size": 8, "zero_optimization": values}), Env()).shard
    assert [getattr(got, k) for k in SHARD_KEYS] == list(values.values())


def test_the_stage1_op_takes_its_bucket_sizes_from_the_library():
    """fsdpzero_ops.stage1 never imports the library: it declares no bucket defaults, the plan's are passed in."""
    import inspect

    from fsdpzero_ops.stage1 import Stage1Optimizer
    params = inspect.signature(Stage1Optimizer).parameters
    assert [params[k].default for k in ("reduce_bucket_size", "allgather_bucket_size")] == [inspect.Parameter.empty] * 2


FP16_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
             "min_loss_scale")


def test_loss_scale_plan_defaults_are_the_fp16_sections():
    defaults = {k: FP16.model_fields[k].default for k in FP16_KEYS}
    assert dataclasses.asdict(LossScalePlan()) == defaults
    got = translate(load_config({"train_batch_size": 8, "fp16": {"enabled": True}}), Env()).precision.loss_scale
    assert got == LossScalePlan()
    values = {"loss_scale": 0.0, "initial_scale_power": 12, "loss_scale_window": 50, "hysteresis": 3,
              "consecutive_hysteresis": True, "min_loss_scale": 4}
    got = translate(load_config({"train_batch_size": 8, "fp16": {"enabled": True, **values}}), Env())
    assert dataclasses.asdict(got.precision.loss_scale) == values


# sections the plan carries under the same key names: (plan type, the Plan's field, schema model, keys, a config
# section with every key away from its default, what the plan holds for it)
SAME_NAME = [
    (ActivationCheckpointPlan, "activation_checkpointing", ActivationCheckpointing,
     ("cpu_checkpointing", "number_checkpoints"), {"cpu_checkpointing": True, "number_checkpoints": 4}, None),
    (CompilePlan, "compile", Compile, ("backend",), {"backend": "eager"}, None),
    (CheckpointPlan, "checkpoint", Checkpoint, ("tag_validation", "load_universal", "use_node_local_storage"),
     {"tag_validation": "FAIL", "load_universal": True, "use_node_local_storage": True}, {"tag_validation": "fail"}),
]


@pytest.mark.parametrize("plan_type, section, model, keys, values, planned", SAME_NAME,
                         ids=[s[1] for s in SAME_NAME])
def test_section_plan_defaults_are_the_schemas(plan_type, section, model, keys, values, planned):
    lower = {"tag_validation": str.lower}   # the plan spells DeepSpeed's WARN/FAIL in lower case
    defaults = {k: lower.get(k, lambda v: v)(model.model_fields[k].default) for k in keys}
    assert {k: getattr(plan_type(), k) for k in keys} == defaults
    for cfg in ({}, {section: {}}):        # the section absent, and present with nothing set
        got = getattr(translate(load_config({"train_batch_size": 8, **cfg}), Env()), section)
        assert {k: getattr(got, k) for k in keys} == defaults
    got = getattr(translate(load_config({"train_batch_size": 8, section: values}), Env()), section)
    assert {k: getattr(got, k) for k in keys} == values | (planned or {})


# zenflow's keys that the plan copies as written (the strategy and the intervals are resolved, not copied)
ZENFLOW_KEYS = ("topk_ratio", "overlap_step", "offload", "auto_ratio", "full_warm_up_rounds", "pt_reserved_cores_perc")


def test_zenflow_plan_defaults_are_the_schemas():
    defaults = {k: ZenFlow.model_fields[k].default for k in ZENFLOW_KEYS}
    assert {k: getattr(ZenFlowPlan(), k) for k in ZENFLOW_KEYS} == defaults
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {}}
    got = translate(load_config({"train_batch_size": 8, "zero_optimization": zero}), Env()).zenflow
    assert {k: getattr(got, k) for k in ZENFLOW_KEYS} == defaults


# the NVMe ops take the plan's offload section and the engine's settings whole: a constructor parameter named after
# a key of those sections (or any other literal default) would be a second declaration of the schema's default
def test_the_nvme_ops_declare_no_default_of_the_offload_sections(tmp_path):
    import inspect

    import torch

    from fsdpzero.offload.nvme_adam import NVMeAdam
    from fsdpzero.offload.param_swapper import ParamSwapper
    from fsdpzero.offload.swapdir import aio_config
    from fsdpzero.tuning import Tuning

    keys = ({f.name for f in dataclasses.fields(OffloadPlan)} | {f.name for f in dataclasses.fields(Tuning)}
            | set(OffloadOptimizer.model_fields) | set(OffloadParam.model_fields) | set(Aio.model_fields)
            | set(ZeroOptimization.model_fields) | {"backend", "impl", "build"})
    adam = inspect.signature(torch.optim.Adam).parameters
    own = {"adamw_mode": False, "bias_correction": True}   # NVMeAdam's Adam/AdamW switches, as CPUAdam's
    for cls in (NVMeAdam, ParamSwapper):
        params = inspect.signature(cls).parameters
        assert params["offload"].default is inspect.Parameter.empty, cls
        assert params["offload"].annotation in ("OffloadPlan", OffloadPlan), cls
        assert not set(params) & keys, f"{cls.__name__} declares {set(params) & keys}: read them from `offload`"
        literal = {k: p.default for k, p in params.items() if p.default not in (inspect.Parameter.empty, None)
                   and not (k in adam and adam[k].default == p.default) and own.get(k, ...) != p.default}
        assert not literal, f"{cls.__name__} declares defaults {literal}"

    # and what the section says is what the optimizer runs with
    offload = OffloadPlan(optimizer_nvme_path=str(tmp_path), buffer_count=2, sub_group_size=1000,
                          aio=AioPlan(**AIO))
    p = [torch.zeros(3000, requires_grad=True)]
    opt = NVMeAdam(p, offload=offload, tuning=Tuning(cpu_adam_impl="reference"))
    try:
        assert len(opt._buffers) == 2 and len(opt._groups) == 3
        assert opt._reader.config == opt._writer.config == aio_config(offload.aio)
        assert opt.impl == "reference"
    finally:
        opt.close()
