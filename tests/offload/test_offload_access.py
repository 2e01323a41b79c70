"""With the overlapped CPU step, reads of the weights wait for it (fsdpzero/offload/access.py) through classes a reader
finds from the type, not through methods patched onto each instance: every module's class and the optimizer's class
get WaitsForStep / StateWaitsForStep in front (as fully_shard puts FSDPModule in front), under their own names. The
reads themselves waiting is tested by test_offload_engine.py and test_offload_speculate.py (path.reads.waits)."""
import copy

import torch

from fsdpzero.offload import build as offload
from fsdpzero.offload import access
from fsdpzero.plan import OffloadPlan, Plan
from tests.multirank import run_distributed
from tests.offload.test_offload import HYPER
from tests.offload.test_offload_pipeline import _stage2_model

PATCHED = ("parameters", "named_parameters", "zero_grad", "state_dict", "load_state_dict")


def _guarded(rank, world):
    torch.set_num_threads(1)
    model = _stage2_model()
    names_before = [type(m).__name__ for m in model.modules()]
    plan = Plan(offload=OffloadPlan(optimizer_device="cpu", sub_group_size=700))
    path = offload.build_offload_path(model, plan, lambda ps: torch.optim.AdamW(ps, **HYPER), stage=True,
                                      overlap=True)
    opt = path.optimizer
    patched = sorted({k for m in model.modules() for k in vars(m) if k in PATCHED}
                     | {k for k in vars(opt) if k in PATCHED})
    module_mixin, optimizer_mixin = (getattr(access, n, type(None)) for n in ("WaitsForStep", "StateWaitsForStep"))
    block = model.blocks[0]
    pending = {"on": True}
    path.reads.pending = lambda: pending["on"]          # a step in flight: reads must wait
    path.reads._wait = lambda: pending.update(on=False)
    list(block.parameters())                            # a submodule's read waits (through its class)
    waited_module = path.reads.waits
    pending["on"] = True
    opt.state_dict()                                    # the optimizer's state read waits
    waited_optimizer = path.reads.waits - waited_module
    pending["on"] = True
    model.zero_grad()                                   # gradients only: no wait
    waited_zero_grad = path.reads.waits - waited_module - waited_optimizer
    pending["on"] = False
    twin = copy.deepcopy(model.out)                     # a copy keeps its class, hence the guard
    return {"instance_attrs": patched,
            "modules_guarded": all(isinstance(m, module_mixin) for m in model.modules()),
            "optimizer_guarded": isinstance(opt, optimizer_mixin),
            "names_kept": [type(m).__name__ for m in model.modules()] == names_before
            and type(opt).__name__ == "CPUAdam",
            "waits": (waited_module, waited_optimizer, waited_zero_grad),
            "copy_guarded": isinstance(twin, module_mixin) and getattr(twin, "read_guard", None) is path.reads}


def test_reads_wait_through_classes_not_instance_patches():
    r = run_distributed(_guarded, 1, timeout=180)[0]
    assert r["instance_attrs"] == []
    assert r["modules_guarded"] and r["optimizer_guarded"] and r["names_kept"]
    assert r["waits"] == (1, 1, 0)
    assert r["copy_guarded"]
