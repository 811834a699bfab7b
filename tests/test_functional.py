"""functionalize / value_and_grad: purity, tied and frozen weights, buffers, errors."""
import pytest
import torch
from torch import nn

import dsfn
from dsfn.errors import LeafTypeError


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight          # tied like HF tie_word_embeddings
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        h = torch.tanh(self.proj(self.embed(ids))) + self.frozen(self.embed(ids)) * self.scale
        return self.head(h)


def loss_of(logits, ids):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


def test_tied_weight_is_one_logical_parameter_and_frozen_stay_out():
    torch.manual_seed(0)
    m = Tied()
    apply_fn, params = dsfn.functionalize(m)
    assert "embed.weight" in params and "head.weight" not in params
    assert not any(k.startswith("frozen.") for k in params)
    assert set(apply_fn.constants) == {"frozen.weight", "frozen.bias"}
    assert set(apply_fn.buffers) == {"scale"}          # a persistent buffer is state (tests/test_buffers.py)


def test_value_and_grad_equals_module_backward_including_tied_gradient():
    torch.manual_seed(0)
    m = Tied()
    ids = torch.randint(0, 11, (3, 5))
    apply_fn, params = dsfn.functionalize(m)
    loss, grads = dsfn.value_and_grad(lambda p, x: loss_of(apply_fn(p, x), x))(params, ids)
    ref = loss_of(m(ids), ids)
    ref.backward()
    assert torch.equal(loss, ref.detach())
    for name, g in grads.items():
        assert torch.allclose(g, m.get_parameter(name).grad, rtol=1e-6, atol=1e-7), name
    # the tied gradient has both contributions: it differs from the embedding-only gradient
    assert m.head.weight.grad is m.embed.weight.grad


def test_value_and_grad_is_pure_and_handles_aux_and_unused_leaves():
    params = {"a": torch.randn(3), "unused": torch.randn(2)}
    before = {k: v.clone() for k, v in params.items()}
    (v, aux), g = dsfn.value_and_grad(lambda p: ((p["a"] ** 2).sum(), {"n": p["a"].sum()}), has_aux=True)(params)
    assert torch.allclose(g["a"], 2 * params["a"]) and torch.equal(g["unused"], torch.zeros(2))
    assert not v.requires_grad and not aux["n"].requires_grad
    assert all(torch.equal(before[k], params[k]) for k in params)
    assert all(not x.requires_grad for x in params.values())


def test_apply_fn_uses_given_params_not_module_tensors():
    m = nn.Linear(2, 1)
    apply_fn, params = dsfn.functionalize(m)
    zero = {k: torch.zeros_like(v) for k, v in params.items()}
    assert torch.equal(apply_fn(zero, torch.ones(4, 2)), torch.zeros(4, 1))


@pytest.mark.parametrize("bad, what", [
    ({"a": 1.0}, "leaf 'a' is float"),
    ({"a": torch.arange(3)}, "torch.int64"),
])
def test_value_and_grad_rejects_non_float_leaves(bad, what):
    with pytest.raises(LeafTypeError, match=what):
        dsfn.value_and_grad(lambda p: p["a"].sum())(bad)


def test_value_and_grad_rejects_non_scalar_value():
    with pytest.raises(LeafTypeError, match="scalar"):
        dsfn.value_and_grad(lambda p: p["a"] * 2)({"a": torch.ones(3)})


def test_functionalize_rejects_non_module():
    with pytest.raises(LeafTypeError, match="nn.Module"):
        dsfn.functionalize(lambda x: x)


def test_release_empties_the_module_but_params_keep_their_values():
    torch.manual_seed(0)
    m = Tied()
    ids = torch.randint(0, 11, (2, 3))
    expected = m(ids).detach()
    apply_fn, params = dsfn.functionalize(m, release=True)
    assert m.proj.weight.numel() == 0 and m.frozen.weight.numel() == 36     # frozen ones are constants
    assert torch.equal(apply_fn(params, ids), expected)
