"""DeepSpeed 0.19.8 itself as the oracle (installed in the test venv; the library never imports it).

- our strict-section schemas accept exactly DeepSpeed's field names and aliases, with DeepSpeed's defaults;
- random zero_optimization / fp16 / bf16 / offload dicts are accepted or rejected as DeepSpeed's pydantic models do;
- the batch triad gives DeepSpeedConfig's numbers and messages;
- every corpus file DeepSpeed rejects (after "auto" is resolved as the HF Trainer would) we reject, naming the
  key DeepSpeed names, and we reject no corpus file that DeepSpeed accepts.
"""
import copy
import glob
import inspect
import logging
import math
import os
from pathlib import Path
from unittest import mock

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ds_config = pytest.importorskip("deepspeed.runtime.config")
from deepspeed.runtime import lr_schedules  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402
from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,  # noqa: E402
                                                   DeepSpeedZeroOffloadParamConfig)
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from pydantic import BaseModel, ValidationError  # noqa: E402

from fsdpzero.config import ConfigError, resolve_batch, schema  # noqa: E402
from fsdpzero.config.auto import resolve_autos  # noqa: E402
from fsdpzero.config.rules import SCHEDULERS  # noqa: E402

pytestmark = pytest.mark.oracle
logging.getLogger("DeepSpeed").setLevel(logging.CRITICAL)
CORPUS = sorted(glob.glob(str(Path(__file__).resolve().parents[1] / "ds_configs" / "*.json")))


def _ds_models():
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
    from deepspeed.runtime.tensor_parallel.config import TPConfig, TPTrainingConfig
    from deepspeed.inference.config import WeightQuantConfig
    return [(schema.ZeroOptimization, DeepSpeedZeroConfig), (schema.OffloadParam, DeepSpeedZeroOffloadParamConfig),
            (schema.OffloadOptimizer, DeepSpeedZeroOffloadOptimizerConfig), (schema.FP16, DeepSpeedFP16Config),
            (schema.BF16, DeepSpeedBF16Config), (schema.ZenFlow, ZenFlowConfig),
            (schema.LeafModule, DeepSpeedZeroLeafModuleConfig), (schema.TensorBoard, TensorBoardConfig),
            (schema.Wandb, WandbConfig), (schema.CSVMonitor, CSVConfig), (schema.Comet, CometConfig),
            (schema.CommsLogger, CommsLoggerConfig), (schema.Compile, CompileConfig),
            (schema.HybridEngine, HybridEngineConfig), (schema.ThroughputTimer, DeepSpeedThroughputTimerConfig),
            (schema.TensorParallel, TPTrainingConfig), (schema.TPInner, TPConfig),
            (schema.WeightQuantization, WeightQuantConfig)]


def _names(model) -> set[str]:
    return {n for n in model.model_fields} | {f.alias for f in model.model_fields.values() if f.alias}


def _plain(v):
    v = getattr(v, "value", v)
    if isinstance(v, BaseModel):
        return v.model_dump()
    if type(v).__module__ == "torch":
        return {"torch.float16": "fp16"}.get(str(v), str(v))
    return v


@pytest.mark.parametrize("ours, theirs", _ds_models(), ids=lambda m: m.__name__)
def test_strict_sections_have_deepspeeds_fields_and_defaults(ours, theirs):
    extra = {"mics_shard_size", "mics_hierarchical_params_gather"}   # removed in 0.19.8; we carry MiCS as HSDP
    if ours is schema.Compile:
        extra |= {"enabled", "backend", "kwargs"}   # older DeepSpeed's torch.compile keys, read by fsdpzero
    renamed = {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",      # deprecated: the loader
               "stage3_gather_fp16_weights_on_model_save"}                          # renames them first
    assert _names(ours) - extra == _names(theirs) - renamed
    for name, f in theirs.model_fields.items():
        if f.is_required() or name not in ours.model_fields:
            continue
        mine = ours.model_fields[name].get_default(call_default_factory=True)
        want = f.get_default(call_default_factory=True)
        if name == "overlap_comm" or isinstance(want, BaseModel) or (isinstance(want, dict) and not want):
            continue
        assert _plain(mine) == _plain(want), f"{theirs.__name__}.{name}: {mine!r} != {want!r}"


def test_scheduler_defaults_match_deepspeed_signatures():
    for name, spec in SCHEDULERS.items():
        sig = inspect.signature(getattr(lr_schedules, name).__init__)
        params = {k: p.default for k, p in sig.parameters.items()
                  if k not in ("self", "optimizer", "last_batch_iteration")}
        assert set(params) == set(spec), name
        for k, default in params.items():
            want = "required" if default is inspect.Parameter.empty else default
            assert spec[k] == want, f"{name}.{k}"


# ---------------------------------------------------------------- accept/reject parity on random sections
_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(-2.0, 2e9, allow_nan=False),
                    st.sampled_from(["cpu", "nvme", "none", "2", "1e3", "x", "True", "", "/tmp/nv"]),
                    st.just(math.inf), st.just(1e8))


def _section(model):
    keys = sorted(_names(model) - {"offload_param", "offload_optimizer", "zenflow", "leaf_module", "mics_shard_size",
                                    "mics_hierarchical_params_gather", "pipeline", "tp", "tensor_parallel"})
    return st.dictionaries(st.sampled_from(keys + ["bogus_key"]), _values, max_size=4)


def _accepts(cls, data) -> bool:
    try:
        if issubclass(cls, BaseModel) and cls.__module__.startswith("fsdpzero"):
            cls.model_validate(data)
        else:
            cls(**data)
        return True
    except (ValidationError, ValueError, TypeError, AssertionError):
        return False


@pytest.mark.parametrize("ours, theirs", [(schema.ZeroOptimization, DeepSpeedZeroConfig),
                                          (schema.FP16, DeepSpeedFP16Config), (schema.BF16, DeepSpeedBF16Config),
                                          (schema.OffloadParam, DeepSpeedZeroOffloadParamConfig),
                                          (schema.OffloadOptimizer, DeepSpeedZeroOffloadOptimizerConfig)],
                         ids=lambda m: m.__name__)
def test_random_sections_accepted_and_rejected_as_deepspeed(ours, theirs):
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_section(ours))
    def check(data):
        assert _accepts(ours, copy.deepcopy(data)) == _accepts(theirs, copy.deepcopy(data)), data
    check()


# ---------------------------------------------------------------- batch triad against DeepSpeedConfig
def _ds_batch(train, micro, ga, world):
    cfg = {k: v for k, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                             ("gradient_accumulation_steps", ga)) if v is not None}
    with mock.patch.object(ds_config.dist, "get_rank", return_value=0), \
            mock.patch.object(ds_config.dist, "get_world_size", return_value=world):
        c = ds_config.DeepSpeedConfig(cfg)
    assert c.world_size == world
    return c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.one_of(st.none(), st.integers(1, 300)), st.one_of(st.none(), st.integers(1, 40)),
       st.one_of(st.none(), st.integers(1, 16)), st.integers(1, 64))
def test_batch_triad_matches_deepspeed(train, micro, ga, world):
    try:
        want = _ds_batch(train, micro, ga, world)
    except AssertionError as e:
        with pytest.raises(ConfigError) as ours:
            resolve_batch(train, micro, ga, world)
        assert str(e) in [p.message for p in ours.value.problems]
        return
    assert resolve_batch(train, micro, ga, world) == want


# ---------------------------------------------------------------- the corpus
CTX = {"world_size": 8, "hidden_size": 4096, "max_steps": 1000}


def _resolved(path):
    raw = load_raw(path)
    resolve_autos(raw, CTX, hf_defaults=True, strict=False, strict_sections=schema.STRICT_SECTIONS)
    return raw


def load_raw(path):
    from fsdpzero.config.load import read_source
    return read_source(path)


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: Path(p).stem)
def test_corpus_rejections_match_deepspeed(path):
    raw = _resolved(path)
    try:
        with mock.patch.object(ds_config.dist, "get_rank", return_value=0), \
                mock.patch.object(ds_config.dist, "get_world_size", return_value=8):
            ds_config.DeepSpeedConfig(copy.deepcopy(raw))
        ds_error = None
    except Exception as e:                  # DeepSpeedConfigError, ValidationError, AssertionError
        ds_error = str(e)
    try:
        from fsdpzero.plan import Env
        from fsdpzero.plan.translate import build_plan
        build_plan(path, Env(world_size=8), context=CTX, hf_defaults=True)
        ours = None
    except ConfigError as e:
        ours = e.problems
    if ds_error is None:
        assert ours is None, f"we reject what DeepSpeed accepts: {ours}"
    else:
        assert ours, f"DeepSpeed rejects ({ds_error}) but we accept"
        named = [p for p in ours if p.key.rsplit(".", 1)[-1] in ds_error or p.message in ds_error]
        assert named, f"DeepSpeed: {ds_error!r}; ours: {ours}"
