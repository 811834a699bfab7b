"""Fused AdamW (dsfn/ops/adamw.py): the Triton kernel (run by Triton's CPU interpreter,
TRITON_INTERPRET=1 from tests/conftest.py; compiled on CUDA with DSFN_TEST_DEVICE=cuda, see
tests/ops/conftest.py) against the torch reference, and the reference against torch.optim.AdamW.

Tolerances: the reference is torch.optim.AdamW bitwise. The kernel does the same float32
operations in the same order, but torch's CPU `sqrt` is not correctly rounded (about one
result in six is 1 ulp off the exact root; the kernel's `sqrt_rn` is exact), so new params
may differ by an ulp of the update: compared with rtol=1e-6, atol=1e-7 (updates here are
<= lr = 1e-2). exp_avg and exp_avg_sq do not depend on the root: compared the same way.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops import adamw as A
from dsfn.ops import dispatch

TOL = {"rtol": 1e-6, "atol": 1e-7}
# DSFN_TEST_DEVICE=cuda (tests/ops/conftest.py): fewer drawn cases, since each new kernel
# specialization compiles (a second or so); the interpreter compiles nothing
ON_CUDA = os.environ.get("DSFN_TEST_DEVICE", "cpu").strip().lower() == "cuda"
F32 = torch.float32


def _state(n_or_shape, seed, grad_dtype=F32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shape = (n_or_shape,) if isinstance(n_or_shape, int) else n_or_shape
    p = torch.randn(shape, generator=g)
    m = torch.randn(shape, generator=g) * 0.1
    v = torch.rand(shape, generator=g) * 1e-2
    grads = [torch.randn(shape, generator=g).to(grad_dtype) for _ in range(6)]
    return p.to(device), m.to(device), v.to(device), [x.to(device) for x in grads]


def _schedule(t: int) -> float:
    return 1e-2 * min(1.0, t / 3) * (0.9 ** t)       # warmup then decay: a new lr every step


@settings(deadline=None, max_examples=25 if ON_CUDA else 50, derandomize=True)
@given(n=st.one_of(st.sampled_from([0, 1, 63, 64, 65, 127, 128, 129, 1024, 1025]), st.integers(0, 3000)),
       block=st.sampled_from([64, 128, 1024]), seed=st.integers(0, 2**16), wd=st.sampled_from([0.0, 0.1]),
       beta1=st.sampled_from([0.9, 0.3]), grad_dtype=st.sampled_from([F32, torch.bfloat16, torch.float16]),
       lowp=st.sampled_from([None, torch.bfloat16, torch.float16]), steps=st.integers(1, 4))
def test_kernel_equals_reference_over_a_schedule(device, n, block, seed, wd, beta1, grad_dtype, lowp, steps):
    """Several steps with one lr tensor changed in place and a step tensor: the kernel
    follows the reference (beta1 = 0.3 takes torch.lerp's weight >= 0.5 branch)."""
    p, m, v, grads = _state(n, seed, grad_dtype, device)
    lr = torch.tensor(0.0, dtype=torch.float64, device=device)
    step = torch.tensor(0, dtype=torch.int64, device=device)
    kw = {"beta1": beta1, "beta2": 0.999, "eps": 1e-8, "weight_decay": wd, "lowp_dtype": lowp}
    ref, tri = (p, m, v), (p, m, v)
    for t in range(1, steps + 1):
        lr.fill_(_schedule(t))
        step.fill_(t)
        r = A.adamw_update_torch(*ref[:1], grads[t], *ref[1:], lr=lr, step=step, **kw)
        k = A.adamw_update_triton(*tri[:1], grads[t], *tri[1:], lr=lr, step=step, block=block, **kw)
        for name in ("param", "exp_avg", "exp_avg_sq"):
            a, b = getattr(k, name), getattr(r, name)
            assert a.dtype == F32 and a.shape == (n,) and a.is_contiguous() and a.device.type == device
            torch.testing.assert_close(a, b, **TOL, msg=lambda s, name=name, t=t: f"{name} step {t}: {s}")
        if lowp is None:
            assert k.param_lowp is None and r.param_lowp is None
        else:
            assert k.param_lowp.dtype == lowp
            assert torch.equal(k.param_lowp, k.param.to(lowp))      # same pass, round to nearest even
            assert torch.equal(r.param_lowp, r.param.to(lowp))
        ref, tri = (r.param, r.exp_avg, r.exp_avg_sq), (k.param, k.exp_avg, k.exp_avg_sq)
    if n:
        assert not torch.equal(tri[0], p)          # it moved


@settings(deadline=None, max_examples=20, derandomize=True)
@given(seed=st.integers(0, 2**16), wd=st.sampled_from([0.0, 0.01, 0.1]),
       betas=st.sampled_from([(0.9, 0.999), (0.8, 0.95), (0.3, 0.5)]), steps=st.integers(1, 5),
       tensor_lr=st.booleans(), shape=st.sampled_from([(5, 3), (17,), (2, 3, 4), (40, 40)]))
def test_reference_equals_torch_adamw(seed, wd, betas, steps, tensor_lr, shape):
    """adamw_update_torch is torch.optim.AdamW bitwise, with an lr that changes every step
    (a float lr in torch's param group; a float64 tensor or a float here)."""
    p, _, _, grads = _state(shape, seed)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=_schedule(1), betas=betas, eps=1e-8, weight_decay=wd)
    mine, m, v = p, torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, steps + 1):
        opt.param_groups[0]["lr"] = _schedule(t)
        ref.grad = grads[t].clone()
        opt.step()
        lr = torch.tensor(_schedule(t), dtype=torch.float64) if tensor_lr else _schedule(t)
        step = torch.tensor(t) if tensor_lr else t
        mine, m, v, _ = A.adamw_update_torch(mine, grads[t], m, v, lr=lr, step=step, beta1=betas[0],
                                             beta2=betas[1], eps=1e-8, weight_decay=wd)
    st_ = opt.state[ref]
    assert torch.equal(mine, ref.detach())
    assert torch.equal(m, st_["exp_avg"])
    assert torch.equal(v, st_["exp_avg_sq"])


def test_reference_equals_dsfn_adamw():
    """... and dsfn's own functional adamw (`apply`, the fast path TrainState uses)."""
    p, _, _, grads = _state((7, 5), 3)
    tx = dsfn.optim.adamw(lr=1e-2, weight_decay=0.1)
    params, state = {"w": p}, tx.init({"w": p})
    mine, m, v = p, torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, 5):
        params, state = tx.apply({"w": grads[t]}, state, params)
        mine, m, v, _ = A.adamw_update_torch(mine, grads[t], m, v, lr=1e-2, step=t, weight_decay=0.1)
    assert torch.equal(mine, params["w"])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_lowp_copy_rounds_like_tensor_to(device, lowp):
    """Edge values for the in-kernel rounding: ties (to even), carries into the exponent,
    overflow, subnormals, +-0, +-inf, NaN (any NaN: torch's own vector and scalar casts
    disagree on its bits). With lr = 0 the new param is the old one."""
    fin = torch.finfo(lowp)
    vals = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-11, 1 + 3 * 2**-11, 2 - 2**-9, 2 - 2**-12,
            fin.max * 1.001, -fin.max * 1.001, fin.max, fin.tiny / 3, -fin.tiny / 5, 1e-40, 0.0, -0.0,
            float("inf"), float("-inf"), float("nan"), 3.14159, -2.71828, 65519.0, 65520.0, 1e30]
    p = torch.tensor(vals, dtype=F32, device=device)
    z = torch.zeros_like(p)
    k = A.adamw_update_triton(p, z, z, z, lr=0.0, step=1, lowp_dtype=lowp, block=64)
    want = k.param.to(lowp)
    nan = torch.isnan(want)
    assert nan.sum() == 1 and torch.isnan(k.param_lowp[nan]).all()    # NaN payloads: not compared
    assert torch.equal(k.param_lowp[~nan].view(torch.int16), want[~nan].view(torch.int16)), (k.param_lowp, want)
    assert torch.equal(k.param[:-6].view(torch.int32), p[:-6].view(torch.int32))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_out_may_alias_the_inputs(device, impl):
    """out=(param, exp_avg, exp_avg_sq, lowp): an in-place update equal to the fresh one."""
    fn = A.adamw_update_torch if impl == "torch" else A.adamw_update_triton
    p, m, v, grads = _state(300, 7, device=device)
    fresh = fn(p, grads[1], m, v, lr=1e-3, step=2, weight_decay=0.1, lowp_dtype=torch.bfloat16)
    p2, m2, v2, low = p.clone(), m.clone(), v.clone(), torch.empty(300, dtype=torch.bfloat16, device=device)
    res = fn(p2, grads[1], m2, v2, lr=1e-3, step=2, weight_decay=0.1, out=(p2, m2, v2, low))
    assert res.param is p2 and res.exp_avg is m2 and res.exp_avg_sq is v2 and res.param_lowp is low
    for a, b in zip(res, fresh):
        assert torch.equal(a, b)


def test_non_contiguous_inputs(device):
    p, m, v, grads = _state((30, 20), 11, device=device)
    pt, gt, mt, vt = p.t(), grads[1].t(), m.t(), v.t()
    r = A.adamw_update_torch(pt, gt, mt, vt, lr=1e-3, step=1)
    k = A.adamw_update_triton(pt, gt, mt, vt, lr=1e-3, step=1, block=128)
    for a, b in zip(k[:3], r[:3]):
        assert a.shape == (20, 30) and a.is_contiguous()
        torch.testing.assert_close(a, b, **TOL)


def _bad_cases():
    p, m, v, grads = _state(8, 0)
    g = grads[0]
    ok = {"lr": 1e-3, "step": 1}
    return {
        "grad shape": ((p, g[:4], m, v), ok, ShapeError, r"grad has shape \(4,\) but param has \(8,\)"),
        "exp_avg_sq shape": ((p, g, m, v.reshape(2, 4)), ok, ShapeError, r"exp_avg_sq has shape"),
        "bf16 master": ((p.bfloat16(), g, m, v), ok, LeafTypeError, r"param has dtype torch.bfloat16"),
        "fp64 moment": ((p, g, m.double(), v), ok, LeafTypeError, r"exp_avg has dtype torch.float64"),
        "int grad": ((p, g.long(), m, v), ok, LeafTypeError, r"grad has dtype torch.int64"),
        "non-tensor": ((p, g.tolist(), m, v), ok, LeafTypeError, r"grad must be a torch.Tensor, got list"),
        "devices": ((p, g, m, torch.empty(8, device="meta")), ok, ConfigError, r"on different devices"),
        "beta1 = 1": ((p, g, m, v), {**ok, "beta1": 1.0}, ConfigError, r"beta1\)=1.0: must be < 1.0"),
        "negative eps": ((p, g, m, v), {**ok, "eps": -1.0}, ConfigError, r"eps\)=-1.0: must be >= 0"),
        "negative lr": ((p, g, m, v), {**ok, "lr": -1e-3}, ConfigError, r"must be >= 0"),
        "negative tensor lr": ((p, g, m, v), {**ok, "lr": torch.tensor(-1.0)}, ConfigError, r"must be >= 0"),
        "matrix lr": ((p, g, m, v), {**ok, "lr": torch.ones(2)}, ConfigError, r"shape \(\) or \(1,\)"),
        "integer tensor lr": ((p, g, m, v), {**ok, "lr": torch.tensor(1)}, ConfigError, r"floating point"),
        "step 0": ((p, g, m, v), {**ok, "step": 0}, ConfigError, r"step=0\): pass an int >= 1"),
        "step tensor 0": ((p, g, m, v), {**ok, "step": torch.tensor(0)}, ConfigError, r"counts updates from 1"),
        "float step": ((p, g, m, v), {**ok, "step": 1.5}, ConfigError, r"pass an int >= 1"),
        "lowp fp32": ((p, g, m, v), {**ok, "lowp_dtype": F32}, ConfigError, r"use torch.bfloat16, torch.float16"),
        "out count": ((p, g, m, v), {**ok, "out": (p, m)}, ConfigError, r"got 2 entries"),
        "out shape": ((p, g, m, v), {**ok, "out": (p, m, torch.empty(9))}, ShapeError,
                      r"out\[2\] \(exp_avg_sq\) has shape \(9,\)"),
        "out layout": ((p, g, m, v), {**ok, "out": (torch.empty(16)[::2], m, v)}, ShapeError,
                       r"must be contiguous"),
        "out lowp dtype": ((p, g, m, v), {**ok, "lowp_dtype": torch.float16,
                                          "out": (p, m, v, torch.empty(8, dtype=torch.bfloat16))},
                           ConfigError, r"lowp_dtype=torch.float16 but out\[3\] has dtype torch.bfloat16"),
    }


@pytest.mark.parametrize("impl", ["torch", "triton", "dispatch"])
@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_input_raises_dsfn_errors(impl, case):
    fn = {"torch": A.adamw_update_torch, "triton": A.adamw_update_triton, "dispatch": A.adamw_update}[impl]
    args, kw, exc, msg = _bad_cases()[case]
    with pytest.raises(exc, match=msg):
        fn(*args, **kw)


def test_triton_block_must_be_a_power_of_two():
    p, m, v, grads = _state(8, 0)
    with pytest.raises(ConfigError, match=r"block=100"):
        A.adamw_update_triton(p, grads[0], m, v, lr=1e-3, step=1, block=100)


def _poison(monkeypatch, name):
    def boom(*a, **k):
        raise AssertionError(f"{name} must not run here")
    monkeypatch.setattr(A, name, boom)


@pytest.mark.parametrize("setting", [None, "auto", "torch"])
def test_cpu_default_and_torch_mode_use_the_reference(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("DSFN_KERNELS", raising=False)
    else:
        monkeypatch.setenv("DSFN_KERNELS", setting)
    p, m, v, grads = _state(50, 1)
    assert not dispatch.use_triton(p, grads[0], m, v)
    want = A.adamw_update_torch(p, grads[0], m, v, lr=1e-3, step=1)
    _poison(monkeypatch, "adamw_update_triton")
    got = A.adamw_update(p, grads[0], m, v, lr=1e-3, step=1)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)


def test_triton_mode_uses_the_kernel_and_refuses_cpu_without_interpreter(monkeypatch, request):
    p, m, v, grads = _state(50, 1)
    monkeypatch.setenv("DSFN_KERNELS", "triton")
    want = A.adamw_update_triton(p, grads[0], m, v, lr=1e-3, step=1)
    _poison(monkeypatch, "adamw_update_torch")
    got = A.adamw_update(p, grads[0], m, v, lr=1e-3, step=1)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    request.getfixturevalue("no_interpreter")        # as if dsfn was imported without TRITON_INTERPRET
    with pytest.raises(ConfigError, match=r"DSFN_KERNELS=triton but Triton kernels cannot run on \['cpu'\]: "
                                          r"CPU tensors need TRITON_INTERPRET=1"):
        A.adamw_update(p, grads[0], m, v, lr=1e-3, step=1)
    monkeypatch.setenv("DSFN_KERNELS", "auto")
    with pytest.raises(ConfigError, match=r"adamw_update_triton: Triton kernels cannot run on cpu"):
        A.adamw_update_triton(p, grads[0], m, v, lr=1e-3, step=1)
