"""Protocol pieces: chain, identity, apply_updates, clip, masked/partition, current_lr, leaf errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn.optim as O
from dsfn import tree
from dsfn.errors import LeafTypeError
from dsfn.testing.strategies import seeds, shapes

SETTINGS = settings(deadline=None, max_examples=25, derandomize=True)


def model_params(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A tiny transformer-like tree with dotted names: matrices, biases, norm scales."""
    return {
        "embed.weight": torch.randn(6, 4, generator=gen),
        "blocks.0.attn.qkv.weight": torch.randn(12, 4, generator=gen),
        "blocks.0.attn.qkv.bias": torch.randn(12, generator=gen),
        "blocks.0.norm.weight": 1.0 + 0.1 * torch.randn(4, generator=gen),
        "blocks.0.mlp.fc.weight": torch.randn(8, 4, generator=gen),
        "blocks.0.mlp.fc.bias": torch.randn(8, generator=gen),
        "head.scale": torch.randn((), generator=gen),
    }


def grads_like(params: dict, gen: torch.Generator) -> dict:
    return {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}


# ---------------------------------------------------------------------------------------
# chain / identity / apply_updates


def test_chain_applies_in_order_and_keeps_one_state_per_transform():
    p = {"w": torch.tensor([1.0, -2.0])}
    g = {"w": torch.tensor([3.0, 4.0])}
    scale_then_decay = O.chain(O.scale(2.0), O.add_decayed_weights(1.0))
    decay_then_scale = O.chain(O.add_decayed_weights(1.0), O.scale(2.0))
    u1, s1 = scale_then_decay.update(g, scale_then_decay.init(p), p)
    u2, _ = decay_then_scale.update(g, decay_then_scale.init(p), p)
    assert torch.equal(u1["w"], torch.tensor([7.0, 6.0]))        # 2g + p
    assert torch.equal(u2["w"], torch.tensor([8.0, 4.0]))        # 2(g + p)
    assert isinstance(s1, tuple) and len(s1) == 2


def test_chain_threads_states_through_several_updates():
    tx = O.chain(O.trace(0.5), O.scale_by_learning_rate(1.0))
    p = {"w": torch.zeros(1)}
    state = tx.init(p)
    outs = []
    for g in (1.0, 1.0, 1.0):
        u, state = tx.update({"w": torch.tensor([g])}, state, p)
        outs.append(float(u["w"]))
    assert outs == [-1.0, -1.5, -1.75]                             # buf = g, then 0.5 buf + g
    assert int(state[0].count) == 3 and int(state[1].count) == 3


def test_identity_returns_the_updates_unchanged():
    tx = O.identity()
    g = {"w": torch.randn(3)}
    u, s = tx.update(g, tx.init(g))
    assert u["w"] is g["w"] and s == O.EmptyState()


def test_apply_updates_keeps_param_dtype_and_does_not_modify_inputs():
    params = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2)}
    updates = {"a": torch.full((3,), 0.5), "b": torch.full((2,), 0.25, dtype=torch.float64)}
    out = O.apply_updates(params, updates)
    assert out["a"].dtype == torch.bfloat16 and out["b"].dtype == torch.float32
    assert torch.equal(out["a"], torch.full((3,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(params["a"], torch.ones(3, dtype=torch.bfloat16)) and torch.equal(params["b"], torch.ones(2))


def test_apply_updates_works_on_any_pytree_and_empty_trees():
    params = [torch.ones(2), (torch.zeros(()), {"x": torch.ones(1)})]
    out = O.apply_updates(params, tree.map(torch.ones_like, params))
    assert torch.equal(out[1][1]["x"], torch.full((1,), 2.0)) and isinstance(out[1], tuple)
    assert O.apply_updates({}, {}) == {}
    tx = O.adamw(1e-3)
    assert tx.update({}, tx.init({}), {})[0] == {}


@pytest.mark.parametrize("bad", [{"w": 1.0}, {"w": [torch.ones(1), "x"]}])
def test_non_tensor_leaves_raise_leaf_type_error_naming_the_leaf(bad):
    with pytest.raises(LeafTypeError, match="leaf 'w"):
        O.adamw(1e-3).init(bad)
    with pytest.raises(LeafTypeError, match="leaf 'w"):
        O.apply_updates(bad, bad)


def test_mismatched_structures_raise_leaf_type_error():
    p = {"a": torch.ones(2), "b": torch.ones(2)}
    tx = O.adamw(1e-3)
    state = tx.init(p)
    with pytest.raises(LeafTypeError, match="structure"):
        tx.update({"a": torch.ones(2)}, state, {"a": torch.ones(2)})
    with pytest.raises(LeafTypeError, match="structure"):
        O.apply_updates(p, {"a": torch.ones(2)})


# ---------------------------------------------------------------------------------------
# clipping


@SETTINGS
@given(shape_list=st.lists(shapes(max_dims=3, max_side=5), min_size=1, max_size=5), seed=seeds(),
       max_norm=st.floats(min_value=1e-3, max_value=100.0), grad_scale=st.floats(min_value=1e-3, max_value=1e3))
def test_clip_by_global_norm_equals_torch_clip_grad_norm(shape_list, seed, max_norm, grad_scale):
    gen = torch.Generator().manual_seed(seed)
    grads = {f"l{i}.w": grad_scale * torch.randn(s, generator=gen) for i, s in enumerate(shape_list)}
    ref = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads.values()]
    for p, g in zip(ref, grads.values()):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=False)
    tx = O.clip_by_global_norm(max_norm)
    out, state = tx.update(grads, tx.init(grads))
    assert torch.equal(O.global_norm(grads), total)
    for p, (name, g) in zip(ref, out.items()):
        assert torch.equal(g, p.grad), name
    assert float(O.global_norm(out)) <= max_norm * (1 + 1e-5)
    assert state == O.EmptyState()


def test_clip_leaves_small_gradients_unchanged_and_scales_large_ones_to_max_norm():
    tx = O.clip_by_global_norm(5.0)
    small = {"a": torch.tensor([3.0]), "b": torch.tensor([[0.0, 0.0]])}
    big = {"a": torch.tensor([30.0]), "b": torch.tensor([[40.0, 0.0]])}     # norm 50
    assert torch.equal(tx.update(small, tx.init(small))[0]["a"], small["a"])
    out = tx.update(big, tx.init(big))[0]
    torch.testing.assert_close(O.global_norm(out), torch.tensor(5.0), rtol=1e-6, atol=0)
    torch.testing.assert_close(out["a"], torch.tensor([3.0]), rtol=1e-6, atol=0)
    assert float(O.global_norm({})) == 0.0


# ---------------------------------------------------------------------------------------
# masks


def test_masked_zero_freezes_unselected_leaves_and_keeps_no_state_for_them():
    gen = torch.Generator().manual_seed(0)
    params = model_params(gen)
    tx = O.masked(O.adamw(1e-1), O.by_ndim(2))
    state = tx.init(params)
    mu = state.inner[1].mu
    assert mu["blocks.0.attn.qkv.bias"] is None and mu["head.scale"] is None
    assert mu["embed.weight"].shape == (6, 4)
    p = params
    for _ in range(3):
        u, state = tx.update(grads_like(p, gen), state, p)
        p = O.apply_updates(p, u)
    for name, v in params.items():
        changed = not torch.equal(p[name], v)
        assert changed == (v.dim() >= 2), name


def test_masked_pass_leaves_unselected_updates_untouched():
    g = {"w": torch.randn(2, 2), "b": torch.randn(2)}
    tx = O.masked(O.scale(3.0), O.by_name("*.w", "w"), others="pass")
    u, _ = tx.update(g, tx.init(g), g)
    assert u["b"] is g["b"]
    assert torch.equal(u["w"], 3.0 * g["w"])


def test_mask_as_a_pytree_of_bools_and_by_name_globs():
    params = {"a": {"weight": torch.ones(2), "bias": torch.ones(2)}, "norm": {"weight": torch.ones(2)}}
    grads = tree.map(torch.ones_like, params)
    for mask in ({"a": {"weight": True, "bias": False}, "norm": {"weight": False}}, O.by_name("a.w*")):
        tx = O.masked(O.sgd(1.0), mask)
        u, _ = tx.update(grads, tx.init(params), params)
        assert torch.equal(u["a"]["weight"], -torch.ones(2))
        assert torch.equal(u["a"]["bias"], torch.zeros(2)) and torch.equal(u["norm"]["weight"], torch.zeros(2))
    assert O.by_name("*norm*")("blocks.0.norm.weight", None) and not O.by_name("*.bias")("x.weight", None)


def test_no_decay_on_biases_and_norms_via_partition_is_torch_adamw_with_param_groups():
    gen = torch.Generator().manual_seed(1)
    params = model_params(gen)
    decay = lambda path, x: "decay" if x.dim() >= 2 else "no_decay"  # noqa: E731
    tx = O.partition({"decay": O.adamw(1e-2, weight_decay=0.1), "no_decay": O.adamw(1e-2, weight_decay=0.0)}, decay)
    names = list(params)
    ref = {n: torch.nn.Parameter(params[n].clone()) for n in names}
    opt = torch.optim.AdamW([{"params": [ref[n] for n in names if params[n].dim() >= 2], "weight_decay": 0.1},
                             {"params": [ref[n] for n in names if params[n].dim() < 2], "weight_decay": 0.0}],
                            lr=1e-2, foreach=False)
    state = tx.init(params)
    assert state.inner["no_decay"][1].mu["embed.weight"] is None
    p = params
    for _ in range(5):
        g = grads_like(p, gen)
        for n in names:
            ref[n].grad = g[n].clone()
        opt.step()
        u, state = tx.update(g, state, p)
        p = O.apply_updates(p, u)
    for n in names:
        torch.testing.assert_close(p[n], ref[n].detach(), rtol=1e-6, atol=1e-6, msg=lambda m: f"{n}: {m}")
    assert float(O.current_lr(state)) == pytest.approx(1e-2)


def test_masked_decay_inside_a_chain_matches_torch_param_groups():
    """optax-style: chain(scale_by_adam, masked(add_decayed_weights, others='pass'), lr)."""
    gen = torch.Generator().manual_seed(2)
    params = model_params(gen)
    tx = O.chain(O.scale_by_adam(0.9, 0.99), O.masked(O.add_decayed_weights(0.1), O.by_ndim(2), others="pass"),
                 O.scale_by_learning_rate(1e-2))
    names = list(params)
    ref = {n: torch.nn.Parameter(params[n].clone()) for n in names}
    opt = torch.optim.AdamW([{"params": [ref[n] for n in names if params[n].dim() >= 2], "weight_decay": 0.1},
                             {"params": [ref[n] for n in names if params[n].dim() < 2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.99), foreach=False)
    state = tx.init(params)
    p = params
    for _ in range(8):
        g = grads_like(p, gen)
        for n in names:
            ref[n].grad = g[n].clone()
        opt.step()
        u, state = tx.update(g, state, p)
        p = O.apply_updates(p, u)
    for n in names:
        # the decomposed chain rounds differently from torch's fused step: a few ulps
        torch.testing.assert_close(p[n], ref[n].detach(), rtol=1e-6, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_partition_rejects_unknown_labels_and_mask_trees_of_the_wrong_shape():
    from dsfn.errors import ConfigError
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    with pytest.raises(ConfigError, match="label 'other' has no transform"):
        O.partition({"a": O.sgd(0.1)}, lambda path, x: "a" if x.dim() == 2 else "other").init(params)
    with pytest.raises(ConfigError, match="structure of params"):
        O.masked(O.sgd(0.1), {"w": True}).init(params)
    with pytest.raises(ConfigError, match="not a bool"):
        O.masked(O.sgd(0.1), {"w": True, "b": "yes"}).init(params)


# ---------------------------------------------------------------------------------------
# current_lr


def test_current_lr_finds_the_lr_anywhere_in_a_state_tree():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    assert O.current_lr(O.chain(O.clip_by_global_norm(1.0), O.identity()).init(params)) is None
    assert O.current_lr(O.scale_by_adam().init(params)) is None
    nested = O.chain(O.clip_by_global_norm(1.0), O.masked(O.sgd(O.constant(0.25)), O.by_ndim(2)))
    assert float(O.current_lr(nested.init(params))) == 0.25
    lr = torch.tensor([0.5])
    assert O.current_lr({"opt": [O.adamw(lr).init(params)]}) is lr
