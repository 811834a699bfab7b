"""Slice assembly between every pair of layouts the format knows (Replicated, FlatShard,
DimShard, Offloaded), across world sizes, on synthetic states."""
import pytest
import torch

from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.runtime import init_mesh
from dsfn.state.layout import (
    DimShard,
    FlatShard,
    Offloaded,
    Replicated,
    gather_tree,
    is_placed,
    place,
)
from dsfn.testing import run_on_ranks

SHAPES = {"a": (7, 5), "b": (3,), "c": (2, 9, 3), "s": ()}


def _logical():
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _layouts(kind):
    def one(shape):
        if kind == "rep" or not shape:
            return Replicated(shape)
        if kind == "flat":
            return FlatShard("dp", shape)
        if kind == "dim0":
            return DimShard("dp", 0, shape)
        if kind == "dimlast":
            return DimShard("dp", len(shape) - 1, shape)
        if kind == "offload":
            return Offloaded(FlatShard("dp", shape))
        raise ValueError(kind)
    return {k: one(s) for k, s in SHAPES.items()}


KINDS = ["rep", "flat", "dim0", "dimlast", "offload"]


def _save(root, kind):
    init_mesh()
    ck.save(root, tree.map(lambda x, l: place(x, l), _logical(), _layouts(kind),
                           is_leaf=lambda x: isinstance(x, (torch.Tensor, FlatShard, DimShard, Replicated, Offloaded))),
            step=1)


def _load(root):
    init_mesh()
    out = {}
    for kind in KINDS:
        like = tree.map(lambda x, l: place(torch.zeros_like(x), l), _logical(), _layouts(kind))
        loaded = ck.load(root, like)
        assert tree.structure(loaded, is_leaf=is_placed) == tree.structure(like, is_leaf=is_placed)
        out[kind] = gather_tree(loaded)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_any_layout_loads_any_layout(tmp_path, kind):
    run_on_ranks(_save, 2, str(tmp_path), kind, timeout=60)
    want = _logical()
    for world in (1, 3):
        for rank, got in enumerate(run_on_ranks(_load, world, str(tmp_path), timeout=60)):
            for target, state in got.items():
                for k in SHAPES:
                    assert torch.equal(state[k], want[k]), f"{kind}@2 -> {target}@{world} rank {rank}: {k}"
