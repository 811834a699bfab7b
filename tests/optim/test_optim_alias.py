"""adamw / adam / sgd equal torch.optim.{AdamW, Adam, SGD}; purity; tensor learning rates.

Tolerance: rtol 1e-6 with atol = 1e-6 * max(1, largest |param| seen in the run). The atol
is an fp32 ulp of the largest values a step combines: where a step carries a parameter
across or near zero, the relative error of the tiny result says nothing. In the regime
where steps are small next to the parameters the results are bitwise torch's
(`test_*_bitwise_*`).

The torch reference is pinned to `foreach=False` (torch's default on CPU).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dsfn.optim as O
from dsfn import tree
from dsfn.testing.strategies import seeds, shapes

RTOL = 1e-6
ATOL_PER_UNIT = 1e-6
SETTINGS = settings(deadline=None, max_examples=25, derandomize=True)

leaf_shapes = st.lists(shapes(max_dims=3, max_side=4), min_size=1, max_size=4)
steps_st = st.integers(min_value=3, max_value=8)
lr_st = st.floats(min_value=-4.0, max_value=0.0).map(lambda e: 10.0 ** e)
beta_st = st.one_of(st.sampled_from([0.0, 0.5, 0.9, 0.99]), st.floats(min_value=0.0, max_value=0.999))
beta2_st = st.one_of(st.sampled_from([0.0, 0.9, 0.999, 0.9999]), st.floats(min_value=0.0, max_value=0.9999))
eps_st = st.floats(min_value=-10.0, max_value=-3.0).map(lambda e: 10.0 ** e)
wd_st = st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1.0))


def make_params(shape_list, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {f"blocks.{i}.w": torch.randn(s, generator=gen) for i, s in enumerate(shape_list)}


def run_against_torch(torch_cls, torch_kwargs: dict, tx: O.GradientTransformation, shape_list, seed: int,
                      steps: int, params: dict | None = None, lrs=None):
    """Run torch's optimizer and `tx` on the same grads; returns (dsfn params, torch params, scale, state).

    `lrs`: optional per-step lrs written into torch's param group before each step.
    """
    gen = torch.Generator().manual_seed(seed)
    params = make_params(shape_list, gen) if params is None else params
    names = list(params)
    ref = [torch.nn.Parameter(params[n].clone()) for n in names]
    opt = torch_cls(ref, foreach=False, **torch_kwargs)
    state = tx.init(params)
    scale = max([1.0] + [float(v.abs().max()) for v in params.values()])
    for k in range(steps):
        grads = {n: torch.randn(params[n].shape, generator=gen) for n in names}
        for p, n in zip(ref, names):
            p.grad = grads[n].clone()
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[k]
        opt.step()
        updates, state = tx.update(grads, state, params)
        params = O.apply_updates(params, updates)
        scale = max([scale] + [float(p.detach().abs().max()) for p in ref])
    return params, {n: p.detach() for n, p in zip(names, ref)}, scale, state


def assert_match(params: dict, ref: dict, scale: float) -> None:
    for n in ref:
        assert params[n].dtype == ref[n].dtype and params[n].shape == ref[n].shape, n
        torch.testing.assert_close(params[n], ref[n], rtol=RTOL, atol=ATOL_PER_UNIT * scale, msg=lambda m: f"{n}: {m}")


FIXED_SHAPES = [(), (1,), (3, 2), (1, 1, 4)]       # 0-dim, 1-element, matrix, 3-d


@SETTINGS
@given(shape_list=leaf_shapes, seed=seeds(), steps=steps_st, lr=lr_st, b1=beta_st, b2=beta2_st, eps=eps_st,
       wd=wd_st, amsgrad=st.booleans(), maximize=st.booleans())
@example(shape_list=FIXED_SHAPES, seed=0, steps=8, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, amsgrad=False,
         maximize=False)
def test_adamw_matches_torch(shape_list, seed, steps, lr, b1, b2, eps, wd, amsgrad, maximize):
    tx = O.adamw(lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    params, ref, scale, _ = run_against_torch(torch.optim.AdamW, kw, tx, shape_list, seed, steps)
    assert_match(params, ref, scale)


@SETTINGS
@given(shape_list=leaf_shapes, seed=seeds(), steps=steps_st, lr=lr_st, b1=beta_st, b2=beta2_st, eps=eps_st,
       wd=wd_st, amsgrad=st.booleans(), maximize=st.booleans())
@example(shape_list=FIXED_SHAPES, seed=1, steps=8, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.1, amsgrad=True,
         maximize=True)
def test_adam_matches_torch(shape_list, seed, steps, lr, b1, b2, eps, wd, amsgrad, maximize):
    tx = O.adam(lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    params, ref, scale, _ = run_against_torch(torch.optim.Adam, kw, tx, shape_list, seed, steps)
    assert_match(params, ref, scale)


@SETTINGS
@given(shape_list=leaf_shapes, seed=seeds(), steps=steps_st, lr=lr_st,
       momentum=st.one_of(st.sampled_from([0.0, 0.5, 0.9, 0.99]), st.floats(min_value=0.0, max_value=0.999)),
       dampening=st.one_of(st.sampled_from([0.0, 0.1, 0.5]), st.floats(min_value=0.0, max_value=1.0)),
       nesterov=st.booleans(), wd=wd_st, maximize=st.booleans())
@example(shape_list=FIXED_SHAPES, seed=2, steps=8, lr=0.1, momentum=0.9, dampening=0.5, nesterov=False, wd=0.01,
         maximize=False)
@example(shape_list=FIXED_SHAPES, seed=3, steps=8, lr=0.1, momentum=0.9, dampening=0.0, nesterov=True, wd=0.0,
         maximize=True)
def test_sgd_matches_torch(shape_list, seed, steps, lr, momentum, dampening, nesterov, wd, maximize):
    if nesterov:                       # torch's rule: nesterov needs momentum > 0 and no dampening
        momentum, dampening = max(momentum, 0.1), 0.0
    tx = O.sgd(lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd, maximize=maximize)
    kw = dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd, maximize=maximize)
    params, ref, scale, _ = run_against_torch(torch.optim.SGD, kw, tx, shape_list, seed, steps)
    assert_match(params, ref, scale)


def _params_away_from_zero(gen: torch.Generator) -> dict[str, torch.Tensor]:
    # |p| >= 0.5 and steps <= lr per update: every step moves p by far less than |p|
    out = {}
    for i, s in enumerate([(), (1,), (7, 5), (3, 4, 2)]):
        x = torch.randn(s, generator=gen)
        out[f"layers.{i}.w"] = torch.where(x >= 0, 0.5 + x, -0.5 + x)
    return out


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.05])
@pytest.mark.parametrize("cls, make", [(torch.optim.AdamW, O.adamw), (torch.optim.Adam, O.adam)])
def test_adam_family_is_bitwise_torch_when_steps_are_small(cls, make, wd, amsgrad):
    gen = torch.Generator().manual_seed(7)
    params = _params_away_from_zero(gen)
    tx = make(1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, amsgrad=amsgrad)
    out, ref, _, _ = run_against_torch(cls, dict(lr=1e-3, weight_decay=wd, amsgrad=amsgrad), tx, None, 11, 40,
                                       params=params)
    for n in ref:
        assert torch.equal(out[n], ref[n]), (n, (out[n] - ref[n]).abs().max())


def test_adamw_many_steps_with_a_schedule_matches_torch():
    """300 updates with a warmup-decay lr: errors do not accumulate past the tolerance."""
    sched = O.WarmupDecayLR(total_num_steps=250, warmup_min_lr=0.0, warmup_max_lr=3e-3, warmup_num_steps=30,
                            warmup_type="linear")
    tx = O.adamw(sched, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    params = make_params([(8, 4), (4,), ()], gen)
    lrs = [sched(c) for c in range(300)]
    out, ref, scale, state = run_against_torch(torch.optim.AdamW, dict(lr=0.0, betas=(0.9, 0.95), weight_decay=0.1),
                                               tx, None, 5, 300, params=params, lrs=lrs)
    assert_match(out, ref, scale)
    assert float(O.current_lr(state)) == lrs[299]


# ---------------------------------------------------------------------------------------
# purity


def _all_leaves(*trees):
    return [x for t in trees for x in tree.leaves(t)]


PURE_CASES = {
    "adamw_amsgrad": lambda: O.adamw(1e-2, weight_decay=0.1, amsgrad=True),
    "adam_l2_maximize": lambda: O.adam(1e-2, weight_decay=0.1, maximize=True),
    "adamw_tensor_lr": lambda: O.adamw(torch.tensor(1e-2, dtype=torch.float64), weight_decay=0.1),
    "sgd_nesterov": lambda: O.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_dampening": lambda: O.sgd(0.1, momentum=0.9, dampening=0.3),
    "clip_then_adamw": lambda: O.chain(O.clip_by_global_norm(0.5), O.adamw(1e-2)),
    "masked_zero": lambda: O.masked(O.adamw(1e-2), O.by_ndim(2)),
    "partition": lambda: O.partition({"a": O.adamw(1e-2), "b": O.sgd(0.1, momentum=0.9)},
                                     lambda path, x: "a" if x.dim() >= 2 else "b"),
    "scale_by_adam_chain": lambda: O.chain(O.scale_by_adam(amsgrad=True), O.add_decayed_weights(0.1),
                                           O.scale_by_learning_rate(1e-2)),
}


@pytest.mark.parametrize("name", sorted(PURE_CASES))
@pytest.mark.parametrize("first_update", [True, False])
def test_update_and_apply_leave_inputs_unchanged(name, first_update):
    gen = torch.Generator().manual_seed(0)
    params = make_params([(3, 2), (2,), ()], gen)
    grads = {n: torch.randn(v.shape, generator=gen) for n, v in params.items()}
    tx = PURE_CASES[name]()
    state = tx.init(params)
    if not first_update:                # a state with non-zero moments and count > 0
        u, state = tx.update(grads, state, params)
        params = O.apply_updates(params, u)
    inputs = _all_leaves(grads, state, params)
    before = [(x.clone(), x._version) for x in inputs]
    updates, new_state = tx.update(grads, state, params)
    new_params = O.apply_updates(params, updates)
    for x, (copy, version) in zip(inputs, before):
        assert x._version == version, "an input tensor was written in place"
        assert torch.equal(x, copy)
    # the outputs are new tensors (never the caller's params), and the state moved on
    assert all(a is not b for a, b in zip(tree.leaves(new_params), tree.leaves(params)))
    assert tree.structure(new_state) == tree.structure(state)
    assert not all(torch.equal(a, b) for a, b in zip(tree.leaves(new_state), tree.leaves(state)))


def test_sgd_state_does_not_alias_grads():
    params = {"w": torch.ones(3)}
    grads = {"w": torch.full((3,), 2.0)}
    tx = O.sgd(0.1, momentum=0.9)
    _, state = tx.update(grads, tx.init(params), params)
    grads["w"].zero_()                  # the caller reuses its gradient buffer
    assert torch.equal(state[2].trace["w"], torch.full((3,), 2.0))


# ---------------------------------------------------------------------------------------
# tensor learning rates


@pytest.mark.parametrize("lr_shape", [(), (1,)])
@pytest.mark.parametrize("lr_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("make", [O.adamw, O.adam, O.sgd])
def test_tensor_lr_is_kept_and_in_place_changes_take_effect(make, lr_dtype, lr_shape):
    lr = torch.full(lr_shape, 1e-2, dtype=lr_dtype)
    tx = make(lr)
    gen = torch.Generator().manual_seed(4)
    params = _params_away_from_zero(gen)
    state = tx.init(params)
    assert O.current_lr(state) is lr
    ref = [torch.nn.Parameter(v.clone()) for v in params.values()]
    torch_cls = {O.adamw: torch.optim.AdamW, O.adam: torch.optim.Adam, O.sgd: torch.optim.SGD}[make]
    opt = torch_cls(ref, lr=torch.full(lr_shape, 1e-2, dtype=lr_dtype), foreach=False)
    for k, value in enumerate([1e-2, 3e-3, 0.0, 5e-2]):
        lr.fill_(value)                                  # DeepSpeed's update_lr: in place
        opt.param_groups[0]["lr"].fill_(value)
        grads = {n: torch.randn(v.shape, generator=gen) for n, v in params.items()}
        for p, g in zip(ref, grads.values()):
            p.grad = g.clone()
        opt.step()
        updates, state = tx.update(grads, state, params)
        assert all(u.dtype == torch.float32 for u in tree.leaves(updates)), "the lr's dtype leaked into updates"
        params = O.apply_updates(params, updates)
        lr_state = O.current_lr(state)
        assert lr_state is lr and lr_state.dtype == lr_dtype and lr_state.shape == lr_shape
    for p, (n, v) in zip(ref, params.items()):
        assert v.dtype == torch.float32
        if make is O.sgd:   # torch fuses p - lr * g into one FMA: an ulp per step
            torch.testing.assert_close(v, p.detach(), rtol=RTOL, atol=ATOL_PER_UNIT, msg=lambda m: f"{n}: {m}")
        else:               # the tensor-lr path reproduces torch's scalars and op order
            assert torch.equal(v, p.detach()), (n, (v - p.detach()).abs().max())


def test_float64_tensor_lr_with_a_zero_dim_float32_param_keeps_float32():
    params = {"scale": torch.tensor(1.5), "w": torch.ones(2, 2)}
    lr = torch.tensor(0.1, dtype=torch.float64)
    for tx in (O.adamw(lr), O.sgd(lr, momentum=0.9)):
        state = tx.init(params)
        updates, state = tx.update({k: torch.ones_like(v) for k, v in params.items()}, state, params)
        assert updates["scale"].dtype == torch.float32
        assert O.apply_updates(params, updates)["scale"].dtype == torch.float32
        assert O.current_lr(state).dtype == torch.float64


def test_schedule_returning_a_tensor_keeps_its_dtype_and_is_the_lr_used():
    sched = lambda count: torch.tensor(0.5, dtype=torch.float64) * (count + 1)  # noqa: E731
    tx = O.sgd(sched)
    params = {"w": torch.zeros(2)}
    state = tx.init(params)
    for c in range(3):
        updates, state = tx.update({"w": torch.ones(2)}, state, params)
        assert torch.equal(updates["w"], torch.full((2,), -0.5 * (c + 1)))
        assert O.current_lr(state).dtype == torch.float64 and float(O.current_lr(state)) == 0.5 * (c + 1)


def test_float_lr_is_recorded_as_float64_and_schedule_sees_the_count_before_the_update():
    seen = []

    def sched(count):
        assert isinstance(count, torch.Tensor) and count.dtype == torch.int64 and count.dim() == 0
        seen.append(int(count))
        return 0.1 * (int(count) + 1)

    tx = O.adamw(sched)
    params = {"w": torch.ones(2)}
    state = tx.init(params)
    assert float(O.current_lr(state)) == pytest.approx(0.1)
    for _ in range(3):
        _, state = tx.update({"w": torch.ones(2)}, state, params)
    assert seen == [0, 0, 1, 2]                       # init, then updates at counts 0, 1, 2
    seen.clear()
    sgd_state = O.sgd(sched).init(params)
    assert seen == [0] and float(O.current_lr(sgd_state)) == pytest.approx(0.1)
    assert O.current_lr(state).dtype == torch.float64 and float(O.current_lr(state)) == pytest.approx(0.3)
    assert math.isclose(float(O.current_lr(O.adamw(3e-4).init(params))), 3e-4)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_float64_tensor_lr_on_many_0_dim_leaves_is_bitwise_torch(wd):
    """0-dim leaves are where a float64 lr tensor changes torch's rounding (0-dim tensors
    promote each other): the decay product is taken in float64, the step scalar in float32."""
    gen = torch.Generator().manual_seed(0)
    params = {f"s{i:04d}": (0.5 + torch.rand((), generator=gen)) * (1 if i % 2 else -1) for i in range(3000)}
    lr = torch.tensor(3e-3, dtype=torch.float64)
    tx = O.adamw(lr, weight_decay=wd)
    out, ref, _, _ = run_against_torch(torch.optim.AdamW, dict(lr=lr.clone(), weight_decay=wd), tx, None, 1, 5,
                                       params=params)
    bad = [n for n in ref if not torch.equal(out[n], ref[n])]
    assert not bad, f"{len(bad)} leaves differ, e.g. {bad[:3]}"
