"""The translation goldens (tests/goldens/*.json) are written by build_plan itself, so on their own they are change
detectors: tests/plan/test_translate.py::test_translation_goldens catches a plan that changed, not a plan that was
wrong. Here every field of a golden that DeepSpeed's own config parser (DeepSpeedConfig, 0.19.8) also defines is
checked against what that parser makes of the same ds_config ("auto" resolved as the HF Trainer does, the goldens'
context): batch triad, clipping, ZeRO stage and buckets, offload devices/paths/buffers, aio, fp16 loss scaling,
bf16, optimizer and scheduler type and parameters, checkpoint and activation-checkpointing flags. Fields DeepSpeed
does not define (the FSDP2 mesh, reshard_after_forward, our dtypes) stay change-detected only.
"""
import copy
import json
import os
from unittest import mock

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ds_config = pytest.importorskip("deepspeed.runtime.config")

from fsdpzero.config import schema  # noqa: E402
from fsdpzero.config.auto import resolve_autos  # noqa: E402
from fsdpzero.config.load import read_source  # noqa: E402
from tests.plan.test_translate import GOLDEN, GOLDEN_CTX, HERE  # noqa: E402

pytestmark = pytest.mark.oracle


def _world(name: str) -> int:
    return 1 if name == "dsex_sglang_nvme_aio" else 8   # as golden_of


def _deepspeed(name: str):
    raw = read_source(HERE / "ds_configs" / f"{name}.json")
    resolve_autos(raw, {"world_size": _world(name), **GOLDEN_CTX}, hf_defaults=True, strict=False,
                  strict_sections=schema.STRICT_SECTIONS)
    with mock.patch.object(ds_config.dist, "get_rank", return_value=0), \
            mock.patch.object(ds_config.dist, "get_world_size", return_value=_world(name)):
        return ds_config.DeepSpeedConfig(copy.deepcopy(raw))


def _offload_device(section) -> str:
    return "none" if section is None else str(getattr(section.device, "value", section.device))


def deepspeed_view(ds) -> dict:
    """golden plan path -> DeepSpeed's value for it."""
    z, fp16 = ds.zero_config, ds.float16_config
    opt_off, par_off = z.offload_optimizer, z.offload_param
    view = {
        "batch.train_batch_size": ds.train_batch_size,
        "batch.micro_batch_size": ds.train_micro_batch_size_per_gpu,
        "batch.gradient_accumulation_steps": ds.gradient_accumulation_steps,
        "batch.gradient_clipping": ds.gradient_clipping,
        "batch.steps_per_print": ds.steps_per_print,
        "batch.wall_clock_breakdown": ds.wall_clock_breakdown,
        "batch.prescale_gradients": ds.prescale_gradients,
        "batch.gradient_predivide_factor": ds.gradient_predivide_factor,
        "batch.dataloader_drop_last": ds.dataloader_drop_last,
        "shard.stage": ds.zero_optimization_stage,
        "shard.reduce_bucket_size": z.reduce_bucket_size,
        "shard.allgather_bucket_size": z.allgather_bucket_size,
        "shard.overlap_comm": z.overlap_comm,
        "shard.prefetch_bucket_size": z.prefetch_bucket_size,
        "shard.gather_16bit_weights_on_model_save": z.gather_16bit_weights_on_model_save,
        "shard.ignore_unused_parameters": z.ignore_unused_parameters,
        "offload.optimizer_device": _offload_device(opt_off),
        "offload.param_device": _offload_device(par_off),
        "offload.sub_group_size": z.sub_group_size,
        "offload.aio": dict(ds.aio_config),
        "optimizer.type": (ds.optimizer_name or "").lower() or None,
        "scheduler.type": ds.scheduler_name,
        "checkpoint.tag_validation": ("ignore" if not ds.checkpoint_tag_validation_enabled else
                                      "fail" if ds.checkpoint_tag_validation_fail else "warn"),
        "checkpoint.use_node_local_storage": ds.use_node_local_storage,
        "checkpoint.load_universal": ds.load_universal_checkpoint,
        "activation_checkpointing.cpu_checkpointing": ds.activation_checkpointing_config.cpu_checkpointing,
        "activation_checkpointing.number_checkpoints": ds.activation_checkpointing_config.number_checkpoints,
        "precision.param_dtype": ("bfloat16" if ds.bfloat16_config.enabled else
                                  "float16" if fp16.enabled else "float32"),
    }
    if z.stage == 3:
        view["shard.param_persistence_threshold"] = z.param_persistence_threshold
    if opt_off is not None:
        view.update({"offload.buffer_count": opt_off.buffer_count, "offload.ratio": opt_off.ratio,
                     "offload.optimizer_nvme_path": None if opt_off.nvme_path is None else str(opt_off.nvme_path)})
    if par_off is not None:
        view.update({"offload.param_buffer_count": par_off.buffer_count,
                     "offload.param_buffer_size": par_off.buffer_size, "offload.max_in_cpu": par_off.max_in_cpu,
                     "offload.param_nvme_path": None if par_off.nvme_path is None else str(par_off.nvme_path)})
    if fp16.enabled:   # DeepSpeed's dynamic loss scaler settings (a static scale when loss_scale > 0)
        view.update({"precision.loss_scale.loss_scale": fp16.loss_scale,
                     "precision.loss_scale.initial_scale_power": fp16.initial_scale_power,
                     "precision.loss_scale.loss_scale_window": fp16.loss_scale_window,
                     "precision.loss_scale.hysteresis": fp16.hysteresis,
                     "precision.loss_scale.consecutive_hysteresis": fp16.consecutive_hysteresis,
                     "precision.loss_scale.min_loss_scale": fp16.min_loss_scale})
    else:
        view["precision.loss_scale"] = None
    if ds.bfloat16_config.enabled:
        view["precision.check_grad_overflow"] = ds.bfloat16_config.check_grad_overflow
    for key, value in (ds.optimizer_params or {}).items():   # every optimizer/scheduler parameter the plan carries
        view[f"optimizer.params.{key}"] = value
    for key, value in (ds.scheduler_params or {}).items():
        view[f"scheduler.params.{key}"] = value
    return view


def _at(plan: dict, path: str):
    node = plan
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return KeyError
        node = node[part]
    return node


def _same(ours, theirs) -> bool:
    if isinstance(theirs, (list, tuple)):
        return isinstance(ours, (list, tuple)) and list(ours) == list(theirs)
    if isinstance(theirs, float) or isinstance(ours, float):
        return ours is not None and theirs is not None and float(ours) == float(theirs)
    return ours == theirs


# Where the plan deliberately differs from DeepSpeed's reading (each said in the fate table / docs)
DIFFER = {
    "optimizer.params.torch_adam", "optimizer.params.adam_w_mode",   # read into optimizer.torch_adam / adam_w_mode
}


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_agrees_with_deepspeeds_parser(name):
    golden = json.loads((HERE / "goldens" / f"{name}.json").read_text())["plan"]
    theirs = deepspeed_view(_deepspeed(name))
    checked, wrong = 0, []
    for path, value in sorted(theirs.items()):
        if path in DIFFER:
            continue
        ours = _at(golden, path)
        if path.startswith(("optimizer.params.", "scheduler.params.")) and ours is KeyError:
            wrong.append(f"{path}: DeepSpeed has {value!r}, the plan drops it")
            continue
        assert ours is not KeyError, f"{name}: the golden plan has no {path}"
        checked += 1
        if not _same(ours, value):
            wrong.append(f"{path}: plan {ours!r}, DeepSpeed {value!r}")
    assert not wrong, f"{name}: the golden disagrees with DeepSpeed's parser:\n  " + "\n  ".join(wrong)
    assert checked >= 25
