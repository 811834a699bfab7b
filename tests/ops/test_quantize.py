"""Block-wise wire quantization (`dsfn.ops.quantize`, ZeRO++ qwZ / qgZ): the Triton int8, fp8 e4m3 and int4 kernels
(run by Triton's CPU interpreter here, TRITON_INTERPRET=1) are bitwise their torch
references, and the round trip keeps the format's bound: |x - dequantize(quantize(x))| <=
scale / 2 per element for int8 (scale = the block's absmax / 127), relative 2^-4 for
fp8 e4m3 above its subnormals, scale / 2 for int4 (absmax / 7, two codes a byte: qgZ); exact for all-zero blocks and for values that are codes x
scale; NaN throughout a block holding a NaN or an infinity. Hypothesis over sizes, block
sizes, dtypes and values at the range's edges."""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.errors import ConfigError, LeafTypeError
from dsfn.ops import quantize as Q

pytestmark = [pytest.mark.usefixtures("triton_forced"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]
ON_CUDA = os.environ.get("DSFN_TEST_DEVICE", "cpu").strip().lower() == "cuda"
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _values(n, seed, dtype, kind):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    if kind == "edges":          # the dtype's largest and smallest magnitudes, signed zeros
        info = torch.finfo(dtype)
        edge = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0, 1.0, -1.0])
        x = torch.cat([edge, x])[:n]
    if kind == "zeros":
        x = torch.zeros(n)
    return x.to(dtype)


def _kernel_matches_reference(x, block, fmt):
    """The kernels' codes, scales and dequantized values (fp32 and x's dtype) bitwise the
    references'; returns the reference's codes and scales."""
    n = x.numel()
    codes, scales = Q.quantize_blockwise(x, block, fmt)
    ref_codes, ref_scales = Q.quantize_blockwise_torch(x.cpu(), block, fmt)
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
    for out_dtype in (torch.float32, x.dtype):
        got = Q.dequantize_blockwise(codes, scales, block, fmt, out_dtype, numel=n)
        want = Q.dequantize_blockwise_torch(ref_codes, ref_scales, block, fmt, out_dtype, numel=n)
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    return ref_codes, ref_scales


@settings(deadline=None, max_examples=10 if ON_CUDA else 10, derandomize=True)
@given(n=st.integers(1, 300), block=st.sampled_from([1, 7, 32, 64, 128, 256]), dtype=st.sampled_from(sorted(DT)),
       seed=st.integers(0, 2**16), kind=st.sampled_from(["random", "edges", "zeros"]))
def test_int8_kernel_is_bitwise_the_reference_and_keeps_half_a_scale(device, n, block, dtype, seed, kind):
    x = _values(n, seed, DT[dtype], kind).to(device)
    ref_codes, ref_scales = _kernel_matches_reference(x, block, "int8")
    back = Q.dequantize_blockwise_torch(ref_codes, ref_scales, block, "int8", torch.float32)
    per = ref_scales.repeat_interleave(block)[:n]
    err = (back - x.cpu().float()).abs()
    assert bool((err <= per / 2 * (1 + 2**-20) + 0).all()), float((err - per / 2).max())
    if kind == "zeros":
        assert torch.equal(back, torch.zeros(n)) and torch.equal(ref_scales, torch.zeros_like(ref_scales))


@settings(deadline=None, max_examples=20, derandomize=True)
@given(n=st.integers(1, 500), block=st.sampled_from([16, 128]), seed=st.integers(0, 2**16))
def test_values_that_are_codes_times_the_scale_round_trip_bitwise(n, block, seed):
    """Per block: integer codes in [-127, 127] with 127 present, times a power-of-two scale."""
    g = torch.Generator().manual_seed(seed)
    nb = math.ceil(n / block)
    codes = torch.randint(-127, 128, (nb * block,), generator=g)
    codes.view(nb, block)[:, 0] = 127
    scale = 2.0 ** torch.randint(-20, 20, (nb,), generator=g).float()
    x = (codes.view(nb, block).float() * scale[:, None]).reshape(-1)[:n]
    c, s = Q.quantize_blockwise(x, block, "int8")
    assert torch.equal(Q.dequantize_blockwise(c, s, block, "int8"), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_block_with_a_non_finite_value_dequantizes_to_nan_throughout(device, bad):
    x = torch.randn(300)
    x[130] = bad                          # block 1 of [0, 128), [128, 256), [256, 300)
    for fmt in ("int8", "fp8_e4m3", "int4"):
        c, s = Q.quantize_blockwise(x.to(device), 128, fmt)
        back = Q.dequantize_blockwise(c, s, 128, fmt, numel=300).cpu()
        assert bool(torch.isnan(back[128:256]).all()), fmt
        assert bool(torch.isfinite(back[:128]).all() and torch.isfinite(back[256:]).all()), fmt


@settings(deadline=None, max_examples=10, derandomize=True)
@given(n=st.integers(1, 300), block=st.sampled_from([8, 64, 256]), dtype=st.sampled_from(sorted(DT)),
       seed=st.integers(0, 2**16), kind=st.sampled_from(["random", "edges", "zeros"]))
def test_fp8_e4m3_kernel_is_bitwise_the_reference_and_keeps_its_relative_bound(device, n, block, dtype, seed, kind):
    """e4m3 has 3 mantissa bits: round to nearest is within 2^-4 relative, and within half its
    smallest subnormal step (2^-10 x scale) below the normal range. The kernel's codes,
    scales and dequantized values are the reference's, bitwise (subnormals and edges too)."""
    x = _values(n, seed, DT[dtype], kind)
    _kernel_matches_reference(x.to(device), block, "fp8_e4m3")
    x = x.float()
    c, s = Q.quantize_blockwise_torch(x, block, "fp8_e4m3")
    back = Q.dequantize_blockwise_torch(c, s, block, "fp8_e4m3")
    per = s.repeat_interleave(block)[:n]
    bound = torch.maximum(x.abs() * 2**-4, per * 2**-10) * (1 + 2**-20)
    finite = torch.isfinite(per)          # a block holding an inf (fp16's range) is NaN throughout
    assert bool(((back - x).abs() <= bound)[finite].all())
    assert bool(torch.isnan(back[~finite]).all())


@settings(deadline=None, max_examples=10 if ON_CUDA else 8, derandomize=True)
@given(n=st.integers(1, 300), block=st.sampled_from([2, 8, 64, 256]), dtype=st.sampled_from(sorted(DT)),
       seed=st.integers(0, 2**16), kind=st.sampled_from(["random", "edges", "zeros"]))
def test_int4_kernel_is_bitwise_the_reference(device, n, block, dtype, seed, kind):
    _kernel_matches_reference(_values(n, seed, DT[dtype], kind).to(device), block, "int4")


@settings(deadline=None, max_examples=12, derandomize=True)
@given(n=st.integers(1, 300), block=st.sampled_from([2, 8, 64, 128]), dtype=st.sampled_from(sorted(DT)),
       seed=st.integers(0, 2**16), kind=st.sampled_from(["random", "edges", "zeros"]))
def test_int4_packs_two_codes_a_byte_and_keeps_half_a_scale(n, block, dtype, seed, kind):
    """qgZ's format: ceil(n / 2) bytes, codes -7..7; within half a block's scale (absmax / 7)."""
    x = _values(n, seed, DT[dtype], kind)
    c, s = Q.quantize_blockwise(x, block, "int4")
    assert c.numel() == (n + 1) // 2 and c.dtype == torch.uint8 and s.numel() == math.ceil(n / block)
    back = Q.dequantize_blockwise(c, s, block, "int4", numel=n)
    per = s.repeat_interleave(block)[:n]
    assert bool(((back - x.float()).abs() <= per / 2 * (1 + 2**-20)).all())
    nib = torch.stack([c & 15, c >> 4], 1).reshape(-1)[:n]
    assert bool(((nib >= 1) & (nib <= 15)).all())          # -7..7 stored as 1..15
    if kind == "zeros":
        assert torch.equal(back, torch.zeros(n))


def test_named_errors():
    with pytest.raises(ConfigError, match="block size 0 must be a positive integer"):
        Q.quantize_blockwise(torch.ones(4), 0)
    with pytest.raises(ConfigError, match="block size 2.5 must be a positive integer"):
        Q.quantize_blockwise(torch.ones(4), 2.5)
    with pytest.raises(ConfigError, match="format 'int3' is not one of"):
        Q.quantize_blockwise(torch.ones(4), 8, "int3")
    with pytest.raises(ConfigError, match="int4 packs two codes per byte; its block size 5 must be even"):
        Q.quantize_blockwise(torch.ones(4), 5, "int4")
    with pytest.raises(LeafTypeError, match="integer and fp8 tensors have no quantized wire format"):
        Q.quantize_blockwise(torch.ones(4, dtype=torch.int64), 8)


def test_fp8_kernel_rounds_exact_ties_to_even(device):
    """Values exactly halfway between two e4m3 values (scale 1: the block's absmax is 448)
    round to the even code, normal and subnormal alike, in the kernel as in torch's cast."""
    ties = [1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 13 * 2.0 ** -10, 208.0, 432.0]
    want = [1.0, 1.25, -1.0, 0.0, 2.0 ** -8, 6 * 2.0 ** -9, 208.0, 448.0]
    x = torch.tensor([448.0] + ties)
    c, s = Q.quantize_blockwise(x.to(device), 16, "fp8_e4m3")
    assert float(s[0]) == 1.0
    back = Q.dequantize_blockwise(c, s, 16, "fp8_e4m3").cpu()
    assert back[1:].tolist() == want, back.tolist()
    _kernel_matches_reference(x.to(device), 16, "fp8_e4m3")
