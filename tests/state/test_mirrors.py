"""`map_with_mirrors`: a parameter and the optimizer-state leaves that mirror it take one layout."""
import torch
from hypothesis import given, settings, strategies as st

import dsfn
from dsfn.state.layout import map_with_mirrors


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 5))
def test_a_parameter_and_its_mirrors_get_the_same_mapping_and_nothing_else_does(rows, cols):
    params = {"a.weight": torch.randn(rows, cols), "b": torch.randn(cols)}
    state = dsfn.TrainState.create(params, dsfn.optim.adamw(1e-3))
    seen = []

    def tag(owner, x):
        seen.append(owner)
        return torch.full_like(x, float(len(owner)))
    new = map_with_mirrors(state, tag)
    mirrored = {p: x for p, x in dsfn.tree.leaves_with_path(new.opt_state)
                if isinstance(x, torch.Tensor) and x.dim() > 0}
    for path, x in mirrored.items():           # Adam's mu.<name> and nu.<name>
        owner = "a.weight" if path.endswith("a.weight") else "b"
        assert torch.equal(x, torch.full_like(x, float(len(owner)))), path
    assert torch.equal(new.params["a.weight"], torch.full((rows, cols), 8.0))
    assert sorted(set(seen)) == ["a.weight", "b"] and len(seen) == 2 + 2 * 2   # params, mu, nu
    # a scalar (Adam's count) mirrors nothing: untouched
    scalars = [x for x in dsfn.tree.leaves(new.opt_state) if isinstance(x, torch.Tensor) and x.dim() == 0]
    old_scalars = [x for x in dsfn.tree.leaves(state.opt_state) if isinstance(x, torch.Tensor) and x.dim() == 0]
    assert all(a is b for a, b in zip(scalars, old_scalars))


def test_a_leaf_named_like_a_parameter_but_shaped_otherwise_mirrors_nothing():
    params = {"w": torch.randn(3, 2)}
    state = dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)).replace(opt_state={"mu": {"w": torch.zeros(5)}})
    new = map_with_mirrors(state, lambda owner, x: x + 1, params=False)
    assert torch.equal(new.opt_state["mu"]["w"], torch.zeros(5)) and new.params["w"] is params["w"]
