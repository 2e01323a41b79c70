"""The offload paths read the `optimizer` section's Adam hyper-parameters as they are (fsdpzero.optim.factory's
AdamSection.groups), without building a torch optimizer only to read them: each group's lr, betas, eps, weight decay,
decoupled weight decay and bias correction equal what the optimizer the section describes would hold, for every form
the section takes (Adam/AdamW, torch_adam, adam_w_mode, bias_correction, model_parameters groups)."""
import pytest
import torch

from fsdpzero.offload import build as offload
from fsdpzero.optim import AdamNoBiasCorrection, make_optimizer_factory
from fsdpzero.plan.translate import build_plan

SECTIONS = {
    "adamw": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.05}},
    "adamw_defaults": {"type": "AdamW", "params": {}},
    "adamw_torch_defaults": {"type": "AdamW", "params": {"torch_adam": True}},
    "adam_l2": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}},
    "adam_decoupled": {"type": "Adam", "params": {"lr": 3e-4, "weight_decay": 0.1}},
    "no_bias_correction": {"type": "AdamW", "params": {"lr": 5e-4, "bias_correction": False, "weight_decay": 0.2}},
}
KEYS = ("lr", "betas", "eps", "weight_decay")


def _plan(section):
    return build_plan({"train_micro_batch_size_per_gpu": 1, "optimizer": section,
                       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _reference(optimizer):
    """What hyper_groups_of (the client-optimizer reading) takes from a built optimizer: the expected groups."""
    return [{k: g[k] for k in (*KEYS, "decoupled_weight_decay", "bias_correction")}
            for g in offload.hyper_groups_of(optimizer)]


@pytest.mark.parametrize("name", list(SECTIONS))
@pytest.mark.parametrize("grouped", [False, True], ids=["one_group", "model_parameters_groups"])
def test_offload_reads_the_section_without_building_an_optimizer(monkeypatch, name, grouped):
    plan = _plan(SECTIONS[name])
    model = _model()
    params = [p for p in model.parameters()]
    groups = ([{"params": params[:2], "lr": 7e-4, "weight_decay": 0.3}, {"params": params[2:]}] if grouped else None)
    factory = make_optimizer_factory(plan, original_params=params, param_groups=groups)
    want = _reference(factory(params))   # the optimizer the section describes, built here only as the reference

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__} built to read hyper-parameters")
    for cls in (torch.optim.Adam, torch.optim.AdamW, AdamNoBiasCorrection):
        monkeypatch.setattr(cls, "__init__", refuse)
    path = offload.build_offload_path(model, plan, factory)
    monkeypatch.undo()
    got = [{k: g[k] for k in (*KEYS, "decoupled_weight_decay", "bias_correction")}
           for g in path.optimizer.param_groups]
    assert got == want
    assert [len(g["params"]) for g in path.optimizer.param_groups] == ([2, 2] if grouped else [4])


def test_amsgrad_in_the_section_is_refused_clearly():
    plan = _plan({"type": "AdamW", "params": {"amsgrad": True}})
    with pytest.raises(NotImplementedError, match="amsgrad"):
        offload.build_offload_path(_model(), plan, make_optimizer_factory(plan))
