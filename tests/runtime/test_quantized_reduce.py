"""ZeRO++ qgZ's quantized reduce-scatter (`dsfn.runtime.quantized.reduce_scatter_quantized`):
at 2 and 4 gloo ranks (flat) and 2 nodes x 2 (hierarchical: inside the node first, then
across), each rank's reduced row is within the closed form of the exact reduce-scatter —
half a block's int4 scale for every quantization on an element's path (each rank's row in
the first hop; each node's partial sum in the second), / n for the average — measured per
element; the all-to-all bytes are the int4 codes and fp32 scales; across nodes the
hierarchical exchange sends one row per node (1/local of the flat one's rows). Negative
control: summing the codes' values without their scales breaks the bound."""
from __future__ import annotations

import math

import pytest
import torch

from dsfn.ops.quantize import dequantize_blockwise_torch, quantize_blockwise_torch
from dsfn.runtime import collectives as C
from dsfn.runtime import counters, init_mesh
from dsfn.runtime import quantized as Qr
from dsfn.runtime.mesh import current_mesh
from dsfn.testing import run_on_ranks

W, BLOCK = 300, 64


def _rows(rank, n):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, W, generator=g) * torch.exp(torch.randn(n, W, generator=g))


def _q(x):
    """Round trip of one row as the wire does it (padded to whole blocks): (values, scales per element)."""
    wp = -(-W // BLOCK) * BLOCK
    flat = torch.nn.functional.pad(x.float(), (0, wp - W))
    c, s = quantize_blockwise_torch(flat, BLOCK, "int4")
    return dequantize_blockwise_torch(c, s, BLOCK, "int4", numel=wp)[:W], s.repeat_interleave(BLOCK)[:W]


def _reduce(hier, bug=None):
    m = init_mesh()
    n, me = m.size("dp"), m.local_rank("dp")
    hierarchy = None
    if hier:
        local, cross = m.split("dp", 2, names=("dp_local", "dp_cross"))
        hierarchy = (cross, local)
    wire = Qr.WireFormat("int4", BLOCK, 0)
    if bug == "no_scales":
        Qr._dequantize_rows = lambda codes, scales, w, wire, orig=Qr._dequantize_rows: orig(
            codes, torch.ones_like(scales), w, wire)
    counters.reset()
    got = Qr.reduce_scatter_quantized(_rows(me, n), "dp", wire, "avg", hierarchy)
    sent = {k[0]: v.bytes for k, v in counters.snapshot().items()} if hasattr(counters, "snapshot") else {
        a: counters.bytes(a, "all_to_all") for a in ("dp", "dp_local", "dp_cross")}
    exact = C.reduce_scatter(_rows(me, n).reshape(-1), "dp", "avg")
    # the closed form, from every rank's rows (known here: seeded by rank)
    firsts = [_q(_rows(i, n)[me]) for i in range(n)]
    bound = sum(s / 2 for _, s in firsts)
    if hier:
        for k in range(n // 2):
            partial = sum(firsts[i][0] for i in range(2 * k, 2 * k + 2))
            bound = bound + _q(partial)[1] / 2
    bound = bound / n
    err = (got - exact).abs()
    return dict(within=bool((err <= bound * (1 + 1e-5) + 1e-7).all()), lossy=bool((err > 0).any()), sent=sent,
                n=n)


@pytest.mark.parametrize("world,hier", [(2, False), (4, False), (4, True)])
def test_reduced_rows_are_within_the_closed_form(world, hier):
    for r in run_on_ranks(_reduce, world, hier, ranks_per_node=2 if hier else None, timeout=120):
        assert r["within"] and r["lossy"]
        wp = -(-W // BLOCK) * BLOCK
        row_bytes = wp // 2 + 4 * (wp // BLOCK)
        if hier:
            # inside the node: my 2 peers' x 2 rows each (mine included); across: one row per node
            assert r["sent"].get("dp_local", 0) == 4 * row_bytes and r["sent"].get("dp_cross", 0) == 2 * row_bytes
        else:
            assert r["sent"].get("dp", 0) == world * row_bytes


def test_negative_control_codes_without_scales_break_the_bound():
    assert not all(r["within"] for r in run_on_ranks(_reduce, 2, False, "no_scales", timeout=120))
