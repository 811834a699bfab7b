"""Grouped casts (`dsfn.ops.cast.cast_tensors`): one multi-tensor Triton launch per source
dtype, bitwise `Tensor.to` on every tensor (round to nearest even, ties, subnormals, inf,
NaN), run by Triton's CPU interpreter here (TRITON_INTERPRET=1, tests/conftest.py)."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.errors import LeafTypeError, ShapeError
from dsfn.ops import cast as C

pytestmark = pytest.mark.usefixtures("triton_forced")
ON_CUDA = os.environ.get("DSFN_TEST_DEVICE", "cpu").strip().lower() == "cuda"
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}



def _values(n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 8)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 65520.0, 1 + 2**-8,
                            1 + 3 * 2**-9, 3.0e38])
    x = torch.cat([special, x])[:n]
    return x.to(dtype)


@settings(deadline=None, max_examples=10 if ON_CUDA else 25, derandomize=True)
@given(sizes=st.lists(st.integers(0, 500), min_size=1, max_size=5),
       srcs=st.lists(st.sampled_from(sorted(DT)), min_size=5, max_size=5), dst=st.sampled_from(sorted(DT)),
       seed=st.integers(0, 2**16), use_out=st.booleans(), block=st.sampled_from([32, 128]), iters=st.integers(1, 3))
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_grouped_cast_is_bitwise_tensor_to(device, sizes, srcs, dst, seed, use_out, block, iters):
    xs = [_values(n, seed + i, DT[s]).to(device) for i, (n, s) in enumerate(zip(sizes, srcs))]
    want = [x.to(DT[dst]) for x in xs]
    out = [torch.full_like(w, 7.0) for w in want] if use_out else None
    got = C.cast_tensors(xs, DT[dst], out=out, block=block, iters=iters)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.dtype == w.dtype and g.shape == w.shape
        # bitwise, NaN payloads aside (torch's CPU half->float makes 0x7FFFFFFF, the hardware
        # and the interpreter the canonical 0x7FC00000: both are NaN)
        nan = torch.isnan(w)
        assert torch.equal(nan, torch.isnan(g)), (i, srcs[i], dst)
        bits = torch.int16 if w.element_size() == 2 else torch.int32
        assert torch.equal(w[~nan].view(bits), g[~nan].view(bits)), (i, srcs[i], dst)
        if use_out:
            assert g is out[i]


def test_same_dtype_is_returned_as_is_and_fresh_casts_share_a_buffer():
    a, b, c = torch.randn(5), torch.randn(3, 4).bfloat16(), torch.randn(7).half()
    out = C.cast_tensors([a, b, c], torch.float32)
    assert out[0] is a
    assert out[1].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()
    assert torch.equal(out[1], b.float()) and torch.equal(out[2], c.float())


def test_non_contiguous_sources(device):
    x = torch.randn(6, 8, device=device).t()
    assert torch.equal(C.cast_tensors([x], torch.bfloat16)[0], x.to(torch.bfloat16))


def test_one_launch_per_source_dtype(monkeypatch):
    seen = []
    real = C._cast_multi_kernel

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid)
            return real[grid]
    monkeypatch.setattr(C, "_cast_multi_kernel", Spy())
    xs = [torch.randn(40), torch.randn(50).half(), torch.randn(60), torch.randn(0), torch.randn(9).bfloat16()]
    C.cast_tensors(xs, torch.bfloat16, block=32, iters=1)
    # f32: 40 + 60 elements -> 2 + 2 chunks; f16: 50 -> 2; bf16 already: no launch; empty: none
    assert sorted(g[0] for g in seen) == [2, 4]


@pytest.mark.parametrize("case", ["dtype", "int_source", "out_shape", "out_len"])
def test_bad_input_raises_dsfn_errors(case):
    xs, dtype, out = [torch.randn(4), torch.randn(3)], torch.bfloat16, None
    if case == "dtype":
        dtype = torch.int32
    elif case == "int_source":
        xs[1] = torch.arange(3)
    elif case == "out_shape":
        out = [torch.empty(4, dtype=dtype), torch.empty(4, dtype=dtype)]
    else:
        out = [torch.empty(4, dtype=dtype)]
    with pytest.raises((LeafTypeError, ShapeError)):
        C.cast_tensors(xs, dtype, out=out)
