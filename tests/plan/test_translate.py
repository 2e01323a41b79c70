"""translate(): the plan the engine relies on, a decision for every key, the fate table's coverage, goldens."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpzero.config import ConfigError
from fsdpzero.plan.fates import CONDITIONAL, FATES
from fsdpzero.plan import Env
from fsdpzero.plan.translate import build_plan, schema_paths

HERE = Path(__file__).resolve().parents[1]
B = {"train_micro_batch_size_per_gpu": 1}


def plan_of(cfg, world=8, **kw):
    return build_plan({**B, **cfg}, Env(world_size=world, nodes=1), **kw)


@pytest.mark.parametrize("stage, reshard", [(0, False), (1, False), (2, False), (3, True)])
def test_stage_to_reshard_after_forward(stage, reshard):
    s = plan_of({"zero_optimization": {"stage": stage}}).shard
    assert s.stage == stage and s.reshard_after_forward is reshard
    assert s.mesh_shape == (8,) and s.mesh_dim_names == ("dp",)


def test_hpz_and_mics():
    s = plan_of({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}).shard
    assert s.reshard_after_forward == 4 and type(s.reshard_after_forward) is int
    with pytest.raises(ConfigError) as e:
        plan_of({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}})
    assert e.value.problems[0].key == "zero_optimization.zero_hpz_partition_size"
    s = plan_of({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}).shard
    assert s.mesh_shape == (4, 2) and s.mesh_dim_names == ("replicate", "shard")
    with pytest.raises(ConfigError) as e:
        plan_of({"zero_optimization": {"stage": 3, "mics_shard_size": 3}})
    assert e.value.problems[0].key == "zero_optimization.mics_shard_size"


def test_precision():
    p = plan_of({}).precision
    assert (p.param_dtype, p.reduce_dtype, p.loss_scale, p.check_grad_overflow) == ("float32", "float32", None, False)
    p = plan_of({"bf16": {"enabled": True}}).precision
    assert (p.param_dtype, p.reduce_dtype, p.check_grad_overflow) == ("bfloat16", "bfloat16", True)  # 0.19.3+
    p = plan_of({"bf16": {"enabled": True}, "communication_data_type": "FP32"}).precision
    assert p.reduce_dtype == "float32"
    p = plan_of({"fp16": {"enabled": True, "hysteresis": 3, "initial_scale_power": 12}}).precision
    assert p.param_dtype == "float16" and p.loss_scale.hysteresis == 3 and p.loss_scale.initial_scale_power == 12
    assert p.loss_scale.loss_scale_window == 1000 and p.loss_scale.min_loss_scale == 1.0
    p = plan_of({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                 "zero_optimization": {"stage": 2}, "torch_autocast": {"enabled": True}}).precision
    assert (p.master_dtype, p.optimizer_state_dtype, p.autocast_dtype) == ("bfloat16", "bfloat16", "bfloat16")


def test_batch_defaults_are_deepspeeds():
    b = plan_of({"gradient_accumulation_steps": 4}).batch
    assert b.gradient_clipping == 1.0                           # DeepSpeed >= 0.19.3, not PyTorch's "no clipping"
    assert (b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps) == (32, 1, 4)
    assert plan_of({"gradient_clipping": 0}).batch.gradient_clipping == 0.0


@pytest.mark.parametrize("opt, want_type, adam_w_mode", [
    ({"type": "Adam"}, "adamw", True),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, "adam", False),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, "adamw", True),   # DeepSpeed: AdamW forces AdamW
    ({"type": "adamw", "params": {"torch_adam": True}}, "adamw", True),
    ({"type": "LAMB"}, "lamb", True),
    ({"type": "SGD", "params": {"momentum": 0.9}}, "sgd", True),
    ({"type": "Adagrad"}, "adagrad", True),
    ({"type": "RMSprop"}, "RMSprop", True),
])
def test_optimizer_type_is_canonical(opt, want_type, adam_w_mode):
    o = plan_of({"optimizer": opt}).optimizer
    assert o.type == want_type and o.adam_w_mode is adam_w_mode
    assert "torch_adam" not in o.params and "adam_w_mode" not in o.params
    assert o.torch_adam is bool(opt.get("params", {}).get("torch_adam", False))


def test_scheduler_defaults_filled():
    s = plan_of({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}).scheduler
    assert s.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "log"}
    s = plan_of({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}}).scheduler
    assert s.params["warmup_max_lr"] == 0.001 and s.params["warmup_num_steps"] == 1000
    s = plan_of({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                                              "cycle_first_step_size": 50}}}).scheduler
    assert s.params["cycle_second_step_size"] == 50 and s.params["cycle_min_mom"] == 0.8


def test_offload():
    o = plan_of({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nv"},
                                       "offload_optimizer": {"device": "cpu", "pin_memory": False}},
                 "aio": {"queue_depth": 32}}).offload
    # pin_memory is offload_param's (FSDP2's CPUOffloadPolicy reads it); offload_optimizer's does not override it
    assert (o.param_device, o.param_nvme_path, o.optimizer_device, o.pin_memory) == ("nvme", "/nv", "cpu", True)
    assert o.aio.queue_depth == 32 and o.aio.block_size == 1_048_576
    o = plan_of({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
                                       "offload_optimizer": {"device": "cpu"}}}).offload
    assert o.pin_memory is False


def test_unsupported_features_are_decisions_not_exceptions():
    plan = plan_of({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 10}},
                    "pipeline": {"stages": 2}, "hybrid_engine": {"enabled": True},
                    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                          "zenflow": {"topk_ratio": 0.2}}})   # update_interval "auto": refused
    assert {d.key for d in plan.unsupported} == {"optimizer.type", "pipeline", "hybrid_engine.enabled",
                                                 "zero_optimization.zenflow"}
    assert all(d.detail for d in plan.unsupported)


def test_every_written_key_gets_a_decision_and_defaults_too():
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {
        "stage": 3, "prefetch_bucket_size": 10, "offload_param": {"device": "cpu"}}, "_comment": "x"}
    plan = plan_of(cfg)
    explicit = {d.key for d in plan.decisions if d.explicit}
    assert {"train_micro_batch_size_per_gpu", "optimizer.type", "optimizer.params.lr", "zero_optimization.stage",
            "zero_optimization.prefetch_bucket_size", "zero_optimization.offload_param.device", "_comment"} == explicit
    defaulted = {d.key: d for d in plan.decisions if not d.explicit}
    assert defaulted["gradient_clipping"].value == 1.0 and defaulted["gradient_clipping"].status == "mapped"
    assert "zero_optimization.offload_param.pin_memory" in defaulted
    assert "zero_optimization.stage3_prefetch_bucket_size" not in defaulted     # written under its short name
    assert all(d.status in ("mapped", "approximated", "noop", "unsupported") and d.detail for d in plan.decisions)


def test_autos_dropped_or_deferred_appear_once():
    plan = plan_of({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"},
                    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
                   hf_defaults=True)
    keys = [d.key for d in plan.decisions]
    assert keys.count("zero_optimization.stage3_max_live_parameters") == 1
    assert keys.count("scheduler.params.total_num_steps") == 1
    d = {d.key: d for d in plan.decisions}
    assert d["zero_optimization.stage3_max_live_parameters"].value == 1_000_000_000
    assert d["zero_optimization.stage3_max_live_parameters"].explicit
    assert d["scheduler.params.total_num_steps"].value == "auto"


def test_non_string_keys_are_an_error():
    with pytest.raises(ConfigError) as e:
        plan_of({"zero_optimization": {3: 1}})
    assert e.value.problems[0].key == "zero_optimization.3"


def test_decision_table_covers_every_schema_field():
    missing = [p for p in schema_paths() if p not in FATES]
    assert not missing, f"add these keys to fsdpzero.plan.fates.FATES: {missing}"
    stale = [k for k in FATES if k not in set(schema_paths())]
    assert not stale, f"FATES has keys the schema does not know: {stale}"
    from fnmatch import fnmatchcase
    paths = set(schema_paths())
    dead = [r.pattern for r in CONDITIONAL if not any(fnmatchcase(p, r.pattern) for p in paths)
            and r.pattern.removesuffix(".*") not in paths]     # optimizer.params.*: keys of a free-form dict
    assert not dead, f"conditional rules whose pattern matches no schema key: {dead}"


def test_translate_is_pure_and_torch_free():
    code = ("import sys; from fsdpzero.plan.translate import build_plan; from fsdpzero.plan import Env; "
            "build_plan({'train_batch_size': 8, 'zero_optimization': {'stage': 3}}, Env(world_size=8)); "
            "import fsdpzero.cli.migrate; assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE.parent, timeout=120)


# ---------------------------------------------------------------- goldens
GOLDEN = ["hf_transformers_zero3", "accelerate_zero_stage1", "dsex_bf16_master_weight_full",
          "dsex_sglang_nvme_aio", "llamafactory_ds_z3_fp8", "dsex_zenflow_stage2", "axolotl_zero3_bf16_cpuoffload_all"]
GOLDEN_CTX = {"hidden_size": 4096, "max_steps": 1000}


def golden_of(name: str) -> dict:
    world = 1 if name == "dsex_sglang_nvme_aio" else 8          # an inference config with train_batch_size 1
    plan = build_plan(HERE / "ds_configs" / f"{name}.json", Env(world_size=world, device_type="cuda"),
                      context=GOLDEN_CTX, hf_defaults=True)
    return json.loads(json.dumps({"plan": plan.to_dict(), "decisions": [
        [d.key, d.value, d.status, d.explicit] for d in plan.decisions]}, default=str))


@pytest.mark.parametrize("name", GOLDEN)
def test_translation_goldens(name):
    path = HERE / "goldens" / f"{name}.json"
    got = golden_of(name)
    if os.environ.get("FSDPZERO_REGEN_GOLDENS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text()), f"plan changed for {name}; review, then regenerate with " \
                                                "FSDPZERO_REGEN_GOLDENS=1"


@pytest.mark.parametrize("cfg, key", [
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
     "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 2, "offload_optimizer": {"device": "cpu"},
                            "zenflow": {"topk_ratio": 0.1, "update_interval": 4}},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "zero_optimization.zenflow"),
])
def test_unsupported_combinations_are_refused_before_any_process_group(cfg, key):
    """Stage 1 with NVMe optimizer offload (Stage1GradPath.build refused it only after init_process_group) and
    ZenFlow on a replicated MiCS mesh (its clip norm would count replicas): the plan's fate says unsupported, and
    wrap's pre-process-group check raises one line naming the key."""
    from fsdpzero.api import refuse_unsupported
    plan = plan_of(cfg, world=4)
    assert any(d.key == key and d.status == "unsupported" for d in plan.decisions), [
        (d.key, d.status) for d in plan.decisions if d.key == key]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        refuse_unsupported(plan)
