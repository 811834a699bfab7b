"""The multi-tensor AdamW launch (`dsfn.ops.adamw.adamw_update_multi`): one kernel over a
group of tensors of any shapes, bitwise the per-tensor Triton kernel on every leaf (both run
the same `_adamw_block`), with the group's scalars made once.

Runs the real kernels in Triton's CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py);
on CUDA with DSFN_TEST_DEVICE=cuda (tests/ops/conftest.py)."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops import adamw as A

pytestmark = pytest.mark.usefixtures("triton_forced")
ON_CUDA = os.environ.get("DSFN_TEST_DEVICE", "cpu").strip().lower() == "cuda"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}



def _group(sizes, grad_dtypes, seed, device):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, gd in zip(sizes, grad_dtypes):
        shape = (n,) if n % 3 else (n // 3, 3) if n else (0,)
        p, m = torch.randn(shape, generator=g), torch.randn(shape, generator=g) * 0.1
        v, grad = torch.rand(shape, generator=g) * 1e-2, torch.randn(shape, generator=g).to(DTYPES[gd])
        out.append([x.to(device) for x in (p, grad, m, v)])
    return [list(c) for c in zip(*out)]


@settings(deadline=None, max_examples=10 if ON_CUDA else 25, derandomize=True)
@given(sizes=st.lists(st.integers(0, 700), min_size=1, max_size=6),
       grad_dtypes=st.lists(st.sampled_from(sorted(DTYPES)), min_size=6, max_size=6),
       block=st.sampled_from([32, 64, 128]), iters=st.integers(1, 3), seed=st.integers(0, 2**16),
       wd=st.sampled_from([0.0, 0.1]), lowp=st.sampled_from([None, "bf16", "f16"]),
       tensor_lr=st.booleans(), step=st.integers(1, 5))
def test_multi_launch_is_bitwise_the_per_tensor_kernel(device, sizes, grad_dtypes, block, iters, seed, wd, lowp,
                                                       tensor_lr, step):
    P, G, M, V = _group(sizes, grad_dtypes, seed, device)
    lowp = DTYPES[lowp] if lowp else None
    lr = torch.tensor(3e-3, dtype=torch.float64, device=device) if tensor_lr else 3e-3
    st_ = torch.tensor(step, device=device) if tensor_lr else step
    kw = dict(lr=lr, step=st_, weight_decay=wd, lowp_dtype=lowp, beta1=0.9, beta2=0.999, eps=1e-8)
    want = [A.adamw_update_triton(p, g, m, v, block=block, **kw) for p, g, m, v in zip(P, G, M, V)]
    got = A.adamw_update_multi(P, G, M, V, block=block, iters=iters, **kw)
    for i, (a, b) in enumerate(zip(want, got)):
        for name, x, y in zip(a._fields, a, b):
            if x is None:
                assert y is None
                continue
            assert y.shape == x.shape and y.dtype == x.dtype, (i, name)
            assert torch.equal(x, y), (i, name, sizes)


def test_results_share_one_flat_buffer_per_kind(device):
    """Fresh results are views of one buffer per kind: 3-4 allocations per group, not per leaf."""
    P, G, M, V = _group([5, 9, 300], ["f32", "bf16", "f32"], 0, device)
    out = A.adamw_update_multi(P, G, M, V, lr=1e-3, step=1, lowp_dtype=torch.bfloat16, block=32)
    for k in range(4):
        bases = {o[k].untyped_storage().data_ptr() for o in out}
        assert len(bases) == 1, k
    assert P[0].untyped_storage().data_ptr() != out[0].param.untyped_storage().data_ptr()   # inputs untouched


def test_in_place_out_equals_the_fresh_result(device):
    P, G, M, V = _group([17, 64, 200], ["bf16", "f32", "f16"], 1, device)
    fresh = A.adamw_update_multi(P, G, M, V, lr=1e-2, step=2, weight_decay=0.1, block=32, iters=2)
    outs = A.adamw_update_multi(P, G, M, V, lr=1e-2, step=2, weight_decay=0.1, block=32, iters=2,
                                out=list(zip(P, M, V)))
    for f, o, p, m, v in zip(fresh, outs, P, M, V):
        assert o.param is p and o.exp_avg is m and o.exp_avg_sq is v
        assert torch.equal(f.param, p) and torch.equal(f.exp_avg, m) and torch.equal(f.exp_avg_sq, v)


def test_one_launch_per_grad_dtype(monkeypatch):
    launches = []
    real = A._adamw_multi_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkeypatch.setattr(A, "_adamw_multi_kernel", Spy())
    P, G, M, V = _group([40, 50, 60, 0, 70], ["f32", "bf16", "f32", "f32", "bf16"], 2, "cpu")
    A.adamw_update_multi(P, G, M, V, lr=1e-3, step=1, block=32, iters=1)
    # f32 grads: 40 + 60 elements -> 2 + 2 chunks of 32; bf16: 50 + 70 -> 2 + 3; the empty leaf: none
    assert sorted(g[0] for g in launches) == [4, 5]


@pytest.mark.parametrize("case", ["lengths", "dtype", "shape", "device_mix", "block", "iters", "out_shape"])
def test_bad_groups_raise_dsfn_errors(case):
    P, G, M, V = _group([8, 9], ["f32", "f32"], 3, "cpu")
    kw: dict = {"lr": 1e-3, "step": 1}
    if case == "lengths":
        G = G[:1]
    elif case == "dtype":
        P[1] = P[1].double()
    elif case == "shape":
        G[1] = G[1][:-1]
    elif case == "device_mix":
        P[1] = P[1].to("meta")
    elif case == "block":
        kw["block"] = 48
    elif case == "iters":
        kw["iters"] = 0
    elif case == "out_shape":
        kw["out"] = [(P[0], M[0], V[0]), (P[0], M[0], V[0])]
    with pytest.raises((ConfigError, LeafTypeError, ShapeError)):
        A.adamw_update_multi(P, G, M, V, **kw)
