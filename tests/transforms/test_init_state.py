"""Step.init_state equals place(TrainState.create(...)) bitwise, and never builds the full
optimizer state: its optimizer leaves are born sharded."""
import torch
from hypothesis import given, settings, strategies as st

import dsfn
from dsfn import tree
from dsfn.runtime import init_mesh
from dsfn.state.layout import is_placed
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp
from dsfn.transforms import data_parallel, mixed_precision, shard_zero


def _stack(kind, stage, mp):
    out = [shard_zero(stage)] if kind == "zero" else [data_parallel()]
    return out + ([mixed_precision()] if mp else [])


def _compare(kind, stage, mp, seed):
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([5, 7, 3], seed))
    step = dsfn.compose(*_stack(kind, stage, mp))(lambda s, b: (s, {}))
    tx = dsfn.optim.adamw(lr=1e-2)
    a = step.place(dsfn.TrainState.create(params, tx, seed=seed))
    b = step.init_state(params, tx, seed=seed)
    same_structure = tree.structure(a, is_leaf=is_placed) == tree.structure(b, is_leaf=is_placed)
    equal = all(torch.equal(x, y) for x, y in zip(tree.leaves(a), tree.leaves(b)))
    return same_structure, equal


@settings(deadline=None, max_examples=10, derandomize=True)
@given(kind=st.sampled_from(["zero", "dp"]), stage=st.integers(0, 3), mp=st.booleans(), seed=st.integers(0, 99),
       world=st.sampled_from([1, 2]))
def test_init_state_equals_place_of_create(kind, stage, mp, seed, world):
    for same_structure, equal in run_on_ranks(_compare, world, kind, stage, mp, seed, timeout=60):
        assert same_structure and equal


def test_init_state_without_transforms_is_create():
    _, params = dsfn.functionalize(make_mlp([3, 2], 0))
    tx = dsfn.optim.sgd(lr=0.1, momentum=0.9)
    a, b = dsfn.TrainState.create(params, tx), dsfn.compose()(lambda s, x: (s, {})).init_state(params, tx)
    assert all(torch.equal(x, y) for x, y in zip(tree.leaves(a), tree.leaves(b)))
