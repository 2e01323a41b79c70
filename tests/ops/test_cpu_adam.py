"""Fused CPU Adam (ops/csrc/cpu_adam.cpp) against torch.optim.AdamW / torch.optim.Adam, on every kernel this
host has.

Tolerance: fp32 masters and states within rtol=1e-6, atol=1e-7 of torch after 100 steps (ulp-level rounding
differences: torch and the kernel place fma differently). The low-precision copy must equal the master rounded by
torch's own `.to(dtype)`, bit for bit; the SIMD and scalar kernels must agree bit for bit.
"""
import copy
import warnings

import pytest
import torch

from fsdpzero_ops import cpu_adam
from tests.multirank import run_distributed

IMPLS = cpu_adam.available_impls()           # e.g. ["avx512", "avx2", "scalar", "reference"]
ALL = ["avx512", "avx2", "scalar", "reference"]
SHAPES = [(1,), (7,), (33, 17), (1031,), (3, 5, 7), (40_001,)]   # odd lengths; 40_001 spans several blocks
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _need(impl):
    if impl not in IMPLS:
        pytest.skip(f"this CPU/build has no {impl} kernel (has {IMPLS})")


def _run(impl, grad_dtype, adamw, steps=100, shapes=SHAPES, out_dtype=None, lr=1e-3, wd=0.05):
    """Step torch's optimizer and ours with identical (low-precision) gradients; return both param lists."""
    gen = torch.Generator().manual_seed(1234)
    init = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.clone().requires_grad_() for p in init]
    ours = [p.clone() for p in init]
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = torch_cls(ref, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, foreach=False)
    our_cls = cpu_adam.CPUAdamW if adamw else cpu_adam.CPUAdam
    opt = our_cls(ours, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, impl=impl)
    outs = [torch.empty(s, dtype=out_dtype) for s in shapes] if out_dtype else [None] * len(shapes)
    for _ in range(steps):
        for r, p, o in zip(ref, ours, outs):
            g = (torch.randn(p.shape, generator=gen) * 0.1).to(grad_dtype)
            r.grad = g.float()
            opt.step_param(p, g, out=o)
        ref_opt.step()
    return ref, ref_opt, ours, opt, outs


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("impl", ALL)
def test_matches_torch_100_steps(impl, grad_dtype, adamw):
    _need(impl)
    out_dtype = torch.bfloat16 if grad_dtype == torch.float32 else grad_dtype
    ref, ref_opt, ours, opt, outs = _run(impl, grad_dtype, adamw, out_dtype=out_dtype)
    for r, p, o in zip(ref, ours, outs):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)
        for key, atol in (("exp_avg", 1e-7), ("exp_avg_sq", 1e-10)):  # |exp_avg| ~ 0.03, exp_avg_sq ~ 0.01
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[r][key], rtol=1e-6, atol=atol)
        assert torch.equal(o, p.to(out_dtype)), "low-precision copy differs from the rounded master"
        assert int(opt.state[p]["step"]) == 100


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_kernels_agree_bitwise(grad_dtype):
    """AVX-512, AVX2 and scalar kernels do the same operations in the same order: identical results."""
    kernels = [k for k in ("avx512", "avx2", "scalar") if k in IMPLS]
    if len(kernels) < 2:
        pytest.skip(f"only {kernels} here")
    (params0, opt0, outs0), *others = [_run(k, grad_dtype, True, steps=5, out_dtype=torch.float16)[2:]
                                       for k in kernels]
    for params, opt, outs in others:
        for a, b, oa, ob in zip(params0, params, outs0, outs):
            assert torch.equal(a, b) and torch.equal(oa, ob)
            assert torch.equal(opt0.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("impl", ALL)
def test_no_bias_correction_and_grad_scale(impl):
    """bias_correction=False and grad_scale (1/loss_scale * clip) against torch's AdamW run on the scaled gradient,
    with the bias correction undone through lr and eps: lr' = lr * (1-b1^t) / sqrt(1-b2^t) and
    eps' = eps / sqrt(1-b2^t) makes torch's update equal lr * m / (sqrt(v) + eps)."""
    _need(impl)
    b1, b2, lr, eps, scale = 0.9, 0.99, 1e-3, 1e-8, 0.25
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(1001, generator=gen)
    ref, ours = p0.clone().requires_grad_(), p0.clone()
    ref_opt = torch.optim.AdamW([ref], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0, foreach=False)
    opt = cpu_adam.CPUAdamW([ours], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0, bias_correction=False,
                            impl=impl)
    for t in range(1, 21):
        g = torch.randn(1001, generator=gen)
        ref.grad = g * scale
        c2 = (1 - b2 ** t) ** 0.5
        ref_opt.param_groups[0].update(lr=lr * (1 - b1 ** t) / c2, eps=eps / c2)
        ref_opt.step()
        opt.step_param(ours, g, grad_scale=scale)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-5, atol=1e-7)


def test_drop_in_optimizer_param_groups_and_state_dict():
    """As a torch.optim.Optimizer: .grad from backward, per-group lr/betas/eps/wd, state dict interchange."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(13, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    twin.load_state_dict(model.state_dict())

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.1},
                {"params": m[2].parameters(), "lr": 1e-3, "eps": 1e-6, "weight_decay": 0.0}]

    opt, ref = cpu_adam.CPUAdamW(groups(model)), torch.optim.AdamW(groups(twin), foreach=False)
    x, y = torch.randn(32, 13), torch.randn(32, 3)
    for step in range(12):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        if step == 5:  # round-trip both ways through the other's state dict (copies: loading shares tensors)
            opt.load_state_dict(copy.deepcopy(ref.state_dict()))
            ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_low_precision_params_keep_an_fp32_master():
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(515, generator=gen)
    p = master.to(torch.bfloat16)
    ref = p.float().requires_grad_()    # the optimizer's master starts from the bf16 param
    opt, ref_opt = cpu_adam.CPUAdamW([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    for _ in range(10):
        g = torch.randn(515, generator=gen).to(torch.bfloat16)
        p.grad, ref.grad = g, g.float()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(opt.state[p]["master"], ref.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(p, opt.state[p]["master"].to(torch.bfloat16))


# The 2-thread runs happen in a forked process (a 1-rank job): an OpenMP pool left in the pytest process would make
# tests/multirank.py spawn every later job's ranks instead of forking them (tests/project/test_multirank.py).
def _params_by_threads(rank, world):
    res = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        res.append(_run("auto", torch.bfloat16, True, steps=3, shapes=[(100_003,)])[2][0])
    return res


def test_parallel_split_matches_single_thread():
    if "avx512" not in IMPLS and "avx2" not in IMPLS:
        pytest.skip("no SIMD kernel")
    res = run_distributed(_params_by_threads, 1, init_pg=False)[0]
    assert torch.equal(res[0], res[1])


def test_impl_argument_selects_reference():
    """The library's cpu_adam_impl knob (FSDPZERO_CPU_ADAM_IMPL) arrives as the impl argument: the ops read no env
    and keep no process-wide default."""
    assert cpu_adam.CPUAdamW([torch.zeros(3)], impl="reference").impl == "reference"
    assert not hasattr(cpu_adam, "set_default_impl") and not hasattr(cpu_adam, "DEFAULT_IMPL")
    with pytest.raises(ValueError, match="avx9"):
        cpu_adam.CPUAdamW([torch.zeros(3)], impl="avx9")


def test_no_build_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_adam, "load_op", lambda *a, **k: None)
    monkeypatch.setattr(cpu_adam, "_warned_fallback", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p = torch.ones(5)
        opt = cpu_adam.CPUAdamW([p], lr=0.1, build=False)   # the library's no_build knob
        for _ in range(3):
            opt.step_param(p, torch.ones(5))
    assert opt.impl == "reference"
    assert sum("reference path" in str(w.message) for w in seen) == 1
    assert torch.all(p < 1)


def test_build_false_never_uses_the_compiled_op():
    """build=False (an engine's no_build knob) holds for that call even when the op is built and loaded in this
    process (by an engine without the knob): the ops keep no process-wide build switch."""
    from fsdpzero_ops import aio
    assert IMPLS[0] != "reference", "the CPU Adam op could not be built here"
    assert cpu_adam.available_impls(build=False) == ["reference"]
    assert cpu_adam.CPUAdamW([torch.zeros(3)], build=False).impl == "reference"
    assert aio.available_backends(build=False) == ["python"]
    t = torch.randn(5000, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert cpu_adam.grad_sumsq(t, build=False) == float(t.double().square().sum()) != cpu_adam.grad_sumsq(t)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="amsgrad"):
        cpu_adam.CPUAdamW([torch.zeros(2)], amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        cpu_adam.CPUAdam([torch.zeros(2)], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="not one of the optimizer's params"):
        cpu_adam.CPUAdamW([torch.zeros(2)]).step_param(torch.zeros(2), torch.zeros(2))
    if "avx512" in IMPLS or "avx2" in IMPLS:
        p = torch.zeros(4)
        with pytest.raises(RuntimeError, match="elements"):
            cpu_adam.CPUAdamW([p]).step_param(p, torch.zeros(5))


@pytest.mark.oracle
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_matches_deepspeed_cpu_adam(adamw, bias_correction, monkeypatch):
    """DeepSpeedCPUAdam as the oracle, incl. bias_correction=False and L2 mode. Its op JIT-builds once per checkout
    (~135 s on two cores, cached in <repo>/.torch_extensions, shared with the offload oracle tests)."""
    from pathlib import Path
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / ".torch_extensions"))
    ds_adam = pytest.importorskip("deepspeed.ops.adam")
    gen = torch.Generator().manual_seed(11)
    init = [torch.randn(s, generator=gen) for s in ((1031,), (17, 33))]
    theirs, ours = [p.clone() for p in init], [p.clone() for p in init]
    kw = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    ds = ds_adam.DeepSpeedCPUAdam(theirs, bias_correction=bias_correction, adamw_mode=adamw, **kw)
    opt = cpu_adam.CPUAdam(ours, adamw_mode=adamw, bias_correction=bias_correction, **kw)
    for _ in range(30):
        for a, b in zip(theirs, ours):
            a.grad = torch.randn(a.shape, generator=gen) * 0.1
            b.grad = a.grad.clone()
        ds.step()
        opt.step()
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _sumsq_by_threads(rank, world, t):
    got = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        got.append(cpu_adam.grad_sumsq(t))
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_grad_sumsq_fp32_accurate_and_thread_independent(dtype):
    """The offload path's norm of CPU bf16 grads: within 1e-6 of the sum in double (a bf16 result would be ~4e-3
    off), and the same bits for 1 and 2 threads (blocks summed in a fixed order)."""
    t = (torch.randn(1_000_003, generator=torch.Generator().manual_seed(3)) * 0.01).to(dtype)
    exact = float(t.double().square().sum())
    got = run_distributed(_sumsq_by_threads, 1, t, init_pg=False)[0]
    assert got[0] == got[1]
    assert abs(got[0] - exact) <= 1e-6 * exact


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("impl", ALL)
def test_out_of_place_step_equals_in_place_and_leaves_source(impl, grad_dtype):
    """src=(master, exp_avg, exp_avg_sq): the result lands in the destination with the in-place step's bits and the
    source is untouched (the offload path's speculative step commits or drops it later). 40_001 elements: vector
    body, streaming stores over several blocks and a scalar tail."""
    _need(impl)
    gen = torch.Generator().manual_seed(7)
    for shape in SHAPES:
        src = [torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 0.1,
               torch.rand(shape, generator=gen) * 0.01]
        before = [t.clone() for t in src]
        grad = (torch.randn(shape, generator=gen) * 0.1).to(grad_dtype)
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=3, grad_scale=0.7, impl=impl)
        in_place = [t.clone() for t in src]
        out_a = torch.empty(shape, dtype=torch.bfloat16)
        cpu_adam.adam_step_(*in_place[:1], grad, *in_place[1:], out_a, **kw)
        dst = [torch.full(shape, float("nan")) for _ in src]
        out_b = torch.empty(shape, dtype=torch.bfloat16)
        cpu_adam.adam_step_(dst[0], grad, dst[1], dst[2], out_b, src=tuple(src), **kw)
        for a, b, s, s0 in zip(in_place, dst, src, before):
            assert torch.equal(a, b), f"{shape}: out-of-place result differs from in-place"
            assert torch.equal(s, s0), f"{shape}: the source was modified"
        assert torch.equal(out_a, out_b)
    if impl != "reference":
        with pytest.raises(RuntimeError, match="must not share storage"):
            cpu_adam.adam_step_(src[0], grad, dst[1], dst[2], src=tuple(src), **kw)
