"""`Layout.runs`: the contiguous runs of the flattened logical tensor a rank's piece holds
(how checkpoints describe and reshard any layout) agree with `shard` element by element,
padding is zero, the owning ranks' runs cover every logical element exactly once, and
`unshard` on real ranks inverts `shard`."""
import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.runtime import current_mesh, init_mesh
from dsfn.state.layout import (
    DimShard,
    FlatShard,
    MeshCoords,
    Nested,
    Offloaded,
    PackedDimShard,
    Placed,
    Replicated,
    gather_tree,
    place,
)
from dsfn.testing import run_on_ranks

KINDS = ("dim", "packed", "flat", "nested_dim", "nested_packed")


def _nested(inner, sizes):
    """ZeRO over `inner`: FlatShard over dp of inner's local piece."""
    return Nested(inner, FlatShard("dp", tuple(inner.local_shape(MeshCoords.of(sizes, {})))))


def _check_runs(layout, shape, sizes):
    """Every rank of a mesh of `sizes`: piece == shard, runs == piece, padding zero, cover once."""
    numel = math.prod(shape)
    full = torch.arange(1, numel + 1, dtype=torch.float64).reshape(shape)   # no zero element
    flat_full = full.reshape(-1)
    cover = torch.zeros(numel, dtype=torch.int64)
    for coords in itertools.product(*(range(s) for s in sizes.values())):
        m = MeshCoords.of(sizes, dict(zip(sizes, coords)))
        piece = layout.shard(full, m)
        assert tuple(piece.shape) == tuple(layout.local_shape(m))
        pf = piece.reshape(-1)
        used = torch.zeros(pf.numel(), dtype=torch.bool)
        runs = layout.runs(m)
        for (s0, n0, o0), (s1, _, o1) in itertools.pairwise(runs):   # ascending and disjoint in both
            assert s0 + n0 <= s1 and o0 + n0 <= o1, (layout, coords, runs)
        owner = all(c == 0 for a, c in zip(sizes, coords) if a not in layout.axes())
        for s, n, loc in runs:
            assert n > 0 and 0 <= loc and loc + n <= pf.numel() and s + n <= numel, (layout, coords, (s, n, loc))
            assert torch.equal(pf[loc:loc + n], flat_full[s:s + n]), (layout, coords, (s, n, loc))
            used[loc:loc + n] = True
            if owner:
                cover[s:s + n] += 1
        assert (pf[~used] == 0).all(), f"{layout} at {coords}: padding is not zero"
    assert (cover == 1).all(), f"{layout}: owners cover elements {cover.tolist()} times"


@st.composite
def _cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    sizes = {"dp": draw(st.integers(1, 4)), "tp": draw(st.integers(1, 4))}
    kind = draw(st.sampled_from(KINDS))
    dim = draw(st.integers(0, len(shape) - 1))
    n = shape[dim]
    k = draw(st.integers(1, min(n, 4)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
    parts = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n]))
    if kind == "flat":
        layout = FlatShard(draw(st.sampled_from(["dp", "tp"])), shape)
    elif kind in ("dim", "nested_dim"):
        layout = DimShard("tp", dim, shape)
    else:
        layout = PackedDimShard("tp", dim, shape, parts)
    if kind.startswith("nested"):
        layout = _nested(layout, sizes)
    return layout, shape, sizes


@settings(deadline=None, max_examples=150, derandomize=True)
@given(case=_cases())
def test_runs_agree_with_shard_and_cover_once(case):
    layout, shape, sizes = case
    _check_runs(layout, shape, sizes)


def test_runs_of_fixed_uneven_layouts():
    """A few hand-picked layouts that need padding, plus Replicated and Offloaded."""
    sizes = {"dp": 2, "tp": 4}
    packed = PackedDimShard("tp", 0, (10, 3), (6, 2, 2))       # part 6 over 4: chunk 2, rank 3 padded
    for layout, shape in [(packed, (10, 3)), (_nested(packed, sizes), (10, 3)),
                          (DimShard("tp", 1, (3, 7)), (3, 7)), (_nested(DimShard("tp", 0, (7, 5)), sizes), (7, 5)),
                          (PackedDimShard("tp", 1, (2, 9), (5, 3, 1)), (2, 9)), (Replicated((4, 3)), (4, 3)),
                          (Offloaded(_nested(packed, sizes)), (10, 3))]:
        _check_runs(layout, shape, sizes)
    m = MeshCoords.of(sizes, {"dp": 1, "tp": 3})
    assert Offloaded(packed).runs(m) == packed.runs(m)
    assert Replicated((4, 3)).runs(m) == [(0, 12, 0)]


# -- unshard on real ranks ----------------------------------------------------------------------
def _unshard_layouts(sizes):
    out = {}
    for shape in [(7, 5), (10, 3), (5,)]:
        for d in range(len(shape)):
            out[f"dim{d}{shape}"] = DimShard("tp", d, shape)
            out[f"nested_dim{d}{shape}"] = _nested(DimShard("tp", d, shape), sizes)
            if shape[d] >= 3:
                parts = (shape[d] - 2, 1, 1)
                out[f"packed{d}{shape}"] = PackedDimShard("tp", d, shape, parts)
                out[f"nested_packed{d}{shape}"] = _nested(PackedDimShard("tp", d, shape, parts), sizes)
        out[f"flat{shape}"] = FlatShard("dp", shape)
    return out


def _unshard_on_ranks():
    init_mesh(dp=2, tp=2)
    mesh = current_mesh()
    bad = []
    for name, layout in _unshard_layouts({"dp": 2, "tp": 2}).items():
        full = torch.randn(layout.shape, generator=torch.Generator().manual_seed(len(name)))
        placed = place(full, layout)
        assert isinstance(placed, Placed)
        pf = placed.data.reshape(-1)
        for s, n, loc in layout.runs(mesh):          # the real mesh gives the same runs as MeshCoords
            if not torch.equal(pf[loc:loc + n], full.reshape(-1)[s:s + n]):
                bad.append(f"{name}: runs")
        if layout.runs(mesh) != layout.runs(MeshCoords.of(dict(mesh.axes), dict(mesh.coords))):
            bad.append(f"{name}: MeshCoords")
        if not torch.equal(gather_tree({"x": placed})["x"], full):
            bad.append(f"{name}: unshard(shard(x)) != x")
    return bad


def test_unshard_inverts_shard_on_dp2_tp2_ranks():
    results = run_on_ranks(_unshard_on_ranks, 4, timeout=120)
    assert results == [[], [], [], []], results


# -- unshard holds the logical tensor and at most one other rank's piece -----------------------------------
def _unshard_allocations():
    from dsfn.testing.alloc import AllocCounter
    init_mesh(tp=3)
    out = {}
    for name, layout in {"flat": FlatShard("tp", (64, 33)), "dim0": DimShard("tp", 0, (64, 33)),
                         "dim1": DimShard("tp", 1, (64, 33)),
                         "packed1": PackedDimShard("tp", 1, (64, 33), (20, 7, 6))}.items():
        full = torch.randn(layout.shape, generator=torch.Generator().manual_seed(7))
        placed = place(full, layout)
        with AllocCounter() as count:
            back = gather_tree({"x": placed})["x"]
        piece = placed.data.numel() * 4
        out[name] = (torch.equal(back, full), count.bytes, full.numel() * 4, piece)
    return out


def test_unshard_allocates_the_tensor_and_at_most_one_piece():
    """At world 3 (uneven: padded pieces), rebuilding a tensor allocates its own bytes (+ the
    padding) and at most one other rank's piece: an all-gather's output besides the result,
    or a movedim copy of it, would exceed the bound."""
    for name, (equal, allocated, full, piece) in run_on_ranks(_unshard_allocations, 3, timeout=60)[0].items():
        assert equal, name
        assert full <= allocated <= full + piece + 3 * 4 * 64, (name, allocated, full, piece)
