"""RMSNorm (dsfn/ops/rmsnorm.py): the Triton forward and backward (run by Triton's CPU
interpreter; compiled on CUDA with DSFN_TEST_DEVICE=cuda, see tests/ops/conftest.py)
against the plain-autograd torch reference.

Tolerances: both compute in float32 but sum the squares in different orders, so float32
results agree to rtol=1e-5 with atol=1e-5 * max(1, |reference|.max()) (grad_x of D=1 rows
is a difference of nearly equal terms). For bfloat16/float16 outputs the float32 values
are rounded once to the output dtype, and a float32 difference can move that rounding by
one ulp of the output dtype: rtol = 2 ulp (2**-7 bf16, 2**-10 fp16), atol the same times
the scale. grad_weight sums over rows in float32 and is rounded once as well.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops import dispatch
from dsfn.ops import rmsnorm as R

RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# DSFN_TEST_DEVICE=cuda (tests/ops/conftest.py): fewer drawn cases, since each new kernel
# specialization compiles (a second or so); the interpreter compiles nothing
ON_CUDA = os.environ.get("DSFN_TEST_DEVICE", "cpu").strip().lower() == "cuda"


def _close(got, want, dtype, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape)
    if want.numel() == 0:
        return
    scale = max(1.0, want.float().abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), rtol=RTOL[dtype], atol=RTOL[dtype] * scale,
                               msg=lambda s: f"{what}: {s}")


def _run(fn, x, w, dy, eps, **kw):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = fn(x, w, eps, **kw)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    return y, gx, gw


@settings(deadline=None, max_examples=25 if ON_CUDA else 60, derandomize=True)
@given(lead=st.lists(st.integers(0, 5), max_size=2), D=st.sampled_from([1, 2, 3, 7, 16, 33, 100, 130]),
       block=st.sampled_from([None, 8, 32]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       w_fp32=st.booleans(), eps=st.sampled_from([1e-6, 1e-5, 0.1]), seed=st.integers(0, 2**16))
def test_triton_equals_reference(device, lead, D, block, dtype, w_fp32, eps, seed):
    """Leading dims (incl. none and zero rows), D not a power of two and D = 1, rows longer
    than the block (block=8/32: the looping kernels), low-precision x with fp32 or same-dtype
    weights."""
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, D)
    x = (torch.randn(shape, generator=g) * 3).to(device, dtype)
    w = (torch.randn(D, generator=g) + 1).to(device, torch.float32 if w_fp32 else dtype)
    dy = torch.randn(shape, generator=g).to(device, dtype)
    y, gx, gw = _run(R.rms_norm_triton, x, w, dy, eps, block=block)
    yr, gxr, gwr = _run(R.rms_norm_torch, x, w, dy, eps)
    assert y.shape == x.shape and y.dtype == x.dtype and gx.dtype == x.dtype and gw.dtype == w.dtype
    _close(y, yr, dtype, "y")
    _close(gx, gxr, dtype, "grad_x")
    _close(gw, gwr, torch.float32 if w_fp32 and dtype == torch.float32 else dtype, "grad_weight")


@pytest.mark.parametrize("shape,block", [((37, 20), None), ((37, 20), 8), ((4, 10, 3), None), ((41, 1), None)])
def test_programs_with_many_rows(device, shape, block):
    """The backward gives each program a run of rows (at most 8 programs on CPU) and sums
    their grad_weight partials: more rows than programs, in both kernel variants."""
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device)
    w = torch.randn(shape[-1], generator=g).to(device)
    got = _run(R.rms_norm_triton, x, w, dy, 1e-6, block=block)
    want = _run(R.rms_norm_torch, x, w, dy, 1e-6)
    for a, b, what in zip(got, want, ("y", "grad_x", "grad_weight")):
        _close(a, b, torch.float32, what)


def test_reference_matches_the_formula():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    w = torch.tensor([1.0, 2.0])
    y = R.rms_norm_torch(x, w, 0.0 + 1e-12)
    rms = (12.5) ** 0.5
    torch.testing.assert_close(y[0], torch.tensor([3 / rms, 8 / rms]))
    assert torch.equal(y[1], torch.zeros(2))


def test_strided_input_and_expanded_grad(device):
    """x and weight non-contiguous (a transpose, a step-2 slice), and the stride-0 grad
    that `y.sum().backward()` sends."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(24, 5, generator=g).to(device)
    w10 = torch.randn(10, generator=g).to(device)
    outs = []
    for fn in (R.rms_norm_triton, R.rms_norm_torch):
        x = base.t().contiguous().t().detach().requires_grad_()        # (24, 5) with strides (1, 24)
        wbase = w10.clone().requires_grad_()
        ww = wbase[::2]
        assert not x.is_contiguous() and not ww.is_contiguous()
        y = fn(x, ww, 1e-6)
        (y * 2).sum().backward()
        outs.append((y, x.grad, wbase.grad))
    for a, b, what in zip(outs[0], outs[1], ("y", "grad_x", "grad_weight")):
        _close(a, b, torch.float32, what)


def test_zero_rows_and_zero_vectors(device):
    w = torch.randn(6).to(device)
    for x in (torch.zeros(0, 6, device=device), torch.zeros(2, 0, 6, device=device), torch.zeros(3, 6, device=device)):
        y, gx, gw = _run(R.rms_norm_triton, x, w, torch.ones_like(x), 1e-6)
        yr, gxr, gwr = _run(R.rms_norm_torch, x, w, torch.ones_like(x), 1e-6)
        assert y.shape == x.shape and torch.isfinite(gx).all() and torch.isfinite(gw).all()
        _close(y, yr, torch.float32, "y")
        _close(gx, gxr, torch.float32, "grad_x")
        _close(gw, gwr, torch.float32, "grad_weight")


@pytest.mark.parametrize("impl", [R.rms_norm_torch, R.rms_norm_triton, R.rms_norm])
@pytest.mark.parametrize("case", ["weight shape", "scalar x", "empty D", "int x", "list weight", "devices",
                                  "negative eps"])
def test_bad_input_raises_dsfn_errors(impl, case):
    x, w = torch.randn(2, 4), torch.randn(4)
    args, exc, msg = {
        "weight shape": ((x, torch.randn(3), 1e-6), ShapeError, r"weight has shape \(3,\), expected \(4,\)"),
        "scalar x": ((torch.tensor(1.0), torch.randn(1), 1e-6), ShapeError, r"at least one dim"),
        "empty D": ((torch.randn(2, 0), torch.randn(0), 1e-6), ShapeError, r"empty last dim"),
        "int x": ((x.long(), w, 1e-6), LeafTypeError, r"x has dtype torch.int64"),
        "list weight": ((x, [1.0] * 4, 1e-6), LeafTypeError, r"weight must be a torch.Tensor, got list"),
        "devices": ((x, torch.empty(4, device="meta"), 1e-6), ConfigError, r"move them to one device"),
        "negative eps": ((x, w, -1.0), ConfigError, r"eps=-1.0\): pass a number >= 0"),
    }[case]
    with pytest.raises(exc, match=msg):
        impl(*args)


def test_block_must_be_a_power_of_two():
    with pytest.raises(ConfigError, match=r"block=12"):
        R.rms_norm_triton(torch.randn(2, 4), torch.randn(4), block=12)


@pytest.mark.parametrize("setting", [None, "auto", "torch"])
def test_cpu_default_and_torch_mode_use_the_reference(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("DSFN_KERNELS", raising=False)
    else:
        monkeypatch.setenv("DSFN_KERNELS", setting)
    x, w = torch.randn(3, 5), torch.randn(5)
    assert not dispatch.use_triton(x, w)

    def boom(*a, **k):
        raise AssertionError("the Triton path must not run here")
    monkeypatch.setattr(R, "rms_norm_triton", boom)
    assert torch.equal(R.rms_norm(x, w), R.rms_norm_torch(x, w))


def test_triton_mode_uses_the_kernels(monkeypatch, request):
    monkeypatch.setenv("DSFN_KERNELS", "triton")
    x, w = torch.randn(3, 5, requires_grad=True), torch.randn(5)
    y = R.rms_norm(x, w)
    assert y.grad_fn is not None and "RMSNormFunction" in type(y.grad_fn).__name__
    request.getfixturevalue("no_interpreter")        # as if dsfn was imported without TRITON_INTERPRET
    with pytest.raises(ConfigError, match=r"DSFN_KERNELS=triton but Triton kernels cannot run"):
        R.rms_norm(x, w)
    monkeypatch.setenv("DSFN_KERNELS", "auto")
    with pytest.raises(ConfigError, match=r"rms_norm_triton: Triton kernels cannot run on cpu"):
        R.rms_norm_triton(x, w)
