"""Every `mapped` / `approximated` fate is carried by runtime code: a fate that names a plan field
(`PrecisionPlan.optimizer_state_dtype`) must name a real field whose declared consumer (fsdpzero.plan.types.CONSUMERS)
is a runtime module outside the plan/config/cli layers that reads it. Plus cheap exercises of the consumers that the
issue found unread (monitor sections, the optimizer-state dtype, the aio settings)."""
import ast
import dataclasses
import importlib
import inspect
import re
import textwrap

import pytest

from fsdpzero.plan import types as plan_types
from fsdpzero.plan.fate_table import RULES, Rule
from fsdpzero.plan.types import CONSUMERS

FIELD_REF = re.compile(r"\b([A-Z]\w*Plan)\.(\w+)")
NOT_RUNTIME = ("fsdpzero.plan", "fsdpzero.config", "fsdpzero.cli")


def _resolve(consumer: str):
    module, _, qual = consumer.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qual.split(".")):
        obj = getattr(obj, part)
    return module, obj


def reads(obj, field: str) -> bool:
    """Code (not a comment or docstring) in obj that reads `field`: an attribute `x.field`, a dataclass field of that
    name copied by name (the ops' AioConfig, filled by aio_config), or the exact string (getattr(plan, "field"),
    a section-name table)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == field:
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == field:
            return True
        if isinstance(node, ast.Constant) and node.value == field:
            return True
    return False


def carried_problems(rules, consumers) -> list[str]:
    """What is wrong with the claim "this key is carried" for each mapped/approximated rule naming a plan field."""
    out = []
    for rule in rules:
        if rule.status not in ("mapped", "approximated"):
            continue
        for cls_name, field in FIELD_REF.findall(rule.how):
            ref = f"{cls_name}.{field}"
            cls = getattr(plan_types, cls_name, None)
            if cls is None or not dataclasses.is_dataclass(cls) or field not in {f.name for f in
                                                                                 dataclasses.fields(cls)}:
                out.append(f"{rule.pattern}: {ref} is not a plan field")
                continue
            if ref not in consumers:
                out.append(f"{rule.pattern}: {ref} declares no consumer (nothing at runtime reads it)")
                continue
            for consumer in consumers[ref]:
                module, obj = _resolve(consumer)
                if module.startswith(NOT_RUNTIME):
                    out.append(f"{rule.pattern}: {ref}'s consumer {consumer} is not runtime code")
                elif not reads(obj, field):
                    out.append(f"{rule.pattern}: {ref}'s consumer {consumer} never reads {field!r}")
    return out


def test_every_carried_fate_names_a_field_that_runtime_code_reads():
    problems = carried_problems(RULES, CONSUMERS)
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_unread_field_and_a_wrong_consumer():
    from fsdpzero.plan.fate_table import ALWAYS
    bad = (Rule("x", ALWAYS, "mapped", "PrecisionPlan.optimizer_state_dtype: claimed"),
           Rule("y", ALWAYS, "approximated", "BatchPlan.gradient_predivide_factor: claimed"),
           Rule("z", ALWAYS, "mapped", "ShardPlan.no_such_field"),
           Rule("w", ALWAYS, "noop", "BatchPlan.gradient_predivide_factor: a noop may name anything"))
    wrong = {"PrecisionPlan.optimizer_state_dtype": ("fsdpzero.precision:mp_policy",)}
    got = carried_problems(bad, wrong)
    assert got == ["x: PrecisionPlan.optimizer_state_dtype's consumer fsdpzero.precision:mp_policy never reads "
                   "'optimizer_state_dtype'",
                   "y: BatchPlan.gradient_predivide_factor declares no consumer (nothing at runtime reads it)",
                   "z: ShardPlan.no_such_field is not a plan field"]


def test_every_declared_consumer_exists():
    for ref, consumers in CONSUMERS.items():
        cls_name, field = ref.split(".")
        assert field in {f.name for f in dataclasses.fields(getattr(plan_types, cls_name))}, ref
        for c in consumers:
            _resolve(c)


# -- exercising the consumers the issue found unread ---------------------------------------------------------------

def test_monitor_sections_of_the_plan_become_writers(tmp_path):
    from fsdpzero.monitor import Monitor
    from fsdpzero.plan.translate import build_plan
    plan = build_plan({"train_micro_batch_size_per_gpu": 1,
                       "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
                       "comet": {"enabled": False}})
    assert plan.monitor.csv_monitor is not None and plan.monitor.comet is None
    m = Monitor(plan.monitor, rank=0)
    assert [type(w).__name__ for w in m.writers] == ["_CsvWriter"]
    m.write_events([("Train/Samples/lr", 0.5, 4)])
    assert (tmp_path / "j" / "Train_Samples_lr.csv").read_text().splitlines() == ["step,lr", "4,0.5"]


@pytest.mark.parametrize("bf16, offload, ok", [
    ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, None, True),
    ({"bf16_master_weights_and_grads": True}, None, False),          # DeepSpeed: needs offload_optimizer
    ({"bf16_master_weights_and_grads": True}, {"device": "cpu"}, True),
    ({}, None, True),
])
def test_optimizer_state_dtype_is_checked_before_any_process_group(bf16, offload, ok):
    from fsdpzero.optim.factory import check_optimizer
    from fsdpzero.plan.translate import build_plan
    z = {"stage": 2, **({"offload_optimizer": {**offload, "pin_memory": False}} if offload else {})}
    plan = build_plan({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                       "bf16": {"enabled": True, **bf16}, "zero_optimization": z})
    if ok:
        check_optimizer(plan)
    else:
        with pytest.raises(ValueError, match=r"^config key 'bf16.bf16_optimizer_states' = false: .*set "
                                             r"bf16.bf16_optimizer_states to true"):
            check_optimizer(plan)


def test_aio_plan_reaches_the_op_config():
    from fsdpzero.offload.swapdir import aio_config
    from fsdpzero.plan import AioPlan
    plan = AioPlan(block_size=2 * 1_048_576, queue_depth=3, intra_op_parallelism=2, single_submit=True,
                   overlap_events=False)
    cfg = aio_config(plan)
    assert dataclasses.asdict(cfg) | {"use_gds": False} == dataclasses.asdict(plan)


B16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


@pytest.mark.parametrize("cfg, key, nodes, status", [
    ({"gradient_predivide_factor": 4.0}, "gradient_predivide_factor", 1, "approximated"),
    ({"gradient_predivide_factor": 1.0}, "gradient_predivide_factor", 1, "mapped"),
    ({"activation_checkpointing": {"number_checkpoints": 4}}, "activation_checkpointing.number_checkpoints", 1,
     "noop"),
    ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage", 1, "noop"),
    ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage", 2, "unsupported"),
    ({"bf16": B16, "zero_optimization": {"stage": 2}}, "bf16.bf16_optimizer_states", 1, "mapped"),
    ({"bf16": B16, "zero_optimization": {"stage": 1}}, "bf16.bf16_optimizer_states", 1, "approximated"),
    ({"bf16": B16, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "bf16.bf16_optimizer_states", 1, "approximated"),
    ({"aio": {"use_gds": True}}, "aio.use_gds", 1, "unsupported"),
    ({"comet": {"enabled": True, "project": "p"}}, "comet.project", 1, "mapped"),
    ({"zero_optimization": {"stage": 0, "reduce_bucket_size": 10}}, "zero_optimization.reduce_bucket_size", 1,
     "noop"),
    ({"log_level": "debug"}, "log_level", 1, "noop"),
])
def test_relabelled_fates(cfg, key, nodes, status):
    from fsdpzero.plan import Env
    from fsdpzero.plan.translate import build_plan
    plan = build_plan({"train_micro_batch_size_per_gpu": 1, **cfg}, Env(world_size=2 * nodes, nodes=nodes))
    got = {d.key: d for d in plan.decisions}[key]
    assert got.status == status, got
