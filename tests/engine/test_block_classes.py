"""Activation checkpointing and torch.compile of blocks that are not Hugging Face layers come from classes put in
front of each block's class (fsdpzero.activation.CheckpointedBlock, fsdpzero.compile.CompiledForward), not from a
`forward` replaced on the instance. Through the engine, on one gloo rank (FSDP2, stage 3): backward recomputes each
block's own forward (twice the forward calls), cpu_checkpointing runs the block under save_on_cpu, compiling keeps
the signature and the parameter names, and the losses and weights equal the plain run's bit for bit."""
import dataclasses
import inspect

import torch
from torch import nn

from fsdpzero.plan import CompilePlan
from tests.engine_cases import make_plan
from tests.multirank import run_distributed

STEPS = 2


class Block(nn.Module):
    calls = 0         # eager forward calls, recomputes included (not counted in a compiled graph)

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, scale: float = 1.0):
        if not torch.compiler.is_compiling():
            Block.calls += 1
        return x + scale * self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x, scale=0.5)
        return self.head(x).square().mean()


def _run(plan, compile_with=None):
    from fsdpzero.api import wrap
    engine = wrap(Net(), plan, block_classes=[Block])
    if compile_with:
        engine.compile(backend=compile_with)
    Block.calls = 0
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        loss = engine(torch.randn(4, 16, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()}
    return engine, {"losses": losses, "params": params, "calls": Block.calls}


def _runs(rank, world):
    from fsdpzero.activation import CheckpointedBlock, CheckpointedToCPUBlock
    from fsdpzero.compile import CompiledForward
    plain = make_plan(world=world, stage=3)
    entered = []
    real_save_on_cpu = torch.autograd.graph.save_on_cpu

    def save_on_cpu(*args, **kwargs):
        entered.append(1)
        return real_save_on_cpu(*args, **kwargs)
    torch.autograd.graph.save_on_cpu = save_on_cpu   # this forked rank only
    out = {}
    _, out["plain"] = _run(plain)
    out["plain"]["save_on_cpu"] = len(entered)
    engine, out["ac"] = _run(make_plan(world=world, stage=3, ac=True))
    out["ac"]["save_on_cpu"] = len(entered)
    block = engine.blocks[0]
    out["ac"]["types"] = (isinstance(block, CheckpointedBlock), isinstance(block, CheckpointedToCPUBlock),
                          "Block" in type(block).__name__)
    entered.clear()
    engine, out["ac_cpu"] = _run(make_plan(world=world, stage=3, ac=True, ac_cpu=True))
    out["ac_cpu"]["save_on_cpu"] = len(entered)
    out["ac_cpu"]["types"] = isinstance(engine.blocks[0], CheckpointedToCPUBlock)
    compiled = dataclasses.replace(make_plan(world=world, stage=3, ac=True),
                                   compile=CompilePlan(enabled=True, backend="aot_eager", source="test"))
    engine, out["compiled"] = _run(compiled)
    block = engine.blocks[0]
    out["compiled"]["types"] = (isinstance(block, CompiledForward), isinstance(block, CheckpointedBlock),
                                "forward" not in vars(block), "Block" in type(block).__name__)
    out["compiled"]["signature"] = str(inspect.signature(block.forward))
    out["compiled"]["report"] = engine.compile_report
    engine.compile(backend="aot_eager")             # idempotent: the unit keeps its one compiled forward
    out["compiled"]["again"] = block.compiled_forward is vars(block)["compiled_forward"] and \
        type(block).__mro__.count(CompiledForward) == 1
    return out


def test_checkpointing_and_compile_are_classes_with_the_plain_results():
    (r,) = run_distributed(_runs, 1, timeout=300)
    plain, ac, ac_cpu, compiled = r["plain"], r["ac"], r["ac_cpu"], r["compiled"]
    assert plain["calls"] == 3 * STEPS and plain["save_on_cpu"] == 0
    assert ac["calls"] == 2 * 3 * STEPS, "backward did not recompute each block's forward once"
    assert ac["save_on_cpu"] == 0 and ac["types"] == (True, False, True)
    # cpu_checkpointing: each block's checkpointed forward under save_on_cpu (the recompute is not)
    assert ac_cpu["calls"] == 2 * 3 * STEPS and ac_cpu["save_on_cpu"] == 3 * STEPS and ac_cpu["types"]
    assert compiled["types"] == (True, True, True, True)
    assert compiled["signature"] == "(x, scale: float = 1.0)"
    assert compiled["report"]["graph_breaks"] == 0 and compiled["report"]["compiled_units"] == 3, str(compiled["report"])
    assert compiled["again"]
    for run in (ac, ac_cpu, compiled):
        assert run["losses"] == plain["losses"]
        assert list(run["params"]) == list(plain["params"])          # no wrapper part in any name
        for k, v in plain["params"].items():
            assert torch.equal(run["params"][k], v), k
    assert plain["losses"][0] != plain["losses"][-1]
