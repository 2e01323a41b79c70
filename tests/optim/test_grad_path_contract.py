"""The gradient-path contract (fsdpzero/optim/grad_path.py): one dispatch from the plan (fsdpzero.api.grad_path_type)
gives a type that lays the model out and builds itself; nothing else in the library tells paths apart by name."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from fsdpzero.api import grad_path_type
from fsdpzero.optim import FSDPGradPath, GradPath
from fsdpzero.plan import OffloadPlan
from fsdpzero.plan.types import ZenFlowPlan
from tests.engine_cases import make_plan

PKG = Path(__file__).resolve().parents[2] / "fsdpzero"


def _types():
    cpu, nvme = OffloadPlan(optimizer_device="cpu"), OffloadPlan(optimizer_device="nvme")
    plans = [make_plan(stage=s) for s in (0, 1, 2, 3)]
    plans += [dataclasses.replace(make_plan(stage=s), offload=o) for s in (2, 3) for o in (cpu, nvme)]
    plans += [dataclasses.replace(make_plan(stage=1), offload=cpu)]
    plans += [dataclasses.replace(make_plan(stage=2), offload=cpu, zenflow=ZenFlowPlan(update_interval=4))]
    return [grad_path_type(p) for p in plans]


def test_the_dispatch_gives_every_offload_device_its_own_type():
    from fsdpzero.offload.nvme_path import NVMeGradPath
    from fsdpzero.offload.path import OffloadGradPath
    nvme = dataclasses.replace(make_plan(stage=3), offload=OffloadPlan(optimizer_device="nvme"))
    assert grad_path_type(nvme) is NVMeGradPath
    assert grad_path_type(dataclasses.replace(nvme, offload=OffloadPlan(optimizer_device="cpu"))) is OffloadGradPath
    assert grad_path_type(make_plan(stage=0)) is FSDPGradPath


def test_every_type_the_dispatch_gives_lays_out_and_builds_itself():
    for path_type in set(_types()):
        assert issubclass(path_type, GradPath), path_type
        # build is the type's own (GradPath.build only says it is not built from a plan)
        assert path_type.build.__func__ is not GradPath.build.__func__, path_type
        assert callable(path_type.lay_out) and path_type.name, path_type
    assert {t.name for t in _types()} == {"fsdp", "stage1", "offload", "zenflow"}


def test_a_wrong_offload_type_for_the_plan_is_refused():
    from fsdpzero.offload.path import OffloadGradPath
    nvme = dataclasses.replace(make_plan(stage=3), offload=OffloadPlan(optimizer_device="nvme"))
    with pytest.raises(ValueError, match="grad_path_type"):
        OffloadGradPath.build(torch.nn.Linear(2, 2), nvme, lambda ps: torch.optim.AdamW(ps))


def _name_checks(path: Path, names: set[str]) -> list[str]:
    """Comparisons of a value with a path type's name ("stage1" == x, x in ("offload", ...))."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
            if consts:
                out.append(f"{path.name}:{node.lineno}")
    return out


def test_no_module_tells_paths_apart_by_name():
    names = {t.name for t in _types()}
    bad = [f"{path.parent.name}/{hit}" for path in sorted(PKG.rglob("*.py")) for hit in _name_checks(path, names)]
    assert not bad, bad


def test_the_name_check_finder_finds_one(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f(name):\n    if name == 'stage1':\n        return 1\n    return name in ('fsdp', 'x')\n")
    assert len(_name_checks(f, {"stage1", "fsdp"})) == 2


def test_stage1_knows_elementwise_optimizers_by_type():
    from fsdpzero.optim import AdamNoBiasCorrection
    from fsdpzero.optim.lamb import Lamb
    from fsdpzero.optim.stage1 import ELEMENTWISE
    from fsdpzero_ops import CPUAdamW
    p = [torch.zeros(2, requires_grad=True)]
    for opt in (torch.optim.AdamW(p), torch.optim.SGD(p, lr=0.1), CPUAdamW(p), AdamNoBiasCorrection(p)):
        assert isinstance(opt, ELEMENTWISE), type(opt).__name__
    assert not isinstance(Lamb(p), ELEMENTWISE)
