"""The plan wing: what a DeepSpeed config becomes under FSDP2, as frozen dataclasses (types.py), built by the pure
function in translate.py, with every key's fate (fates.py over fate_table.py) and one renderer of that report
(report.py). Nothing here imports torch."""
from fsdpzero.plan.types import (  # noqa: F401
    ActivationCheckpointPlan, AioPlan, BatchPlan, CheckpointPlan, CompilePlan, Decision, DType, Env, LossScalePlan,
    MonitorPlan, OffloadPlan, OptimizerPlan, Plan, PrecisionPlan, SchedulerPlan, ShardPlan, Status,
)
