"""The optimizer wing: the gradient-path contract the engine drives (grad_path.py), the optimizer built from the
config's `optimizer` section (factory.py, lamb.py, muon.py), DeepSpeed's LR schedules (schedulers.py) and the stage-1
gradient path over fsdpzero_ops.stage1 (stage1.py). The offload paths live in fsdpzero.offload."""
from fsdpzero.optim.factory import (  # noqa: F401
    AdamNoBiasCorrection, OptimizerFactory, check_optimizer, make_optimizer_factory,
)
from fsdpzero.optim.grad_path import (  # noqa: F401
    FSDPGradPath, GradPath, clip_factor, global_grad_norm, keeping_impl_flags, skips_on_device, step_unless,
)
