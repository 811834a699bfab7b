"""Quantized all-gathers (`dsfn.runtime.quantized`, ZeRO++ qwZ) at 2, 3 and 4 gloo ranks:
every rank reconstructs the same values; each gathered element is within half its block's
scale of the exact gather (int8: scale = the block's absmax / 127, measured per element
against `gather_into_buffers` without a wire format; bf16 adds its own rounding of the
result, half an ulp); the wire carries one byte per element
and one fp32 scale per block (the runtime's counters); tensors below `min_numel` travel
exactly. Negative control: dequantizing with this rank's own scales instead of the
gathered ones breaks the bound."""
from __future__ import annotations

import math

import pytest
import torch

from dsfn.ops.quantize import quantize_blockwise_torch
from dsfn.runtime import counters, init_mesh
from dsfn.runtime import quantized as Qr
from dsfn.runtime.flat import gather_into_buffers
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import FlatShard, place
from dsfn.testing import run_on_ranks

SHAPES = [(40, 33), (7,), (64, 16), (300,)]     # 1,320 / 7 / 1,024 / 300 elements


def _full(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over decades within a tensor: blocks have different scales
    return [(torch.randn(s, generator=g) * torch.exp(torch.randn(s, generator=g))).to(dtype) for s in SHAPES]


def _gather(block, min_numel, dtype, bug=None):
    init_mesh()
    n, me = current_mesh().size("dp"), current_mesh().local_rank("dp")
    full = _full(dtype=dtype)
    shards = [place(x, FlatShard("dp", tuple(x.shape))).data for x in full]
    exact = [t.clone() for t in gather_into_buffers(shards, SHAPES, "dp", 10**9).wait()]
    wire = Qr.WireFormat("int8", block, min_numel)
    if bug == "local_scales":            # every rank dequantizes with its own scales
        orig = Qr.C.all_gather_into_

        def gather(outs, ins, axis, **kw):
            if ins[0].dtype == torch.float32 and outs[0].numel() == n * ins[0].numel() and len(ins) == 1 \
                    and ins[0].numel() < 64:
                outs[0].copy_(ins[0].repeat(n))
                return Qr.C._done(outs, True)
            return orig(outs, ins, axis, **kw)
        Qr.C.all_gather_into_ = gather
    counters.reset()
    got = [t.clone() for t in gather_into_buffers(shards, SHAPES, "dp", 10**9, wire=wire).wait()]
    sent = counters.bytes("dp", "all_gather")
    # this rank's packed quantized elements: the tensors of >= min_numel elements, their shards
    # (each on whole blocks of its own)
    packed = sum(-(-s.numel() // block) * block for s, shape in zip(shards, SHAPES) if math.prod(shape) >= min_numel)
    exact_bytes = sum(s.numel() * s.element_size() for s, shape in zip(shards, SHAPES)
                      if math.prod(shape) < min_numel)
    # each rank's packed flat vector and its block scales, for the bound
    flats = [torch.cat([exact[i].reshape(-1)[r * shards[i].numel():(r + 1) * shards[i].numel()]
                        for i, shape in enumerate(SHAPES) if math.prod(shape) >= min_numel]) for r in range(n)]
    def piece(i, r):
        return exact[i].reshape(-1)[r * shards[i].numel():(r + 1) * shards[i].numel()]

    def per_tensor_scales(r):        # each tensor's piece on blocks of its own (padding: zeros)
        return torch.cat([quantize_blockwise_torch(torch.nn.functional.pad(piece(i, r), (0, shards[i].numel()
                                                                                       - piece(i, r).numel())),
                                                   block)[1].repeat_interleave(block)[:piece(i, r).numel()]
                          for i, shape in enumerate(SHAPES) if math.prod(shape) >= min_numel])
    bounds = [per_tensor_scales(r) / 2 for r in range(n)]
    errs = [torch.cat([(got[i].reshape(-1)[r * shards[i].numel():(r + 1) * shards[i].numel()]
                        - exact[i].reshape(-1)[r * shards[i].numel():(r + 1) * shards[i].numel()]).float().abs()
                       for i, shape in enumerate(SHAPES) if math.prod(shape) >= min_numel]) for r in range(n)]
    # a bf16 result is the fp32 dequantized value rounded to bf16: half its ulp more (2^-8 relative)
    rounding = 2**-8 if dtype == torch.bfloat16 else 0.0
    vals = [f.float().abs() for f in flats]
    within = all(bool((e <= b * (1 + 2**-20) + v * rounding * 1.01).all()) for e, b, v in zip(errs, bounds, vals))
    lossy = any(bool((e > 0).any()) for e in errs)
    small_exact = all(torch.equal(g, x) for g, x, shape in zip(got, exact, SHAPES) if math.prod(shape) < min_numel)
    return dict(got=got, within=within, lossy=lossy, small_exact=small_exact, sent=sent, n=n,
                want_sent=n * (packed + 4 * (packed // block)) + n * exact_bytes)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_element_is_within_half_its_blocks_scale_and_every_rank_agrees(world, dtype):
    out = run_on_ranks(_gather, world, 128, 200, dtype, timeout=120)
    for r in out:
        assert r["within"] and r["lossy"] and r["small_exact"]
        assert r["sent"] == r["want_sent"]
        for a, b in zip(r["got"], out[0]["got"]):
            assert torch.equal(a, b)


def test_negative_control_local_scales_break_the_bound():
    out = run_on_ranks(_gather, 2, 128, 200, torch.float32, "local_scales", timeout=120)
    assert not all(r["within"] for r in out)


def test_quantized_bytes_are_a_quarter_of_fp32_plus_the_scales():
    w = Qr.WireFormat("int8", 2048, 2048)
    assert w.bytes_per(1_000_000) == 1_000_000 + 4 * 489
    assert w.quantizes(torch.float32, 2048) and not w.quantizes(torch.float32, 2047)
    assert not w.quantizes(torch.int64, 10**6)
