"""Layouts: place -> gather is the identity for every layout, world size and shape."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsfn import tree
from dsfn.errors import ShapeError
from dsfn.runtime import init_mesh
from dsfn.state import DimShard, FlatShard, Offloaded, Placed, Replicated, gather_tree, place, place_tree
from dsfn.testing import run_on_ranks


def _layouts(shape):
    out = [Replicated(shape), FlatShard("dp", shape), Offloaded(FlatShard("dp", shape), "cpu")]
    out += [DimShard("dp", d, shape) for d in range(len(shape))]
    return out


def _round_trip(shape, seed):
    init_mesh()
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    results = []
    for layout in _layouts(shape):
        placed = place(full, layout)
        local = placed.data if isinstance(placed, Placed) else placed
        assert tuple(local.shape) == tuple(layout.local_shape())
        results.append(bool(torch.equal(gather_tree({"x": placed})["x"], full)))
    return results


@settings(deadline=None, max_examples=6, derandomize=True)
@given(shape=st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple),
       world=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_place_gather_round_trip_is_identity(shape, world, seed):
    results = run_on_ranks(_round_trip, world, shape, seed, timeout=60)
    assert all(all(r) for r in results), results


def _pieces(shape):
    init_mesh()
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    return place(full, FlatShard("dp", shape)).data, place(full, DimShard("dp", 0, shape)).data


def test_uneven_shards_are_zero_padded_and_padding_never_leaks():
    # 5 elements over 4 ranks: chunks of 2, the last rank holds only padding
    flat, dim = zip(*run_on_ranks(_pieces, 4, (5,), timeout=60))
    assert [f.tolist() for f in flat] == [[0, 1], [2, 3], [4, 0], [0, 0]]
    assert [d.tolist() for d in dim] == [[0, 1], [2, 3], [4, 0], [0, 0]]


def test_layout_is_structure_so_trees_with_different_layouts_do_not_match():
    a = {"w": Placed(torch.zeros(2), FlatShard("dp", (4,)))}
    b = {"w": Placed(torch.zeros(2), FlatShard("dp", (2, 2)))}
    assert tree.structure(a) != tree.structure(b)
    assert tree.leaves(a)[0] is a["w"].data
    with pytest.raises(ValueError):
        tree.map(lambda x, y: x + y, a, b)


def test_place_tree_and_wrong_shape_error():
    full = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    placed = place_tree(full, {"a": FlatShard("dp", (3,)), "b": Replicated((2, 2))})
    assert isinstance(placed["a"], Placed) and placed["b"] is full["b"]
    with pytest.raises(ShapeError, match=r"shape \(4,\)"):
        place(torch.ones(3), FlatShard("dp", (4,)))


def test_mirrored_param_is_the_longest_matching_suffix_of_the_same_shape():
    from dsfn.state.layout import mirrored_param
    shapes = {"w": (3, 4), "layer.w": (2, 2), "b": (4,)}
    assert mirrored_param("opt.mu.layer.w", (2, 2), shapes) == "layer.w"     # longest suffix wins
    assert mirrored_param("opt.mu.w", (3, 4), shapes) == "w"
    assert mirrored_param("opt.mu.w", (4, 3), shapes) is None               # same name, other shape
    assert mirrored_param("opt.count", (), shapes) is None
    assert mirrored_param("opt.mu.b", None, shapes) is None                  # not a tensor
