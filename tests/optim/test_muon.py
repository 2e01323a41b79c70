"""`optimizer.type: "Muon"` against DeepSpeed 0.19.8's MuonWithAuxAdam: the same ds_config, Llama model, data and
seed through `deepspeed.initialize` and `fsdpzero.initialize` on 2 forked gloo ranks (fp32, CPU): per-step losses, global
grad norms and final weights within 1e-5 at ZeRO 0 to 3, 2 micro-batches per step (Muon runs once per optimizer step),
with gradient_clipping 1.0 (DeepSpeed's default; it clips every step here: at ZeRO 1-3 DeepSpeed takes the norm over
the orthogonalized Muon updates, whose norm is ~sqrt(rank) per matrix, at ZeRO 0 over the raw gradients) and 0. In the same
fsdpzero ranks: Newton-Schulz runs once per matrix and step, on one rank; and a run saved after 2 steps and resumed
equals the uninterrupted one (the sharded momentum is in the checkpoint). DeepSpeed's `muon_update` is
torch.compile'd; its ranks run it eagerly (TORCH_COMPILE_DISABLE), which saves an inductor build and computes the same
fp32 math.
"""
import copy
import os

import pytest
import torch

from tests.engine.test_oracle_deepspeed import _deepspeed, _full, oracle_engine
from tests.multirank import run_distributed

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

STEPS, GA, MICRO, SEQ, VOCAB, WORLD, TOL = 4, 2, 2, 16, 128, 2, 1e-5


def _config(stage, clip, offload=False):
    # lr / weight_decay shared, muon_lr and adam_lr per half; betas/eps for AdamW, momentum for Muon
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
           "train_batch_size": MICRO * GA * WORLD, "steps_per_print": 10 ** 9, "gradient_clipping": clip,
           "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 5e-3, "adam_lr": 2e-3, "momentum": 0.9,
                                                    "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if stage == 3:
        # DeepSpeed: "Muon and reduce scatter cannot be used together"
        cfg["zero_optimization"]["reduce_scatter"] = False
    if offload:   # DeepSpeed 0.19.8 runs Muon with CPU offload at ZeRO 1-3 (_apply_muon_updates_cpu_offload)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def _data(rank):
    """This rank's micro-batches, GA per step; the same global batch every step: the loss falls, so the comparison
    is between moving models."""
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(WORLD * GA)]
    return [data[micro * WORLD + rank] for micro in range(GA)] * STEPS


def _steps(engine, batches, norms=None):
    """Per optimizer step, the loss averaged over its micro-batches and the ranks (and into `norms`, the engine's
    global grad norm)."""
    losses = []
    for i in range(0, len(batches), GA):
        total = torch.zeros((), device=batches[0].device)
        for x in batches[i:i + GA]:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / (WORLD * GA))
        if norms is not None:
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
    return losses


def _params(engine, library, stage):
    if library == "deepspeed" and stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {n: _full(p) for n, p in engine.module.named_parameters()}
    return {n: _full(p) for n, p in engine.module.named_parameters()}


def _train(rank, world, library, config, ckpt):
    stage = config["zero_optimization"]["stage"]
    if library == "deepspeed":
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
        engine = oracle_engine("deepspeed", config)
        norms = []
        return dict(losses=_steps(engine, _data(rank), norms), norms=norms, params=_params(engine, library, stage))
    from fsdpzero.optim import muon
    engine = oracle_engine("fsdpzero", config)
    # the parameters the optimizer gave Muon (stage 1: the matrices inside its flat shards)
    muon_names = sorted(n for n, p in engine.module.named_parameters() if getattr(p, "use_muon", False))
    before = muon.ns_calls
    norms = []
    losses = _steps(engine, _data(rank), norms)
    path = getattr(engine.grad_path, "inner", engine.grad_path)   # stage 0 is not wrapped in MuonGradPath
    out = dict(losses=losses, norms=norms, params=_params(engine, library, stage), muon_names=muon_names,
               ns_calls=muon.ns_calls - before, path=type(path).__name__,
               optimizer=type(engine.grad_path.optimizer).__name__,
               momentum_devices=sorted({str(s["momentum_buffer"].device) for s in
                                        engine.grad_path.optimizer.state.values() if "momentum_buffer" in s}))
    # resume: 2 steps, save, a fresh engine loads and takes the last 2 == the uninterrupted 4
    first = oracle_engine("fsdpzero", config)
    _steps(first, _data(rank)[:2 * GA])
    first.save_checkpoint(ckpt, tag="half")
    resumed = oracle_engine("fsdpzero", config)
    resumed.load_checkpoint(ckpt, tag="half")
    out["resumed_losses"] = _steps(resumed, _data(rank)[2 * GA:])
    out["resumed_params"] = _params(resumed, library, stage)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage,clip", [(0, 0.0), (0, 1.0), (1, 1.0), (2, 1.0), (2, 0.0), (3, 1.0)])
def test_muon_matches_deepspeed(stage, clip, tmp_path):
    _compare(stage, clip, False, tmp_path)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_with_cpu_offload_matches_deepspeed(stage, tmp_path):
    """offload_optimizer cpu on both sides: DeepSpeed 0.19.8 runs it (stage_1_and_2._apply_muon_updates_cpu_offload,
    stage3._muon_update_sub_group); fsdpzero steps the masters with the offload path's CPU Muon at stages 2/3
    (fsdpzero/offload/muon.py) and its flat CPU shards at stage 1, the momentum in CPU memory."""
    _compare(stage, 1.0, True, tmp_path)


def _compare(stage, clip, offload, tmp_path):
    _deepspeed()
    config = _config(stage, clip, offload)
    ds = run_distributed(_train, WORLD, "deepspeed", copy.deepcopy(config), None, timeout=400)
    ours = run_distributed(_train, WORLD, "fsdpzero", copy.deepcopy(config), str(tmp_path / "ckpt"), timeout=400)
    o, d = ours[0], ds[0]
    # DeepSpeed's split: every 2-D weight of the decoder layers, not the embeddings or the head (or 1-D norms)
    assert o["muon_names"] == sorted(n for n in d["params"] if d["params"][n].ndim == 2
                                     and "embed" not in n and "lm_head" not in n)
    assert len(o["muon_names"]) == 14
    for step, (a, b) in enumerate(zip(d["losses"], o["losses"])):
        assert abs(a - b) <= TOL, f"step {step} loss: deepspeed {a} vs fsdpzero {b}"
    assert d["losses"][-1] < d["losses"][0] - 0.05   # it trains
    if stage > 0:   # DeepSpeed reports no norm at ZeRO 0 in fp32; at 1-3 it is the norm it clipped by
        for step, (a, b) in enumerate(zip(d["norms"], o["norms"])):
            assert abs(a - b) <= TOL * a, f"step {step} grad norm: deepspeed {a} vs fsdpzero {b}"
        if clip:   # the norm over Muon's updates is far above 1: every step was clipped
            assert min(d["norms"]) > 2 * clip
    for r in range(WORLD):
        worst = max((ds[r]["params"][n] - ours[r]["params"][n]).abs().max().item() for n in d["params"])
        assert worst <= TOL, f"rank {r}: final params differ from DeepSpeed's by {worst} (stage {stage})"
    if offload:   # the path users take with offload_optimizer cpu, the momentum in CPU memory
        assert o["path"] == ("Stage1GradPath" if stage == 1 else "OffloadGradPath"), o["path"]
        assert o["optimizer"] == ("MuonWithAuxAdam" if stage == 1 else "CPUMuonWithAuxAdam"), o["optimizer"]
        assert o["momentum_devices"] == ["cpu"]
    # Newton-Schulz once per matrix and step, on one rank (round-robin: 7 matrices each)
    assert [r["ns_calls"] for r in ours] == [STEPS * 14 // WORLD] * WORLD
    # resumed == uninterrupted (exactly the same arithmetic)
    assert o["resumed_losses"] == o["losses"][2:]
    for r in range(WORLD):
        worst = max((ours[r]["resumed_params"][n] - ours[r]["params"][n]).abs().max().item() for n in d["params"])
        assert worst == 0.0, f"rank {r}: resumed run differs by {worst}"



@pytest.mark.parametrize("ns_method", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32), (3, 24, 40), (3, 40, 24), (8, 8, 3), (2, 3, 8, 12, 5)])
def test_muon_update_is_deepspeeds(ns_method, shape):
    """One parameter's update (nesterov blend, Newton-Schulz, aspect scale) as DeepSpeed's muon_update computes it, for
    wide, tall and square matrices, both NS methods (gram: fp32 on this CPU; standard: bf16), and for parameters of
    more dims, which DeepSpeed takes as a batch of matrices over the leading dims: stacked MoE experts (E, out, in),
    a Conv1d filter (out, in, k), a 5-D one. (4-D: test_4d_muon_params_are_refused.)"""
    _deepspeed()
    from deepspeed.runtime.zero.muon import original_muon
    from fsdpzero.optim.muon import orthogonalize
    g = torch.Generator().manual_seed(0)
    grad, momentum = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    ref_m = momentum.clone()
    with torch._dynamo.config.patch(disable=True):   # DeepSpeed's kernels eagerly: no inductor build
        ref = original_muon.muon_update(grad.clone(), ref_m, beta=0.9, ns_method=ns_method)
    m = momentum.clone()
    m.lerp_(grad, 0.1)
    ours = orthogonalize(grad.lerp(m, 0.9), ns_method)
    assert torch.equal(m, ref_m)
    assert ours.dtype == ref.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= (1e-6 if ns_method == "gram" else 0.0)


def test_4d_muon_params_are_refused():
    """A 4-D Muon parameter (a Conv2d filter) is what DeepSpeed 0.19.8's muon_update cannot step (it views the update as
    2-D and its torch.where against the 4-D gradient does not broadcast): MuonWithAuxAdam refuses it, and
    fsdpzero.initialize does before any process group, in one line naming the parameter, its shape and the fix."""
    _deepspeed()
    import torch.distributed as dist
    import fsdpzero
    from deepspeed.runtime.zero.muon import original_muon
    from fsdpzero.optim.muon import MuonWithAuxAdam
    filt = torch.randn(8, 4, 3, 3)
    with torch._dynamo.config.patch(disable=True), pytest.raises(RuntimeError, match="must match the size"):
        original_muon.muon_update(filt.clone(), torch.zeros_like(filt))   # DeepSpeed cannot either
    with pytest.raises(ValueError, match=r"\(8, 4, 3, 3\): a 4-D \(conv2d\) filter.*optimizer.type AdamW"):
        MuonWithAuxAdam([dict(params=[torch.nn.Parameter(filt)], use_muon=True)])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Conv2d(8, 8, 3))
    initialized = dist.is_initialized()
    with pytest.raises(ValueError, match=r"Muon parameter '1.weight' has shape \(8, 8, 3, 3\)"):
        fsdpzero.initialize(model=model, config=BASE)
    assert dist.is_initialized() == initialized   # refused before any process group
    MuonWithAuxAdam([dict(params=[torch.nn.Parameter(torch.randn(3, 8, 4)), torch.nn.Parameter(torch.randn(8, 4, 3))],
                          use_muon=True)])   # 3-D (experts, Conv1d) and 5-D are DeepSpeed's batches of matrices


BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Muon", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}


@pytest.mark.parametrize("change,key", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
     "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"fp16": {"enabled": True}}, "fp16.enabled"),
    ({"optimizer": {"type": "Muon", "params": {"ns_method": "svd"}}}, "optimizer.params.ns_method"),
    ({"optimizer": {"type": "Muon", "params": {"per_head_muon": True}}}, "optimizer.params.per_head_muon"),
])
def test_muon_refusals_name_the_key(change, key):
    """What fsdpzero's Muon does not carry is refused before any process group, naming the key and the fix."""
    from fsdpzero.optim import check_optimizer
    from fsdpzero.plan import Env
    from fsdpzero.plan.translate import build_plan
    config = {**BASE, **change}
    with pytest.raises(ValueError, match=f"config key '{key}'"):
        check_optimizer(build_plan(config, Env(world_size=2)))
    check_optimizer(build_plan(BASE, Env(world_size=2)))   # the base config passes


def test_skipped_step_leaves_the_momentum():
    """ZeRO 1-3 order (orthogonalize_grads before the norm): the new momentum is staged and lands only with step(),
    as DeepSpeed's _commit_muon_momentum; a boundary whose step is skipped (the engine then zero_grads:
    MuonGradPath.zero_grad drops the staged momentum) leaves it as it was, and the next boundary moves it once."""
    from fsdpzero.optim.muon import MuonWithAuxAdam
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 12, generator=g))
    opt = MuonWithAuxAdam([dict(params=[w], use_muon=True, lr=0.1, momentum=0.9)])
    grad = torch.randn(8, 12, generator=g)
    w.grad = grad.clone()
    opt.orthogonalize_grads()
    opt.orthogonalize_grads()   # a second call at the same boundary (the HF Trainer's norm read) does nothing
    assert not torch.equal(w.grad, grad) and torch.equal(opt.state[w]["momentum_buffer"], torch.zeros(8, 12))
    opt.drop_staged()           # skipped
    w.grad = grad.clone()
    opt.orthogonalize_grads()
    opt.step()
    assert torch.allclose(opt.state[w]["momentum_buffer"], 0.1 * grad, rtol=0, atol=1e-7)


# -- parameters of more than 2 dims: a transformers 5 MoE's fused experts ---------------------------------------------

MOE_CONFIGS = [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]   # (stage, offload)
MOE_MATRICES = 2 * (4 + 1 + 3 + 3)   # per step: q k v o, the router, 3 experts of gate_up and of down, 2 layers


def _moe_model():
    """Qwen3-MoE with transformers 5's fused experts: each layer's gate_up_proj (3, 32, 32) and down_proj (3, 32, 16)
    are 3-D parameters (3 experts; FSDP2's Shard(0) splits them 2 + 1 on 2 ranks)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=3, num_experts_per_tok=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _train_moe(rank, world, library, ckpt=None):
    """Every MOE_CONFIGS run of one library in the same ranks (clip 1.0, STEPS steps of GA micro-batches); fsdpzero
    also at stage 3 saved after 2 steps and resumed (the 3-D momentum, sharded on the expert dim, in the checkpoint)."""
    if library == "deepspeed":
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
        import deepspeed as lib
    else:
        import fsdpzero as lib
    from fsdpzero.optim import muon
    out = {}
    for stage, offload in MOE_CONFIGS:
        model = _moe_model()
        config = _config(stage, 1.0, offload)
        engine = lib.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        before, norms = muon.ns_calls, []
        losses = _steps(engine, _data(rank), norms)
        out[stage, offload] = dict(
            losses=losses, norms=norms, params=_params(engine, library, stage), ns_calls=muon.ns_calls - before,
            muon=sorted(n for n, p in engine.module.named_parameters() if getattr(p, "use_muon", False)),
            optimizer=type(engine.optimizer if library == "deepspeed" else engine.grad_path.optimizer).__name__)
    if ckpt is not None:
        config = _config(3, 1.0)
        engines = []
        for _ in range(2):
            model = _moe_model()
            engines.append(lib.initialize(model=model, model_parameters=model.parameters(), config=config)[0])
        _steps(engines[0], _data(rank)[:2 * GA])
        engines[0].save_checkpoint(ckpt, tag="half")
        engines[1].load_checkpoint(ckpt, tag="half")
        out["resumed"] = dict(losses=_steps(engines[1], _data(rank)[2 * GA:]), params=_params(engines[1], library, 3))
    return out


@pytest.mark.timeout(900)
def test_muon_3d_expert_params_match_deepspeed(tmp_path):
    """DeepSpeed 0.19.8 gives a 3-D parameter Muon (its split: >= 2 dims) and runs it at every stage, with and without
    CPU offload: muon_update takes the whole tensor as a batch of matrices over the leading dim (each expert's matrix
    orthogonalized alone, the aspect scale from the last two dims). fsdpzero, same config and Qwen3-MoE model, 2 gloo
    ranks, fp32: losses, grad norms and weights within 1e-5 at stages 0-3 and with offload_optimizer cpu at 1-3 (the
    owner gathers the whole (E, out, in) tensor from FSDP2's Shard(0) of the expert dim, or from stage 1's flat
    shards, and runs Newton-Schulz once, on one rank). A stage-3 run resumed after 2 steps equals the uninterrupted
    one bitwise."""
    _deepspeed()
    ds = run_distributed(_train_moe, WORLD, "deepspeed", timeout=600)
    ours = run_distributed(_train_moe, WORLD, "fsdpzero", str(tmp_path / "ckpt"), timeout=600)
    for r in ours:
        assert r["resumed"]["losses"] == r[3, False]["losses"][2:]
        assert all(torch.equal(r["resumed"]["params"][n], r[3, False]["params"][n]) for n in r["resumed"]["params"])
    for key in MOE_CONFIGS:
        d, o = ds[0][key], ours[0][key]
        experts = [n for n in d["params"] if d["params"][n].ndim == 3]
        assert len(experts) == 4 and set(experts) <= set(o["muon"]) and o["muon"] == d["muon"], (key, o["muon"])
        assert o["optimizer"] == ("CPUMuonWithAuxAdam" if key[1] and key[0] > 1 else "MuonWithAuxAdam"), key
        for step, (a, b) in enumerate(zip(d["losses"], o["losses"])):
            assert abs(a - b) <= TOL, f"{key} step {step} loss: deepspeed {a} vs fsdpzero {b}"
        assert d["losses"][-1] < d["losses"][0] - 0.05, key   # it trains
        if key[0] > 0:
            for step, (a, b) in enumerate(zip(d["norms"], o["norms"])):
                assert abs(a - b) <= TOL * a, f"{key} step {step} grad norm: deepspeed {a} vs fsdpzero {b}"
        for r in range(WORLD):
            worst = max((ds[r][key]["params"][n] - ours[r][key]["params"][n]).abs().max().item()
                        for n in d["params"])
            assert worst <= TOL, f"{key} rank {r}: final params differ from DeepSpeed's by {worst}"
        # each expert's matrix orthogonalized once per step, on one rank
        assert sum(r[key]["ns_calls"] for r in ours) == STEPS * MOE_MATRICES, (key, [r[key]["ns_calls"] for r in ours])


def _offload_vs_device(rank, world, stage):
    """fsdpzero's Muon at `stage` with and without offload_optimizer cpu, in the same ranks (GPU rank r on cuda:r)."""
    import fsdpzero
    from fsdpzero.optim import muon
    from tests.engine.test_oracle_deepspeed import _model
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    out = {}
    for offload in (False, True):
        model = _model("llama")
        engine = fsdpzero.initialize(model=model, model_parameters=model.parameters(),
                                     config=_config(stage, 1.0, offload))[0]
        before = muon.ns_calls
        losses = _steps(engine, [x.to(device) for x in _data(rank)])
        out[offload] = dict(losses=losses, params=_params(engine, "fsdpzero", stage), ns_calls=muon.ns_calls - before,
                            optimizer=type(engine.grad_path.optimizer).__name__)
        engine.destroy()
    return out


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_cpu_offload_on_gpus_matches_muon_on_the_device(stage):
    """2 GPUs, NCCL: the offload path's CPU Muon (pinned staged gradients, early D2H, the overlapped CPU step, the
    CPU momentum taken to the GPU for the gathers and Newton-Schulz; stage 1: its flat CPU shards, gathered on the
    GPU) against fsdpzero's Muon on the device (itself
    DeepSpeed's within 1e-5 on CPU), fp32, 4 steps, clip 1.0: losses and weights within 1e-4 (Newton-Schulz runs in
    fp16 on CUDA; a clip or momentum error moves the loss by 1e-3 to 1e-2). Run with
    `pytest -m gpu tests/optim/test_muon.py -k on_gpus`."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    got = run_distributed(_offload_vs_device, WORLD, stage, timeout=500, backend="cuda:nccl,cpu:gloo")
    for r in got:
        device, offload = r[False], r[True]
        assert offload["optimizer"] == ("MuonWithAuxAdam" if stage == 1 else "CPUMuonWithAuxAdam")
        assert device["optimizer"] == "MuonWithAuxAdam"
        assert offload["ns_calls"] == device["ns_calls"] == STEPS * 14 // WORLD
        for step, (a, b) in enumerate(zip(device["losses"], offload["losses"])):
            assert abs(a - b) <= 1e-4, f"step {step} loss: on the device {a} vs offloaded {b}"
        worst = max((device["params"][n] - offload["params"][n]).abs().max().item() for n in device["params"])
        assert worst <= 1e-4, f"offloaded Muon's weights differ by {worst}"
    assert got[0][True]["losses"][-1] < got[0][True]["losses"][0] - 0.05


# -- batched Newton-Schulz (fsdpzero.optim.muon.Orthogonalizer) ------------------------------------------------------

# Muon matrices in DeepSpeed's order (size, descending), owner i mod 2: rank 0 owns A A B D (3 shapes), rank 1 A B C D
# (4 shapes). C's 15 rows shard unevenly (8 + 7: a padded piece); A is tall, B wide.
BATCH_SHAPES = [(24, 16)] * 3 + [(16, 24)] * 2 + [(15, 16), (8, 16), (8, 16)]
BATCH_GROUPS = [3, 4]   # Newton-Schulz runs per rank and step, batched: one per (owner, shape)


def _batched_vs_per_matrix(rank, world):
    """MuonWithAuxAdam over 2 gloo ranks, 3 steps, per Orthogonalizer window (0: one matrix at a time; 1536 bytes: one
    24x16 matrix per owner and window, so 4 windows of collectives; the default: one window): FSDP2's layout (DTensor
    Shard(0) rows, orthogonalize_grads then step: ZeRO 2/3) and replicated whole tensors (step alone: ZeRO 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from fsdpzero.optim import muon
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(s, generator=g) for s in BATCH_SHAPES]
    grads = [[torch.randn(s, generator=g) for s in BATCH_SHAPES] for _ in range(3)]
    out = {}
    for layout in ("sharded", "replicated"):
        for window in (0, 1536, muon.NS_WINDOW_BYTES):
            def place(t):
                return distribute_tensor(t.clone(), mesh, [Shard(0)]) if layout == "sharded" else t.clone()
            params = [torch.nn.Parameter(place(w)) for w in weights]
            opt = muon.MuonWithAuxAdam([dict(params=params, use_muon=True, lr=0.05, momentum=0.9, weight_decay=0.01)])
            assert [tuple(p.shape) for p in opt.param_groups[0]["params"]] == BATCH_SHAPES   # DeepSpeed's order kept
            opt.ns_window_bytes = window
            calls, batches = muon.ns_calls, muon.ns_batches
            for step_grads in grads:
                for p, gr in zip(params, step_grads):
                    p.grad = place(gr)
                if layout == "sharded":
                    opt.orthogonalize_grads()
                opt.step()
            out[layout, window] = dict(params=[_full(p) for p in params], calls=muon.ns_calls - calls,
                                       batches=muon.ns_batches - batches)
    # the per-matrix reference: DeepSpeed's muon_update on each whole matrix (orthogonalize is its NS, checked
    # against DeepSpeed's own by test_muon_update_is_deepspeeds)
    ref = [w.clone() for w in weights]
    moms = [torch.zeros_like(w) for w in weights]
    for step_grads in grads:
        for w, m, gr in zip(ref, moms, step_grads):
            m.lerp_(gr, 0.1)
            w.mul_(1 - 0.05 * 0.01).add_(muon.orthogonalize(gr.lerp(m, 0.9)), alpha=-0.05)
    out["reference"] = ref
    return out


@pytest.mark.timeout(300)
def test_batched_orthogonalization_equals_per_matrix():
    """The batched Newton-Schulz (one run per owner and shape on the stacked matrices, gathers and scatters issued
    per window) gives bitwise the weights of one matrix at a time, and of DeepSpeed's per-matrix update on the whole
    matrices, on this CPU in fp32: every op of both iterations is per matrix of the batch (a batched matmul is the
    per-matrix GEMM on each; the batch is stacked in each matrix's own layout, a tall one transposed by a view as
    alone). (On CUDA a batched GEMM may pick another kernel than a single one: not bitwise there, and not checked
    here.) And Newton-Schulz runs once per (owner, shape) per step: 3 and 4 runs for the ranks' 4 matrices each."""
    ranks = run_distributed(_batched_vs_per_matrix, WORLD, timeout=240)
    from fsdpzero.optim.muon import NS_WINDOW_BYTES
    for rank, r in enumerate(ranks):
        for key, got in r.items():
            if key == "reference":
                continue
            for i, (a, b) in enumerate(zip(got["params"], r["reference"])):
                assert torch.equal(a, b), (f"rank {rank} {key}: matrix {i} {BATCH_SHAPES[i]} differs from the "
                                           f"per-matrix update by {(a - b).abs().max().item()}")
            assert got["calls"] == 3 * 4, (key, got["calls"])   # each matrix once per step, on its owner
        for layout in ("sharded", "replicated"):
            assert r[layout, 0]["batches"] == r[layout, 1536]["batches"] == 3 * 4
            assert r[layout, NS_WINDOW_BYTES]["batches"] == 3 * BATCH_GROUPS[rank], (layout, rank)


def test_ns_windows_bound_each_owners_bytes():
    """The windows: consecutive, covering every matrix, each owner's bytes in a window <= the bound (or its only
    matrix there is larger); 0 is one matrix a window; the ends depend on (owner, bytes) only, so every rank cuts the
    same."""
    from fsdpzero.optim.muon import ns_windows
    items = [(0, 1536), (1, 1536), (0, 1536), (1, 1536), (0, 1536), (1, 960), (0, 512), (1, 512), (0, 5000)]
    assert ns_windows(items, 10 ** 9) == [9]
    assert ns_windows(items, 0) == list(range(1, 10))
    assert ns_windows(items, 3072) == [4, 8, 9]
    assert ns_windows([], 3072) == []
    for cap in (0, 1000, 1536, 2048, 3072, 4000):
        start = 0
        for end in ns_windows(items, cap):
            held = {}
            for owner, nbytes in items[start:end]:
                held.setdefault(owner, []).append(nbytes)
            assert all(len(b) == 1 or sum(b) <= cap for b in held.values()), (cap, start, end)
            start = end
        assert start == len(items)


@pytest.mark.timeout(300)
def test_bench_muon_batch_cpu_smoke(tmp_path):
    """bench/muon_batch.py end to end on CPU (the 0.89 B model's 112 Muon matrices, each dim / 64): one Newton-Schulz
    run per matrix against one per shape (4: q/o, k/v, gate/up, down, in one window), the same updates, JSON and the
    table printed."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "muon_batch.json"
    res = subprocess.run([sys.executable, str(root / "bench" / "muon_batch.py"), "--scale", "64", "--reps", "1",
                          "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(out.read_text())
    assert summary["matrices"] == 112 and len(summary["shapes"]) == 4
    assert [(r["mode"], r["ns_runs"]) for r in summary["rows"]] == [("per_matrix", 112), ("batched", 4)]
    assert summary["max_update_diff"] == 0.0 and all(r["median_s"] > 0 for r in summary["rows"])
    assert "NS runs" in res.stdout and "batched" in res.stdout


def _engine_windows(rank, world, stage, offload):
    """fsdpzero's engine on the oracle config, 2 steps, with Newton-Schulz one matrix at a time (window 0) and
    batched (the default): the weights, and the Newton-Schulz runs and matrices of each."""
    from fsdpzero.optim import muon
    out = {}
    for window in (0, muon.NS_WINDOW_BYTES):
        engine = oracle_engine("fsdpzero", _config(stage, 1.0, offload))
        engine.grad_path.optimizer.ns_window_bytes = window
        calls, batches = muon.ns_calls, muon.ns_batches
        _steps(engine, _data(rank)[:2 * GA])
        out[window] = dict(params=_params(engine, "fsdpzero", stage), calls=muon.ns_calls - calls,
                           batches=muon.ns_batches - batches, optimizer=type(engine.grad_path.optimizer).__name__)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage,offload", [(1, False), (2, True)])
def test_batched_equals_per_matrix_through_the_engine(stage, offload):
    """The engine's batched Newton-Schulz on the paths the unit test above does not take: stage 1's flat shards (each
    matrix a chunk of the flat master) and the offload path's CPU Muon (CPUMuonWithAuxAdam). Bitwise the weights of
    one matrix at a time (fp32 CPU, as above); each rank's 7 matrices of 4 shapes (rank 0: both gates, a down, both q,
    both k; rank 1: the others) take 4 runs a step instead of 7."""
    ranks = run_distributed(_engine_windows, WORLD, stage, offload, timeout=500)
    from fsdpzero.optim.muon import NS_WINDOW_BYTES
    for rank, r in enumerate(ranks):
        per, batched = r[0], r[NS_WINDOW_BYTES]
        assert batched["optimizer"] == ("CPUMuonWithAuxAdam" if offload else "MuonWithAuxAdam")
        for n in per["params"]:
            assert torch.equal(per["params"][n], batched["params"][n]), \
                f"rank {rank} {n}: batched differs by {(per['params'][n] - batched['params'][n]).abs().max().item()}"
        assert per["calls"] == batched["calls"] == 2 * 7
        assert (per["batches"], batched["batches"]) == (2 * 7, 2 * 4), (rank, per["batches"], batched["batches"])


def test_muon_offload_takes_no_backward_norm_worker():
    """With offload_param cpu and bf16, the offload path sums the grads' squares during backward (a worker's
    threads); Muon's norm is of the orthogonalized updates, made after backward, so it gets no such worker."""
    import dataclasses

    from fsdpzero.offload import prepare
    from fsdpzero.plan.types import OffloadPlan
    from tests.engine_cases import make_plan
    for opt, wants in (("adamw", True), ("muon", False)):
        plan = dataclasses.replace(make_plan(stage=3, dtype="bfloat16", opt=opt),
                                   offload=OffloadPlan(optimizer_device="cpu", param_device="cpu"))
        assert (prepare.norm_threads(plan, staged=False, threads=8) is not None) is wants, opt
