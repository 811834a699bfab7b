"""TrainState: a frozen pytree under dsfn's namespace; create validates; updates are new states."""
import dataclasses

import pytest
import torch

import dsfn
from dsfn import tree
from dsfn.errors import ConfigError, LeafTypeError


def _state():
    return dsfn.TrainState.create({"w": torch.ones(2, 3), "b": torch.zeros(3)}, dsfn.optim.sgd(lr=0.5, momentum=0.9),
                                  seed=7)


def test_state_is_a_pytree_whose_leaves_are_its_tensors():
    s = _state()
    paths = [p for p, _ in tree.leaves_with_path(s)]
    assert "params.w" in paths and "params.b" in paths and "step" in paths and "rng" in paths
    assert all(isinstance(x, torch.Tensor) for x in tree.leaves(s))
    doubled = tree.map(lambda x: x * 2, s)
    assert isinstance(doubled, dsfn.TrainState) and doubled.tx is s.tx


def test_state_is_frozen_and_replace_returns_a_new_state():
    s = _state()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.step = torch.tensor(3)
    s2 = s.replace(step=s.step + 1)
    assert int(s.step) == 0 and int(s2.step) == 1 and s2.params is s.params


def test_apply_gradients_equals_optimizer_and_leaves_input_untouched():
    s = _state()
    grads = {"w": torch.full((2, 3), 2.0), "b": torch.ones(3)}
    s2 = s.apply_gradients(grads)
    assert torch.equal(s2.params["w"], torch.full((2, 3), 0.0)) and torch.equal(s2.params["b"], torch.full((3,), -0.5))
    assert torch.equal(s.params["w"], torch.ones(2, 3)) and int(s2.step) == 1
    with pytest.raises(LeafTypeError, match="structure of params"):
        s.apply_gradients({"w": grads["w"]})


def test_create_rejects_non_tensor_leaves_and_missing_optimizer():
    with pytest.raises(LeafTypeError, match="params leaf 'lr' is a float"):
        dsfn.TrainState.create({"w": torch.ones(1), "lr": 0.1}, dsfn.optim.sgd(lr=0.1))
    with pytest.raises(ConfigError, match="tx="):
        dsfn.TrainState.create({"w": torch.ones(1)}, tx=None)


def test_rng_generator_is_reproducible_and_varies_with_step_and_stream():
    s = _state()
    draw = lambda st, k=0: torch.rand(3, generator=st.rng_generator(k))
    assert torch.equal(draw(s), draw(_state()))
    assert not torch.equal(draw(s), draw(s.replace(step=s.step + 1)))
    assert not torch.equal(draw(s, 0), draw(s, 1))
