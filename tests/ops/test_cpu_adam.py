"""Host AdamW (dsfn/ops/cpu_adam.py: the C++ kernel in dsfn/ops/csrc/cpu_adam.cpp and the
torch foreach fallback) against torch.optim.AdamW and dsfn.ops.adamw.adamw_update_torch.

Tolerances: exp_avg and exp_avg_sq are compared bitwise (they do not involve a root). The
new param is compared bitwise with torch's order of operations using a correctly rounded
sqrt (`_ref_exact_sqrt`): the C++ kernel takes IEEE roots, torch's CPU sqrt does not (about
one root in five is an ulp off), so against torch itself the param is compared with
rtol=1e-6, atol=1e-7 (updates are <= lr = 1e-2). The foreach fallback runs torch's own
ops, so it equals torch.optim.AdamW bitwise.
"""
from __future__ import annotations

import math
import os
import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops import cpu_adam as C
from dsfn.ops.adamw import adamw_update_torch

TOL = {"rtol": 1e-6, "atol": 1e-7}
F32 = torch.float32
HYP = settings(max_examples=25, deadline=None)
BIG = 3 * (1 << 16) + 12345          # several of the kernel's 64 Ki-element chunks, odd tail


def _have_toolchain() -> bool:
    return shutil.which("ninja") is not None and (shutil.which("c++") or shutil.which("g++")) is not None


CPP = "cpp" if _have_toolchain() else "foreach"    # the kernel under test, whatever DSFN_CPU_ADAM says
needs_cpp = pytest.mark.skipif(not _have_toolchain(), reason="no C++ compiler or ninja: the foreach fallback runs")


def _state(n: int, seed: int, grad_dtype=F32, steps: int = 4):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 1e-2
    grads = [torch.randn(n, generator=g).to(grad_dtype) for _ in range(steps)]
    return p, m, v, grads


def _lr(t: int) -> float:
    return 1e-2 * min(1.0, t / 3) * (0.9 ** t)        # warmup then decay: a new lr every step


def _clone(*ts):
    return [t.clone() for t in ts]


def _ref_exact_sqrt(p, g, m, v, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
    """torch.optim.AdamW's ops in its order, in place, with a correctly rounded float32 sqrt."""
    t = float(step)
    vals = [1.0 - lr * weight_decay, -(lr / (1.0 - beta1 ** t)), math.sqrt(1.0 - beta2 ** t)]
    decay, neg_step, bc2_sqrt = torch.tensor(vals, dtype=torch.float64).float().tolist()
    g = g.float()
    p.mul_(decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    d = torch.sqrt(v.double()).float()                # IEEE: sqrt of a float is exact in double, one rounding
    d.div_(bc2_sqrt).add_(eps)
    q = m * neg_step
    q.div_(d)
    p.add_(q)


def _torch_adamw(p, m, v, grads, *, betas, eps, wd, foreach, first_step=1):
    """Run torch.optim.AdamW from state (m, v) at step first_step-1 over grads; returns (p, m, v)."""
    p = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=1.0, betas=betas, eps=eps, weight_decay=wd, foreach=foreach)
    opt.state[p] = {"step": torch.tensor(float(first_step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    for i, g in enumerate(grads):
        t = first_step + i
        opt.param_groups[0]["lr"] = _lr(t)
        p.grad = g.float()
        opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


# ---------------------------------------------------------------------------------------
# backend


@needs_cpp
def test_cpp_backend_builds_here():
    if os.environ.get(C.ENV, "auto") == "foreach":
        pytest.skip(f"{C.ENV}=foreach set")
    assert C.cpu_adam_backend() == "cpp", C._build_error
    assert C.cpu_adam_backend("cpp") == "cpp"
    assert C.cpu_adam_backend("foreach") == "foreach"


def test_env_var_forces_foreach(monkeypatch):
    monkeypatch.setenv(C.ENV, "foreach")
    assert C.cpu_adam_backend() == "foreach"
    monkeypatch.setenv(C.ENV, "bogus")
    with pytest.raises(ConfigError, match="DSFN_CPU_ADAM"):
        C.cpu_adam_backend()
    with pytest.raises(ConfigError, match="backend="):
        C.cpu_adam_backend("fast")


def test_build_failure_falls_back_with_one_warning(monkeypatch):
    def broken():
        raise OSError("no compiler here")
    monkeypatch.setattr(C, "_build", broken)
    monkeypatch.setattr(C, "_built", False)
    monkeypatch.setattr(C, "_lib", None)
    monkeypatch.setattr(C, "_warned", False)
    monkeypatch.delenv(C.ENV, raising=False)
    p, m, v, grads = _state(33, 0)
    ref = _clone(p, m, v)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert C.cpu_adam_backend() == "foreach"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # only once
        C.cpu_adamw_(p, grads[0], m, v, lr=1e-3, step=1)
    C._run_foreach([ref[0]], [grads[0]], [ref[1]], [ref[2]], [None],
                   C._scalars("t", 1e-3, 1, 0.9, 0.999, 1e-8, 0.0), None)
    assert torch.equal(p, ref[0])
    with pytest.raises(ConfigError, match="could not be built.*no compiler here"):
        C.cpu_adam_backend("cpp")


# ---------------------------------------------------------------------------------------
# numerics


@HYP
@given(n=st.one_of(st.sampled_from([0, 1, 2, 3, 15, 16, 17, 1023, 1025]), st.integers(0, 5000)),
       seed=st.integers(0, 2**16), b1=st.sampled_from([0.9, 0.5, 0.3, 0.0]), b2=st.sampled_from([0.999, 0.95]),
       wd=st.sampled_from([0.0, 0.01, 0.1]), eps=st.sampled_from([1e-8, 1e-6]), first=st.integers(1, 50),
       foreach=st.booleans())
def test_equals_torch_adamw(n, seed, b1, b2, wd, eps, first, foreach):
    p, m, v, grads = _state(n, seed)
    tp, tm, tv = _torch_adamw(p, m, v, grads, betas=(b1, b2), eps=eps, wd=wd, foreach=foreach, first_step=first)
    e = _clone(p, m, v)
    for i, g in enumerate(grads):
        C.cpu_adamw_(p, g, m, v, lr=_lr(first + i), step=first + i, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                     backend=CPP)
        _ref_exact_sqrt(*e[:1], g, *e[1:], lr=_lr(first + i), step=first + i, beta1=b1, beta2=b2, eps=eps,
                        weight_decay=wd)
    if CPP == "cpp":
        assert torch.equal(p, e[0]) and torch.equal(m, e[1]) and torch.equal(v, e[2])   # bitwise, IEEE sqrt
    # m, v: bitwise torch after the first step; p: within an ulp of the update per step.
    # (Later m/v stay bitwise too: they do not depend on p.)
    assert torch.equal(m, tm) and torch.equal(v, tv)
    torch.testing.assert_close(p, tp, **TOL)


@HYP
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**16), gdt=st.sampled_from([F32, torch.bfloat16, torch.float16]),
       ldt=st.sampled_from([None, torch.bfloat16, torch.float16]), step=st.integers(1, 1000))
def test_equals_adamw_update_torch(n, seed, gdt, ldt, step):
    p, m, v, grads = _state(n, seed, gdt, steps=1)
    ref = adamw_update_torch(p, grads[0], m, v, lr=3e-3, step=step, weight_decay=0.05, lowp_dtype=ldt)
    lowp = torch.empty(n, dtype=ldt) if ldt is not None else None
    C.cpu_adamw_(p, grads[0], m, v, lr=3e-3, step=step, weight_decay=0.05, lowp_out=lowp)
    assert torch.equal(m, ref.exp_avg) and torch.equal(v, ref.exp_avg_sq)
    torch.testing.assert_close(p, ref.param, **TOL)
    if ldt is not None:
        assert torch.equal(lowp, p.to(ldt))                    # the new param, cast


@pytest.mark.parametrize("ldt", [torch.bfloat16, torch.float16])
def test_lowp_out_rounding_edge_cases(ldt):
    """Round to nearest even, overflow to inf, subnormals, signed zeros: exactly Tensor.to."""
    info = torch.finfo(ldt)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 7e4, -7e4, 1e-5, 6e-8, 3e-8, 2.9e-8, 1e-40,
                            float(info.max), float(info.tiny), 3.0e38, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11,
                            1 + 3 * 2**-11, float("inf"), float("-inf")])
    g = torch.Generator().manual_seed(7)
    scale = torch.logspace(-40, 38, 4000, dtype=torch.float64).float()
    p = torch.cat([special, torch.randn(4000, generator=g) * scale])
    n = p.numel()
    grad, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    lowp = torch.empty(n, dtype=ldt)
    C.cpu_adamw_(p, grad, m, v, lr=0.0, step=1, lowp_out=lowp)    # lr 0: p unchanged, only the cast
    assert torch.equal(lowp.view(torch.int16), p.to(ldt).view(torch.int16))


@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float16])
def test_lowp_grad_equals_fp32_grad(gdt):
    p, m, v, grads = _state(BIG, 3, gdt, steps=2)
    a = _clone(p, m, v)
    for t, g in enumerate(grads, 1):
        C.cpu_adamw_(p, g, m, v, lr=_lr(t), step=t)
        C.cpu_adamw_(a[0], g.float(), a[1], a[2], lr=_lr(t), step=t)
    assert torch.equal(p, a[0]) and torch.equal(m, a[1]) and torch.equal(v, a[2])


@HYP
@given(sizes=st.lists(st.one_of(st.integers(0, 40), st.integers(0, 70000)), min_size=0, max_size=6),
       seed=st.integers(0, 2**16), lowp=st.booleans())
def test_multi_equals_per_tensor(sizes, seed, lowp):
    states = [_state(n, seed + i, (F32, torch.bfloat16)[i % 2], steps=2) for i, n in enumerate(sizes)]
    single = [_clone(p, m, v) for p, m, v, _ in states]
    lows = [torch.empty(n, dtype=torch.bfloat16) if lowp and i % 3 else None for i, n in enumerate(sizes)]
    lows1 = [x.clone() if x is not None else None for x in lows]
    for t in (1, 2):
        C.cpu_adamw_multi_([s[0] for s in states], [s[3][t - 1] for s in states], [s[1] for s in states],
                           [s[2] for s in states], lr=_lr(t), step=t, weight_decay=0.1, lowp_outs=lows)
        for (p, m, v), s, lo in zip(single, states, lows1):
            C.cpu_adamw_(p, s[3][t - 1], m, v, lr=_lr(t), step=t, weight_decay=0.1, lowp_out=lo)
    for (p, m, v), s, lo, lo1 in zip(single, states, lows, lows1):
        assert torch.equal(p, s[0]) and torch.equal(m, s[1]) and torch.equal(v, s[2])
        if lo is not None:
            assert torch.equal(lo, lo1) and torch.equal(lo, p.bfloat16())


def test_cores_do_not_change_results():
    ncpu = os.cpu_count() or 1
    assert C.cpu_adam_threads(None) == torch.get_num_threads()
    assert C.cpu_adam_threads(1.0) == ncpu
    assert C.cpu_adam_threads(1e-9) == 1
    results = []
    for cores in (1e-9, 0.5, 1.0, None):
        p, m, v, grads = _state(BIG, 11, steps=2)
        low = torch.empty(BIG, dtype=torch.float16)
        for t, g in enumerate(grads, 1):
            C.cpu_adamw_(p, g, m, v, lr=_lr(t), step=t, weight_decay=0.01, cores=cores, lowp_out=low)
        results.append((p, m, v, low))
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))


def test_foreach_fallback_equals_cpp_and_torch():
    p, m, v, grads = _state(BIG, 5, steps=3)
    f = _clone(p, m, v)
    lo, lof = torch.empty(BIG, dtype=torch.bfloat16), torch.empty(BIG, dtype=torch.bfloat16)
    tp, tm, tv = _torch_adamw(p, m, v, grads, betas=(0.9, 0.999), eps=1e-8, wd=0.1, foreach=True)
    for t, g in enumerate(grads, 1):
        C.cpu_adamw_(p, g, m, v, lr=_lr(t), step=t, weight_decay=0.1, lowp_out=lo)
        C.cpu_adamw_(f[0], g, f[1], f[2], lr=_lr(t), step=t, weight_decay=0.1, lowp_out=lof, backend="foreach",
                     cores=0.5)
    assert torch.equal(f[0], tp) and torch.equal(f[1], tm) and torch.equal(f[2], tv)   # foreach: torch bitwise
    assert torch.equal(f[1], m) and torch.equal(f[2], v)
    torch.testing.assert_close(f[0], p, **TOL)
    assert torch.equal(lof, f[0].bfloat16())
    assert (lof != lo).float().mean() < 0.01


def test_params_requiring_grad_and_multidim():
    p, m, v, grads = _state(6 * 35, 9, steps=1)
    P = p.reshape(6, 35).clone().requires_grad_(True)
    C.cpu_adamw_(P.data, grads[0].reshape(6, 35), m.view(6, 35), v.view(6, 35), lr=1e-3, step=1)
    C.cpu_adamw_(P, grads[0].reshape(6, 35), m.clone().view(6, 35), v.clone().view(6, 35), lr=1e-3, step=2,
                 backend="foreach")
    assert P.requires_grad and P.shape == (6, 35)


# ---------------------------------------------------------------------------------------
# bad input


def _good(n=8):
    return [torch.zeros(n) for _ in range(4)]


@pytest.mark.parametrize("backend", ["cpp", "foreach"])
@pytest.mark.parametrize("case, err, match", [
    ("param_f64", LeafTypeError, "param has dtype torch.float64"),
    ("grad_int", LeafTypeError, "grad has dtype torch.int32"),
    ("m_bf16", LeafTypeError, "exp_avg has dtype torch.bfloat16"),
    ("lowp_f32", LeafTypeError, "lowp_out has dtype torch.float32"),
    ("not_tensor", LeafTypeError, "grad must be a torch.Tensor"),
    ("shape", ShapeError, r"exp_avg_sq has shape \(9,\) but param has \(8,\)"),
    ("noncontig", ShapeError, "param is not contiguous"),
    ("lowp_shape", ShapeError, "lowp_out has shape"),
    ("meta", ConfigError, "grad is on meta"),
    ("lr", ConfigError, "lr"),
    ("step0", ConfigError, "step=0"),
    ("step_float", ConfigError, "step=1.5"),
    ("beta1", ConfigError, "beta1"),
    ("eps", ConfigError, "eps"),
    ("cores0", ConfigError, "cores"),
    ("cores2", ConfigError, "cores"),
])
def test_bad_input(case, err, match, backend):
    if backend == "cpp" and not _have_toolchain():
        pytest.skip("no C++ toolchain")
    p, g, m, v = _good()
    kw = {"lr": 1e-3, "step": 1, "backend": backend}
    if case == "param_f64":
        p = p.double()
    elif case == "grad_int":
        g = g.int()
    elif case == "m_bf16":
        m = m.bfloat16()
    elif case == "lowp_f32":
        kw["lowp_out"] = torch.zeros(8)
    elif case == "not_tensor":
        g = [0.0] * 8
    elif case == "shape":
        v = torch.zeros(9)
    elif case == "noncontig":
        p = torch.zeros(16)[::2]
    elif case == "lowp_shape":
        kw["lowp_out"] = torch.zeros(4, dtype=torch.bfloat16)
    elif case == "meta":
        g = torch.zeros(8, device="meta")
    elif case == "lr":
        kw["lr"] = -1.0
    elif case == "step0":
        kw["step"] = 0
    elif case == "step_float":
        kw["step"] = 1.5
    elif case == "beta1":
        kw["beta1"] = 1.0
    elif case == "eps":
        kw["eps"] = float("nan")
    elif case == "cores0":
        kw["cores"] = 0.0
    elif case == "cores2":
        kw["cores"] = 2
    before = p.clone() if isinstance(p, torch.Tensor) and p.device.type == "cpu" else None
    with pytest.raises(err, match=match):
        C.cpu_adamw_(p, g, m, v, **kw)
    if before is not None:
        assert torch.equal(p, before)                       # nothing written on error


def test_bad_lists():
    p, g, m, v = _good()
    with pytest.raises(ShapeError, match="different lengths"):
        C.cpu_adamw_multi_([p], [g, g], [m], [v], lr=1e-3, step=1)
    with pytest.raises(LeafTypeError, match="params must be a list"):
        C.cpu_adamw_multi_(p, [g], [m], [v], lr=1e-3, step=1)
    with pytest.raises(LeafTypeError, match=r"cpu_adamw_multi_\[1\]: grad has dtype torch.float64"):
        C.cpu_adamw_multi_([p, p.clone()], [g, g.double()], [m, m.clone()], [v, v.clone()], lr=1e-3, step=1)
    C.cpu_adamw_multi_([], [], [], [], lr=1e-3, step=1)      # empty lists: a no-op
