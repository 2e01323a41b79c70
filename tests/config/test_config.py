"""The config layer: reading, deprecated names, strictness, errors with key paths and suggestions, "auto",
the batch triad. Expected values come from DeepSpeed 0.19.8's source (cited per test), not from our code."""
import base64
import json

import pytest

from fsdpzero.config import COMPAT_VERSION, ConfigError, load_config, resolve_batch
from fsdpzero.plan import Env
from fsdpzero.plan.translate import build_plan, translate

BASE = {"train_micro_batch_size_per_gpu": 2}


def errors_of(source, **kw):
    with pytest.raises(ConfigError) as e:
        load_config(source, **kw)
    text = str(e.value)                   # what the user sees: every problem with its key path and its fix
    for p in e.value.problems:
        assert f"{p.key or '<config>'}: {p.message}" in text and p.suggestion in text
    return {p.key: p for p in e.value.problems}


def test_compat_version_is_stated_once():
    assert COMPAT_VERSION == "0.19.8"


# ---------------------------------------------------------------- reading
def test_path_with_comments_dict_json_and_base64(tmp_path):
    text = '{\n // micro batch\n "train_micro_batch_size_per_gpu": 4, # hash comment\n /* block */ "bf16": ' \
           '{"enabled": true,},\n "wandb": {"project": "a//b#c"}\n}'
    path = tmp_path / "ds.json"
    path.write_text(text)
    want = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "wandb": {"project": "a//b#c"}}
    for source in (path, str(path), json.dumps(want), want,
                   base64.urlsafe_b64encode(json.dumps(want).encode()).decode()):
        cfg = load_config(source)
        assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.bf16.enabled and cfg.wandb.project == "a//b#c"


def test_dict_source_is_not_mutated():
    src = {"train_micro_batch_size_per_gpu": "auto", "bfloat16": {"enabled": True}}
    load_config(src, context={"per_device_train_batch_size": 3})
    assert src == {"train_micro_batch_size_per_gpu": "auto", "bfloat16": {"enabled": True}}


def test_duplicate_keys_and_bad_json(tmp_path):
    p = tmp_path / "dup.json"
    p.write_text('{"gradient_clipping": 1.0, "gradient_clipping": 0.5}')
    assert "duplicate" in errors_of(p)["gradient_clipping"].message      # DeepSpeed's hjson loader rejects too
    p.write_text('{"a": 1,, }')
    assert "not valid JSON" in errors_of(p)[""].message
    assert "neither an existing file" in errors_of("/no/such/file.json")[""].message


# ---------------------------------------------------------------- deprecated names (DeepSpeed zero/config.py)
def test_deprecated_aliases_are_renamed_with_a_warning():
    cfg = load_config({**BASE, "bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True,
        "stage3_gather_fp16_weights_on_model_save": True}, "aio": {"thread_count": 4}})
    z = cfg.zero_optimization
    assert cfg.bf16.enabled
    assert z.offload_optimizer.device == "cpu" and z.offload_param.device == "cpu"
    assert z.gather_16bit_weights_on_model_save is True
    assert cfg.aio.intra_op_parallelism == 4
    text = "\n".join(cfg.warnings)
    for old in ("bfloat16", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
                "stage3_gather_fp16_weights_on_model_save", "aio.thread_count"):
        assert old in text


def test_zero_optimization_true_is_stage_one_with_allgather_size():
    cfg = load_config({**BASE, "zero_optimization": True, "allgather_size": 1234})
    assert cfg.zero_optimization.stage == 1 and cfg.zero_optimization.allgather_bucket_size == 1234
    assert load_config({**BASE, "zero_optimization": False}).zero_optimization.stage == 0


def test_bf16_wins_over_bfloat16_and_short_zero_names():
    cfg = load_config({**BASE, "bf16": {"enabled": False}, "bfloat16": {"enabled": True},
                       "zero_optimization": {"stage": 3, "prefetch_bucket_size": 7, "max_live_parameters": 9,
                                             "gather_16bit_weights_on_model_save": True}})
    assert not cfg.bf16.enabled
    assert cfg.zero_optimization.prefetch_bucket_size == 7 and cfg.zero_optimization.max_live_parameters == 9


def test_deprecated_and_new_name_together_is_an_error():
    errs = errors_of({**BASE, "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True,
                                                    "stage3_gather_16bit_weights_on_model_save": True,
                                                    "offload_optimizer": {"device": "cpu"}, "cpu_offload": True}})
    assert "remove" in errs["zero_optimization.stage3_gather_fp16_weights_on_model_save"].suggestion
    assert "zero_optimization.cpu_offload" in errs


def test_removed_features_are_rejected_as_deepspeed_0_19_8_does():
    errs = errors_of({**BASE, "sparse_attention": {"mode": "fixed"}, "amp": {"enabled": True},
                      "zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}})
    assert set(errs) == {"sparse_attention", "amp", "zero_optimization.zeropp_loco_param"}
    assert "remove" in errs["amp"].suggestion and "0.19.8" in errs["amp"].message


# ---------------------------------------------------------------- strictness: every error class
def test_unknown_key_in_strict_section_names_path_and_nearest_key():
    errs = errors_of({**BASE, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 5},
                      "bf16": {"check_overflow": True}, "zero_optimization.offload_param": {}})
    p = errs["zero_optimization.stage3_prefetch_bucket_sise"]
    assert "unknown key" in p.message and "stage3_prefetch_bucket_size" in p.suggestion
    assert "check_grad_overflow" in errs["bf16.check_overflow"].suggestion


def test_nested_strict_typo():
    errs = errors_of({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": 1}}})
    assert "pin_memory" in errs["zero_optimization.offload_param.pin_memroy"].suggestion


def test_top_level_near_miss_is_an_error_other_unknowns_warn():
    errs = errors_of({**BASE, "zero_optimisation": {"stage": 2}, "gradient_acumulation_steps": 2})
    assert "zero_optimization" in errs["zero_optimisation"].suggestion
    assert "gradient_accumulation_steps" in errs["gradient_acumulation_steps"].suggestion
    assert "silently ignore" in errs["zero_optimisation"].message
    cfg = load_config({**BASE, "_comment": "hi", "comms_config": {"verbose": False}})
    assert cfg.unknown_keys == {"_comment": "hi", "comms_config": {"verbose": False}}
    assert any("_comment" in w and "ignored as DeepSpeed does" in w for w in cfg.warnings)
    plan = translate(cfg, Env())
    fate = {d.key: d for d in plan.decisions}["_comment"]
    assert fate.status == "noop" and "unknown to DeepSpeed" in fate.detail


def test_strict_makes_every_unknown_key_an_error():
    errs = errors_of({**BASE, "_comment": "hi", "optimizer": {"type": "AdamW", "extra": 1}}, strict=True)
    assert {"_comment", "optimizer.extra"} <= set(errs)


def test_lenient_section_near_miss():
    errs = errors_of({**BASE, "activation_checkpointing": {"cpu_checkpionting": True}})
    assert "cpu_checkpointing" in errs["activation_checkpointing.cpu_checkpionting"].suggestion


@pytest.mark.parametrize("patch, key, needle", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "less than or equal to 3"),
    ({"zero_optimization": {"stage": "three"}}, "zero_optimization.stage", "integer"),
    ({"zero_optimization": {"reduce_bucket_size": -5}}, "zero_optimization.reduce_bucket_size", "greater than 0"),
    ({"zero_optimization": {"sub_group_size": 1.5}}, "zero_optimization.sub_group_size", "integer"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device", "'none', 'cpu' or 'nvme'"),
    ({"gradient_clipping": "1.0x"}, "gradient_clipping", "number"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale", ">= 0"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16", "loss_scale_window must be > 0"),
    ({"fp16": {"enabled": "yes please"}}, "fp16.enabled", "boolean"),
    ({"checkpoint": {"tag_validation": "Sometimes"}}, "checkpoint.tag_validation", "'IGNORE', 'WARN' or 'FAIL'"),
    ({"communication_data_type": "fp8"}, "communication_data_type", "'fp32', 'fp16' or 'bf16'"),
    ({"zero_optimization": "yes"}, "zero_optimization", "valid dictionary"),
])
def test_wrong_types_and_ranges(patch, key, needle):
    p = errors_of({**BASE, **patch})[key]
    assert needle in p.message
    assert p.suggestion or key == "fp16"          # model-level checks carry their fix in the message


def test_cross_field_errors():
    errs = errors_of({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True},
                      "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"},
                                            "offload_optimizer": {"device": "nvme", "ratio": 0.5}}})
    assert "simultaneously" in errs["bf16.enabled"].message
    assert "stage 3" in errs["zero_optimization.offload_param"].message
    assert "stage" in errs["zero_optimization.offload_param"].suggestion
    assert "nvme_path" in errs["zero_optimization.offload_optimizer.nvme_path"].suggestion
    assert "Partial offloading" in errs["zero_optimization.offload_optimizer.ratio"].message


@pytest.mark.parametrize("stage,ok", [(1, False), (2, True), (3, True)])
def test_partial_offload_ratio_stages(stage, ok):
    """ratio < 1: fsdpzero steps part of the optimizer on the GPU for stages 2 and 3 (DeepSpeed: stage 3 only);
    stage 1 offloads through its own optimizer and has no partial step."""
    cfg = {**BASE, "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": 0.7}}}
    key = "zero_optimization.offload_optimizer.ratio"
    if ok:
        assert load_config(cfg).zero_optimization.offload_optimizer.ratio == 0.7
    else:
        assert "0.7" in errors_of(cfg)[key].message and "stage 2 or 3" in errors_of(cfg)[key].message


def test_all_problems_raised_at_once_without_pydantic_traceback():
    with pytest.raises(ConfigError) as e:
        load_config({"zero_optimisation": {}, "zero_optimization": {"stage": 9, "bogus": 1},
                     "fp16": {"enabled": 3}, "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})
    keys = {p.key for p in e.value.problems}
    assert {"zero_optimisation", "zero_optimization.stage", "zero_optimization.bogus", "fp16.enabled",
            "optimizer.params.max_grad_norm"} <= keys
    assert "pydantic" not in str(e.value) and "errors.pydantic.dev" not in str(e.value)
    assert e.value.__cause__ is None or not type(e.value.__cause__).__module__.startswith("pydantic")


def test_optimizer_and_scheduler_params_are_checked_like_kwargs():
    errs = errors_of({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decy": 0.1}},
                      "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_max_lr": 1e-3,
                                                                          "warmup_num_steps": 0}}})
    assert "weight_decay" in errs["optimizer.params.weight_decy"].suggestion
    assert "not a parameter of WarmupCosineLR" in errs["scheduler.params.warmup_max_lr"].message
    assert "positive integer" in errs["scheduler.params.warmup_num_steps"].message
    assert "required" in errs["scheduler.params.total_num_steps"].message
    errs = errors_of({**BASE, "optimizer": {"type": "AdamWW"}, "scheduler": {"type": "WarmupLRR"}})
    assert "AdamW" in errs["optimizer.type"].suggestion and "WarmupLR" in errs["scheduler.type"].suggestion


def test_untested_optimizer_under_zero_needs_the_flag():
    errs = errors_of({**BASE, "optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 2}})
    assert "zero_allow_untested_optimizer" in errs["zero_allow_untested_optimizer"].suggestion
    load_config({**BASE, "optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 2},
                 "zero_allow_untested_optimizer": True})
    load_config({**BASE, "optimizer": {"type": "SGD"}, "zero_optimization": {"stage": 0}})


# ---------------------------------------------------------------- "auto" (transformers/integrations/deepspeed.py)
HF_CFG = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto"}}


def test_auto_from_context():
    ctx = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "world_size": 8, "max_grad_norm": 0.5,
           "learning_rate": 3e-4, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "weight_decay": 0.1,
           "bf16": True, "fp16": False, "warmup_steps": 0.1, "max_steps": 1000, "hidden_size": 64}
    cfg = load_config(HF_CFG, context=ctx)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 4, 2)
    assert cfg.gradient_clipping == 0.5 and cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.optimizer.params == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert cfg.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100,
                                    "total_num_steps": 1000}
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (4096, 3686, 640)


def test_auto_hf_defaults_and_deferred_step_counts():
    cfg = load_config(HF_CFG, context={"world_size": 2, "hidden_size": 8}, hf_defaults=True)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (16, 8)      # TrainingArguments: 8
    assert cfg.optimizer.params["lr"] == 5e-5 and cfg.scheduler.params["warmup_num_steps"] == 1
    assert cfg.deferred == ("total_num_steps",)
    plan = translate(cfg, Env(world_size=2))
    assert plan.scheduler.deferred == ("total_num_steps",) and "total_num_steps" not in plan.scheduler.params


def test_unresolved_auto_names_the_training_arguments_field():
    errs = errors_of(HF_CFG, context={"world_size": 8})
    assert "per_device_train_batch_size" in errs["train_micro_batch_size_per_gpu"].message
    assert "--set per_device_train_batch_size" in errs["train_micro_batch_size_per_gpu"].suggestion
    assert "learning_rate" in errs["optimizer.params.lr"].message
    assert "hidden_size" in errs["zero_optimization.reduce_bucket_size"].message
    assert "max_steps" in errs["scheduler.params.total_num_steps"].message


def test_auto_mismatch_with_given_value_is_an_error():
    errs = errors_of({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0},
                     context={"per_device_train_batch_size": 8, "max_grad_norm": 1.0})
    p = errs["train_micro_batch_size_per_gpu"]
    assert "per_device_train_batch_size" in p.message and '"auto"' in p.suggestion
    assert "gradient_clipping" not in errs


def test_stage3_only_and_strict_section_autos():
    cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto",
                                                     "stage3_max_live_parameters": "auto"}},
                      context={"hidden_size": 10})
    assert cfg.zero_optimization.prefetch_bucket_size == 50_000_000          # HF skips it below stage 3
    assert cfg.zero_optimization.max_live_parameters == 1_000_000_000        # DeepSpeed drops "auto"
    assert any("stage3_max_live_parameters" in w for w in cfg.warnings)
    errs = errors_of({**BASE, "zero_optimization": {"stage3_max_live_parameters": "auto"}}, strict=True)
    assert "zero_optimization.stage3_max_live_parameters" in errs
    errs = errors_of({**BASE, "optimizer": {"type": "SGD", "params": {"momentum": "auto"}}})
    assert "no resolver" in errs["optimizer.params.momentum"].message


# ---------------------------------------------------------------- batch triad (DeepSpeedConfig._set_batch_...)
@pytest.mark.parametrize("given, world, want", [
    ((32, 4, 2), 4, (32, 4, 2)),
    ((32, 4, None), 4, (32, 4, 2)),
    ((32, None, 2), 4, (32, 4, 2)),
    ((None, 4, 2), 4, (32, 4, 2)),
    ((32, None, None), 4, (32, 8, 1)),
    ((None, 4, None), 4, (16, 4, 1)),
])
def test_batch_triad_fill(given, world, want):
    assert resolve_batch(*given, world) == want


@pytest.mark.parametrize("given, world, key, msg", [
    ((None, None, 2), 1, "train_batch_size", "Either train_batch_size or train_micro_batch_size_per_gpu needs"),
    ((100, 3, None), 8, "train_batch_size", "100 != 3 * 4 * 8"),
    ((4, 1, None), 8, "gradient_accumulation_steps", "Gradient accumulation steps: 0 has to be greater than 0"),
    ((1, None, None), 8, "train_micro_batch_size_per_gpu", "Micro batch size per gpu: 0 has to be greater than 0"),
])
def test_batch_triad_errors_use_deepspeed_messages(given, world, key, msg):
    with pytest.raises(ConfigError) as e:
        resolve_batch(*given, world)
    p = e.value.problems[0]
    assert p.key == key and msg in p.message and p.suggestion


def test_build_plan_uses_env_world_size_for_the_triad():
    plan = build_plan({"train_batch_size": 64, "gradient_accumulation_steps": 2}, Env(world_size=8))
    assert (plan.batch.micro_batch_size, plan.batch.gradient_accumulation_steps) == (4, 2)
