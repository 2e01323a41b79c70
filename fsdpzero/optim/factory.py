"""The optimizer: the DeepSpeed `optimizer` section (or a client optimizer) as a function
`params -> torch.optim.Optimizer`, so whoever owns the parameters (FSDP2 shards, a stage-1 flat shard, CPU copies
for offload) builds the optimizer over *its* tensors. `check_optimizer` raises DeepSpeed's optimizer errors before
any process group exists.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fsdpzero.plan import Plan

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]   # params (or param-group dicts) -> optimizer


# DeepSpeed runs these under ZeRO without `zero_allow_untested_optimizer` (torch Adam/AdamW/Adagrad and its own
# fused/CPU Adam, Adagrad, Lion); every other optimizer needs the flag at stage >= 1.
_ZERO_TESTED = ("adam", "adamw", "adagrad", "lion", "muon")
_DS_ONLY_KEYS = ("torch_adam", "adam_w_mode", "adamw_mode", "bias_correction", "legacy_fusion", "set_grad_none")


def check_optimizer(plan: Plan, client: Any = None) -> None:
    """Errors DeepSpeed raises about the optimizer, raised before any process group exists."""
    opt = plan.optimizer
    if opt.type is None and client is None:
        raise ValueError("config key 'optimizer' is missing and no optimizer was passed: add an \"optimizer\" "
                         "section (e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}) or pass optimizer=...")
    if _is_onebit_adam(opt.type) and client is None and plan.shard.stage >= 1:
        raise ValueError(f"config key 'optimizer.type' = {opt.type!r} with zero_optimization.stage "
                         f"{plan.shard.stage}: DeepSpeed's 1-bit Adam ran without ZeRO only (\"1bit-Adam is not "
                         "compatible with ZeRO\"); use stage 0, or \"AdamW\" with ZeRO")
    if plan.shard.stage >= 1 and not opt.zero_allow_untested_optimizer:
        name = _client_name(client) if client is not None else opt.type
        if name.lower() not in _ZERO_TESTED and name not in ("Adam", "AdamW", "Adagrad"):
            raise ValueError(
                f"optimizer {name!r} is not one DeepSpeed tests with ZeRO (stage {plan.shard.stage}); DeepSpeed "
                "refuses it unless the config sets \"zero_allow_untested_optimizer\": true. Add that key to run it.")
    prec = plan.precision
    # DeepSpeed: 16-bit masters keep the moments in their dtype on the device, so fp32 moments need offload_optimizer
    # (DeepSpeed's CPU Adam); bf16_optimizer_states says the bf16 moments are meant. torch's optimizers allocate
    # their state in the parameter's dtype, which is the master dtype here: the two must agree.
    if prec.master_dtype != prec.optimizer_state_dtype and prec.optimizer_state_dtype == "float32" \
            and plan.offload.optimizer_device == "none" and plan.shard.stage != 1:
        key = ("bf16.bf16_optimizer_states' = false" if prec.master_dtype == "bfloat16"
               else "fp16.fp16_master_weights_and_grads' = true")
        fix = ("set bf16.bf16_optimizer_states to true (bf16 Adam moments), or offload the optimizer "
               "(zero_optimization.offload_optimizer.device \"cpu\") to keep fp32 moments on the CPU"
               if prec.master_dtype == "bfloat16" else "offload the optimizer (zero_optimization.offload_optimizer."
               "device \"cpu\"), as DeepSpeed requires")
        raise ValueError(f"config key '{key}: {prec.master_dtype} master weights would keep the optimizer's moments "
                         f"in {prec.master_dtype} on the device, which DeepSpeed refuses without optimizer offload; "
                         f"{fix}")
    if opt.type == "muon" and client is None:
        _check_muon(plan)
    if _is_onebit_adam(opt.type) and client is None:
        if opt.params.get("amsgrad"):
            raise ValueError("config key 'optimizer.params.amsgrad' = true: 1-bit Adam has no AMSGrad variant; "
                             "remove it")
        return
    if opt.type is not None and opt.type not in ("adam", "adamw", "lamb", "sgd", "adagrad", "muon") \
            and not hasattr(torch.optim, opt.type):
        raise ValueError(f"config key 'optimizer.type' = {opt.type!r} is neither a DeepSpeed optimizer nor a "
                         "torch.optim class; use e.g. \"AdamW\", \"Lamb\", \"SGD\", or a torch.optim class name")


def _is_onebit_adam(name: str | None) -> bool:
    return (name or "").lower() == "onebitadam"


def _check_muon(plan: Plan) -> None:
    """What fsdpzero's Muon (fsdpzero/optim/muon.py) does not carry, refused with the fix."""
    from fsdpzero.optim.muon import check_muon
    check_muon(plan.optimizer.params)
    if plan.offload.optimizer_device == "nvme":
        raise ValueError("config key 'zero_optimization.offload_optimizer.device' = 'nvme' with optimizer.type "
                         "\"Muon\" is not implemented in fsdpzero; use offload_optimizer.device \"cpu\" (Muon's "
                         "momentum and the masters in CPU memory)")
    if plan.offload.optimizer_device == "cpu" and float(plan.offload.ratio) < 1.0:
        raise ValueError(f"config key 'zero_optimization.offload_optimizer.ratio' = {plan.offload.ratio} with "
                         "optimizer.type \"Muon\" is not implemented in fsdpzero (its device-stepped part runs "
                         "Adam); set ratio to 1.0")
    if plan.precision.loss_scale is not None:
        raise ValueError("config key 'fp16.enabled' = true with optimizer.type \"Muon\": DeepSpeed keeps Muon's "
                         "momentum in loss-scaled units and fsdpzero does not reproduce that; use bf16 or fp32")


def _client_name(client: Any) -> str:
    if isinstance(client, torch.optim.Optimizer):
        return type(client).__name__
    return getattr(client, "__name__", type(client).__name__)


def make_optimizer_factory(plan: Plan, client: Any = None, *, device_type: str = "cpu",
                           original_params: list[torch.Tensor] | None = None,
                           param_groups: list[dict] | None = None) -> OptimizerFactory:
    """Returns `params -> optimizer`, where params are the trainable parameters in model order (FSDP2 shards,
    or whatever tensors a gradient path optimises in their place).

    The client's `model_parameters` groups and a client optimizer instance were built over the *original*
    parameters (`original_params`, same order); they are re-pointed at the new tensors by position. A client
    optimizer is rebound in place, so a client LR scheduler built on it keeps working. A callable client is
    called with the params, as DeepSpeed does."""
    def remap(params) -> list[dict] | list[torch.Tensor]:
        params = list(params)
        if original_params is None:
            return params
        if len(params) != len(original_params):
            raise ValueError(f"expected {len(original_params)} trainable tensors, got {len(params)}")
        new_of = {id(o): n for o, n in zip(original_params, params)}
        if param_groups is None:
            return params
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [new_of[id(p)] for p in g["params"] if id(p) in new_of]} for g in param_groups]

    if client is not None:
        if isinstance(client, torch.optim.Optimizer):
            def rebind(params):
                params = list(params)
                if original_params is None or client.state:
                    raise ValueError("the client optimizer must be fresh (no state) and built over the model's "
                                     "parameters")
                new_of = {id(o): n for o, n in zip(original_params, params)}
                for g in client.param_groups:
                    g["params"] = [new_of[id(p)] for p in g["params"] if id(p) in new_of]
                return client
            return rebind
        return lambda params: client(remap(params))
    opt = plan.optimizer
    kwargs = {k: v for k, v in opt.params.items() if k not in _DS_ONLY_KEYS}
    name = opt.type
    if name in ("adam", "adamw"):
        adamw = opt.adam_w_mode if name == "adam" else True
        if not opt.torch_adam:   # DeepSpeed's FusedAdam / CPUAdam default to no weight decay; torch's AdamW to 0.01
            kwargs.setdefault("weight_decay", 0.0)
        return AdamSection(remap, kwargs, adamw=adamw, bias_correction=opt.params.get("bias_correction", True),
                           device_type=device_type)
    if name == "muon":   # DeepSpeed's MuonWithAuxAdam: tag_muon_params tagged the originals before sharding
        from fsdpzero.optim.muon import MuonWithAuxAdam, muon_param_groups
        flags = [bool(getattr(p, "use_muon", p.ndim >= 2)) for p in original_params or []]

        def muon(params):
            params = list(params)
            for i, p in enumerate(params):
                p.use_muon = flags[i] if flags else bool(getattr(p, "use_muon", p.ndim >= 2))
            groups = remap(params)
            groups = groups if groups and isinstance(groups[0], dict) else [{"params": groups}]
            return MuonWithAuxAdam(muon_param_groups(groups, opt.params), adam_w_mode=opt.adam_w_mode)
        return muon
    if _is_onebit_adam(name):   # approximated: 1-bit Adam's uncompressed warm-up math on every step (fate table)
        onebit = {k: opt.params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in opt.params}
        return lambda params: AdamNoBiasCorrection(remap(params), adamw=True, **onebit)
    if name == "lamb":
        from fsdpzero.optim.lamb import Lamb
        lamb_kwargs = {k: v for k, v in opt.params.items() if k == "bias_correction" or k not in _DS_ONLY_KEYS}
        return lambda params: Lamb(remap(params), **lamb_kwargs)
    cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}.get(name) or getattr(torch.optim, name)
    fast = name in ("sgd", "adagrad")
    return lambda params: cls(remap(params), **(_fast_impl(kwargs, device_type) if fast else kwargs))


class AdamSection:
    """The `optimizer` section's Adam / AdamW as an OptimizerFactory (`params -> optimizer`: torch's Adam/AdamW, or
    AdamNoBiasCorrection for `bias_correction: false`) that also gives its param groups with every hyper-parameter
    resolved, without building an optimizer (`groups`): the offload paths step their own CPU/NVMe Adam over fp32
    masters from them."""

    def __init__(self, remap: Callable, kwargs: dict, *, adamw: bool, bias_correction: bool, device_type: str):
        self.remap, self.kwargs, self.device_type = remap, kwargs, device_type
        self.adamw, self.bias_correction = adamw, bool(bias_correction)

    def __call__(self, params) -> torch.optim.Optimizer:
        if not self.bias_correction:
            return AdamNoBiasCorrection(self.remap(params), adamw=self.adamw, **self.kwargs)
        cls = torch.optim.AdamW if self.adamw else torch.optim.Adam
        return cls(self.remap(params), **_fast_impl(self.kwargs, self.device_type, fused_ok=True))

    def groups(self, params) -> list[dict]:
        """What __call__'s optimizer would have in its param_groups (its defaults under each group's own keys), plus
        `decoupled_weight_decay` and `bias_correction`; `params` as for __call__. The defaults are the classes':
        lr 1e-3, betas (0.9, 0.999), eps 1e-8; weight decay 0.01 for torch's AdamW (torch_adam), else the section's
        (0 when absent: DeepSpeed's FusedAdam / CPUAdam default, set by make_optimizer_factory)."""
        wd = 1e-2 if self.adamw and self.bias_correction else 0.0   # torch.optim.AdamW's default; Adam's is 0
        defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd, "amsgrad": False,
                    "decoupled_weight_decay": self.adamw, **self.kwargs, "bias_correction": self.bias_correction}
        groups = self.remap(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": list(groups)}]
        return [{**defaults, **{k: v for k, v in g.items() if k != "bias_correction"}, "params": list(g["params"])}
                for g in groups]


def _fast_impl(kwargs: dict, device_type: str, fused_ok: bool = False) -> dict:
    """Fused Adam/AdamW kernels (CUDA and CPU; they run on DTensor shards), else multi-tensor foreach, unless the
    user chose."""
    if "fused" in kwargs or "foreach" in kwargs:
        return kwargs
    if fused_ok and not kwargs.get("amsgrad") and device_type in ("cuda", "cpu"):
        return {**kwargs, "fused": True}
    return {**kwargs, "foreach": True}


class AdamNoBiasCorrection(torch.optim.Optimizer):
    """DeepSpeed's FusedAdam with `bias_correction: false`: Adam/AdamW without the 1/(1-beta^t) factors."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True, **unused):
        if unused.pop("amsgrad", False):
            raise ValueError("optimizer.params.amsgrad = true is not supported with bias_correction = false")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            beta1, beta2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad, st = p.grad, self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                if g["weight_decay"]:
                    if g["adamw"]:
                        p.mul_(1 - g["lr"] * g["weight_decay"])
                    else:
                        grad = grad.add(p, alpha=g["weight_decay"])
                st["exp_avg"].lerp_(grad, 1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(g["eps"]), value=-g["lr"])
        return loss
