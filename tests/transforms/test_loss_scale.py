"""loss_scale: fp16 dynamic loss scaling with DeepSpeed's semantics; overflow skips on every rank.

The scale sequence is checked against an independent transcription of DeepSpeed's
`DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py, as described in
dsfn/transforms/loss_scale.py and /work/shared/reference/deepspeed_features.md §3): halve on
overflow once the hysteresis budget is spent, skip every overflowed step, double after `window`
clean steps counted from the step after the last overflow (the first increase comes after
window + 1 clean steps — measured.md).
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import dsfn
from dsfn import tree
from dsfn.errors import ConfigError, StackError
from dsfn.runtime import current_mesh, init_mesh
from dsfn.testing import assert_trees_close, assert_trees_equal, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import mse_loss, run_training
from dsfn.transforms import clip_grad_norm, compose, loss_scale, mixed_precision, shard_zero
from dsfn.transforms.loss_scale import LossScale, LossScaleError, LossScaleState


class DeepSpeedDynamicLossScaler:
    """DeepSpeed's DynamicLossScaler.update_scale, transcribed (attribute names as in DeepSpeed)."""

    def __init__(self, init_scale=2.0 ** 16, scale_window=1000, min_scale=1.0, delayed_shift=2,
                 consecutive_hysteresis=False, scale_factor=2.0, raise_error_at_min_scale=True):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError("Current loss scale already at minimum - cannot decrease scale anymore.")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def ds_sequence(pattern, **kw):
    """Scales after each update; stops (returning the index) where DeepSpeed raises."""
    ds = DeepSpeedDynamicLossScaler(**kw)
    out = []
    for i, overflow in enumerate(pattern):
        try:
            ds.update_scale(overflow)
        except RuntimeError:
            return out, i
        out.append((ds.cur_scale, ds.cur_hysteresis, ds.cur_iter, ds.last_overflow_iter))
    return out, None


def dsfn_sequence(pattern, **kw):
    t = loss_scale(**kw)
    ls = t.initial_state()
    out = []
    for i, overflow in enumerate(pattern):
        try:
            ls = t.updated(ls, overflow)
        except LossScaleError:
            return out, i
        out.append((float(ls.scale), int(ls.hysteresis), int(ls.cur_iter), int(ls.last_overflow_iter)))
    return out, None


def _kw_to_ds(kw):
    return dict(init_scale=kw.get("init_scale", 2.0 ** 16), scale_window=kw.get("window", 1000),
                min_scale=kw.get("min_scale", 1.0), delayed_shift=kw.get("hysteresis", 2),
                consecutive_hysteresis=kw.get("consecutive_hysteresis", False))


# ----------------------------------------------------------------------------------------------
# the update rule
# ----------------------------------------------------------------------------------------------

@settings(deadline=None, max_examples=60, derandomize=True)
@given(pattern=st.lists(st.booleans(), min_size=1, max_size=60), window=st.integers(1, 4),
       hysteresis=st.integers(1, 3), consecutive=st.booleans(), power=st.integers(0, 6),
       min_scale=st.sampled_from([1.0, 0.5, 0.25]))
def test_updated_equals_deepspeed_over_scripted_overflow_patterns(pattern, window, hysteresis, consecutive, power,
                                                                   min_scale):
    """Property: for any overflow pattern and config, (scale, hysteresis, cur_iter,
    last_overflow_iter) after every update equal DeepSpeed's, and both raise at the same step."""
    kw = dict(init_scale=2.0 ** power, window=window, hysteresis=hysteresis, consecutive_hysteresis=consecutive,
              min_scale=min_scale)
    assert dsfn_sequence(pattern, **kw) == ds_sequence(pattern, **_kw_to_ds(kw))


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window,hysteresis", [(2, 1), (2, 2), (3, 2), (3, 3)])
def test_fixed_patterns_equal_deepspeed(window, hysteresis, consecutive):
    pattern = [False, True, False, False, True, True, False, False, False, True, False, True, False, False,
               False, False, False, False, False, True, True, True, False, False, False, False]
    kw = dict(init_scale=2.0 ** 12, window=window, hysteresis=hysteresis, consecutive_hysteresis=consecutive)
    got, raised = dsfn_sequence(pattern, **kw)
    assert raised is None
    assert (got, raised) == ds_sequence(pattern, **_kw_to_ds(kw))


def test_hand_computed_sequences():
    """DeepSpeed's own unit test: hysteresis 1, window 2, 2^8: inf, nan -> /4; then window + 1
    clean steps -> x2. Defaults: the first overflow is absorbed by hysteresis 2, the second
    halves; 1000 clean steps keep 2^16, the 1001st doubles, then every 1000."""
    got, _ = dsfn_sequence([True, True, False, False, False], init_scale=2.0 ** 8, window=2, hysteresis=1)
    assert [s for s, *_ in got] == [128, 64, 64, 64, 128]
    got, _ = dsfn_sequence([True, True, True], )
    assert [s for s, *_ in got] == [2 ** 16, 2 ** 15, 2 ** 14]
    got, _ = dsfn_sequence([False] * 2001)
    scales = [s for s, *_ in got]
    assert scales[999] == 2 ** 16 and scales[1000] == 2 ** 17 and scales[1999] == 2 ** 17 and scales[2000] == 2 ** 18
    assert scales == [s for s, *_ in ds_sequence([False] * 2001)[0]]


def test_overflow_at_minimum_scale_raises_with_a_clear_message():
    t = loss_scale(init_scale=4.0, min_scale=1.0, hysteresis=1)
    ls = t.updated(t.updated(t.initial_state(), True), True)
    assert float(ls.scale) == 1.0
    with pytest.raises(LossScaleError, match="minimum loss scale"):
        t.updated(ls, True)
    # hysteresis 2 at the minimum: the first overflow spends hysteresis, the second raises (DeepSpeed)
    t2 = loss_scale(init_scale=1.0, min_scale=1.0, hysteresis=2)
    ls2 = t2.updated(t2.initial_state(), True)
    assert float(ls2.scale) == 1.0 and int(ls2.hysteresis) == 1
    with pytest.raises(LossScaleError):
        t2.updated(ls2, True)


def test_static_scale_never_changes():
    t = loss_scale(static=128.0)
    ls = t.initial_state()
    for overflow in [True] * 5 + [False] * 50 + [True, False, True]:
        ls = t.updated(ls, overflow)
        assert float(ls.scale) == 128.0
    assert int(ls.cur_iter) == 58


def test_updated_is_pure():
    t = loss_scale(window=1)
    ls = t.initial_state()
    before = tree.map(torch.clone, ls)
    t.updated(ls, True)
    t.updated(ls, False)
    assert_trees_equal(ls, before)


# ----------------------------------------------------------------------------------------------
# end to end on 2 ranks: overflow on ONE rank skips everywhere
# ----------------------------------------------------------------------------------------------

class PoisonGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `mask` (inf where poisoned)."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.mask = mask
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.mask.to(g.dtype), None


class Net(nn.Module):
    """`v` has 2 elements: over 2 ranks, element 1 lives only in rank 1's shard."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.v = nn.Parameter(torch.tensor([0.5, -0.25]))
        self.mask = None

    def forward(self, x):
        v = self.v if self.mask is None else PoisonGrad.apply(self.v, self.mask)
        return self.lin(x) + v.sum()


INJECT_STEPS = {1, 2, 4}
N_STEPS = 8


def _overflow_run(configs):
    """Rank 0 poisons v[1]'s gradient at INJECT_STEPS; reduced, the inf lands only in rank 1's
    shard (stages 1-3), so rank 0 sees finite local gradients and must learn of the overflow."""
    init_mesh()
    rank = current_mesh().local_rank("dp")
    out = {}
    for key, stage, ls_kw in configs:
        model = Net()
        apply_fn, params = dsfn.functionalize(model)
        counter = [0]

        def train_step(state, batch):
            poisoned = rank == 0 and counter[0] in INJECT_STEPS
            model.mask = torch.tensor([1.0, float("inf")]) if poisoned else None
            counter[0] += 1
            loss, grads = dsfn.value_and_grad(lambda p, b: mse_loss(apply_fn, p, b))(state.params, batch)
            local_finite = all(bool(torch.isfinite(g).all()) for g in tree.leaves(grads))
            return state.apply_gradients(grads), {"loss": loss, "local_finite": float(local_finite)}

        step = compose(shard_zero(stage, param_persistence_threshold=0), mixed_precision(torch.float16),
                       loss_scale(**ls_kw))(train_step)
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
        rows = []
        for batch in regression_batches(N_STEPS, 4, 4, 3, seed=1):
            before = state
            state, m = step(state, batch)
            phys = lambda s: (s.params, s.opt_state, s.step)
            untouched = all(torch.equal(a, b) for a, b in zip(tree.leaves(phys(before)), tree.leaves(phys(state))))
            rows.append(dict(scale=float(m["loss_scale"]), skipped=float(m["skipped"]), untouched=untouched,
                             step=int(state.step), rank_local_finite=m["local_finite"]))
        finite = all(bool(torch.isfinite(x).all()) for x in tree.leaves((state.params, state.opt_state))
                     if x.is_floating_point())
        out[key] = dict(rows=rows, finite=finite)
    return out


def test_overflow_on_one_rank_skips_every_rank_and_follows_deepspeed():
    """fp16 + loss_scale(window=2, hysteresis=2, init 2^10) on 2 ranks, stages 0-3, and a static
    scale: at the poisoned steps every rank reports skipped, params / optimizer moments / master
    weights / step are bitwise those before the step, no inf/NaN reaches the state, and the
    scale sequence equals DeepSpeed's for the same overflow pattern (hand-checked:
    1024, 1024 (hysteresis absorbs), 512, 512, 256, 256, 256, 512)."""
    dyn = dict(init_scale=2.0 ** 10, window=2, hysteresis=2)
    configs = [(f"s{s}", s, dyn) for s in range(4)] + [("static", 2, dict(static=256.0))]
    pattern = [i in INJECT_STEPS for i in range(N_STEPS)]
    expected = [s for s, *_ in ds_sequence(pattern, init_scale=2.0 ** 10, scale_window=2, delayed_shift=2)[0]]
    assert expected == [1024, 1024, 512, 512, 256, 256, 256, 512]
    results = run_on_ranks(_overflow_run, 2, configs, timeout=60)
    for rank, res in enumerate(results):
        for key, r in res.items():
            rows = r["rows"]
            assert [row["skipped"] for row in rows] == [float(p) for p in pattern], (rank, key, rows)
            assert [row["untouched"] for row in rows] == pattern, (rank, key, rows)
            steps = [row["step"] for row in rows]
            assert steps == [sum(not p for p in pattern[:i + 1]) for i in range(N_STEPS)], (rank, key, steps)
            want = [256.0] * N_STEPS if key == "static" else expected
            assert [row["scale"] for row in rows] == want, (rank, key, [row["scale"] for row in rows])
            assert r["finite"], (rank, key)
    # the test means something: under stages 1-3, some poisoned steps left rank 0's own
    # gradient shards finite (average of the local_finite metric over the 2 ranks is 0.5)
    for key in ("s1", "s2", "s3"):
        assert any(results[0][key]["rows"][i]["rank_local_finite"] == 0.5 for i in INJECT_STEPS), key


def _overflow_two_axes():
    """Mesh dp=2 x tp=2 (the tp peers are plain replicas here). Only (dp 0, tp 1) poisons its
    gradient: the dp group {(0,0), (1,0)} reduces finite gradients, so those ranks can only learn
    of the overflow through the tp axis."""
    mesh = init_mesh(dp=2, tp=2)
    poison_me = mesh.local_rank("dp") == 0 and mesh.local_rank("tp") == 1
    model = Net()
    apply_fn, params = dsfn.functionalize(model)
    counter = [0]

    def train_step(state, batch):
        model.mask = torch.tensor([float("inf"), 1.0]) if (poison_me and counter[0] == 1) else None
        counter[0] += 1
        loss, grads = dsfn.value_and_grad(lambda p, b: mse_loss(apply_fn, p, b))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = compose(shard_zero(2, param_persistence_threshold=0), mixed_precision(torch.float16),
                   loss_scale(init_scale=2.0 ** 10, hysteresis=1))(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    rows = []
    for batch in regression_batches(3, 4, 4, 3, seed=2):
        before = state
        state, m = step(state, batch)
        untouched = all(torch.equal(a, b) for a, b in zip(tree.leaves((before.params, before.opt_state, before.step)),
                                                           tree.leaves((state.params, state.opt_state, state.step))))
        rows.append((float(m["skipped"]), float(m["loss_scale"]), untouched, int(state.step)))
    return rows


def test_overflow_is_agreed_over_every_mesh_axis():
    for rank, rows in enumerate(run_on_ranks(_overflow_two_axes, 4, timeout=60)):
        assert rows == [(0.0, 1024.0, False, 1), (1.0, 512.0, True, 1), (0.0, 512.0, False, 2)], (rank, rows)


def _min_scale_error():
    init_mesh()
    rank = current_mesh().local_rank("dp")
    apply_fn, params = dsfn.functionalize(make_mlp([4, 3], 0))

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: mse_loss(apply_fn, p, b))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = compose(shard_zero(2), loss_scale(init_scale=2.0, min_scale=1.0, hysteresis=1))(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    batch = regression_batches(1, 4, 4, 3)[0]
    batch["x"][2:, 0] = float("inf")            # only rank 1's rows
    scales = []
    for i in range(3):
        try:
            state, m = step(state, batch)
            scales.append(float(m["loss_scale"]))
        except LossScaleError as e:
            return rank, i, scales, str(e)
    return rank, None, scales, ""


def test_overflow_persisting_at_minimum_raises_on_every_rank():
    for rank, raised_at, scales, msg in run_on_ranks(_min_scale_error, 2, timeout=60):
        assert scales == [1.0] and raised_at == 1, (rank, raised_at, scales)
        assert "minimum loss scale" in msg


# ----------------------------------------------------------------------------------------------
# numerics in fp32: scaling is exact, unscaling is folded into clipping
# ----------------------------------------------------------------------------------------------

def test_fp32_loss_scaling_by_powers_of_two_is_exact():
    """Multiplying the loss by 2^k and the gradients by 2^-k is exact in fp32: the run equals
    the unscaled one bitwise (window=1 so the scale changes every step)."""
    batches = regression_batches(4, 4, 5, 3, seed=2)
    ref = run_training(lambda: make_mlp([5, 7, 3], 0), lambda: dsfn.optim.adamw(lr=1e-2), batches)
    got = run_training(lambda: make_mlp([5, 7, 3], 0), lambda: dsfn.optim.adamw(lr=1e-2), batches,
                       [loss_scale(init_scale=2.0 ** 10, window=1)])
    assert got.losses == ref.losses
    assert_trees_equal(got.state.params, ref.state.params)
    assert [m["loss_scale"] for m in got.metrics] == [2.0 ** 10, 2.0 ** 11, 2.0 ** 12, 2.0 ** 13]
    assert [m["skipped"] for m in got.metrics] == [0.0] * 4


def test_unscale_folded_into_clipping_equals_clipping_alone():
    """loss_scale + clip_grad_norm (one combined multiply) equals clip_grad_norm on unscaled
    gradients, and reports the unscaled norm."""
    batches = regression_batches(3, 4, 5, 3, seed=3)
    ref = run_training(lambda: make_mlp([5, 7, 3], 0), lambda: dsfn.optim.sgd(lr=0.1), batches, [clip_grad_norm(0.1)])
    got = run_training(lambda: make_mlp([5, 7, 3], 0), lambda: dsfn.optim.sgd(lr=0.1), batches,
                       [loss_scale(init_scale=2.0 ** 12), clip_grad_norm(0.1)])
    assert all(m["grad_norm"] > 0.1 for m in ref.metrics)      # clipping active
    torch.testing.assert_close(torch.tensor([m["grad_norm"] for m in got.metrics]),
                               torch.tensor([m["grad_norm"] for m in ref.metrics]), rtol=1e-6, atol=0)
    assert_trees_close(got.state.params, ref.state.params, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# state and bad input
# ----------------------------------------------------------------------------------------------

def test_place_puts_the_scale_state_in_extra():
    step = compose(loss_scale(init_scale=2.0 ** 5, hysteresis=3))(lambda s, b: (s, {}))
    apply_fn, params = dsfn.functionalize(make_mlp([2, 2], 0))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    ls = state.extra["loss_scale"]
    assert isinstance(ls, LossScaleState)
    assert float(ls.scale) == 32.0 and int(ls.hysteresis) == 3 and int(ls.cur_iter) == 0
    assert int(ls.last_overflow_iter) == -1
    with pytest.raises(ConfigError, match="place"):
        step(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)), {"x": torch.zeros(1)})


@pytest.mark.parametrize("kwargs", [dict(init_scale=0), dict(window=0), dict(hysteresis=0), dict(min_scale=0),
                                    dict(init_scale=4.0, min_scale=8.0), dict(static=-1.0), dict(static="x")])
def test_bad_loss_scale_options_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        loss_scale(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(init_scale=1024.0), dict(window=10), dict(hysteresis=1),
                                    dict(min_scale=0.5), dict(consecutive_hysteresis=True)])
def test_dynamic_options_with_a_static_scale_are_config_errors(kwargs):
    """Issue 31: a static scale never changes, so the dynamic options would be accepted and do
    nothing: each is refused, naming it. Left at their defaults they are accepted, and a static
    scale below the default min_scale (which it never reads) is one too."""
    key = next(iter(kwargs))
    with pytest.raises(ConfigError, match=rf"static=128.0, {key}=.*never changes, so {key} would do nothing"):
        loss_scale(static=128.0, **kwargs)
    assert loss_scale(**kwargs).static is False          # the dynamic scale reads it
    t = loss_scale(static=128.0, init_scale=2.0 ** 16, window=1000, hysteresis=2, min_scale=1.0)
    assert t.static and t.init_scale == 128.0
    assert float(loss_scale(static=0.5).initial_state().scale) == 0.5


def test_loss_scale_defaults_are_deepspeeds():
    t = loss_scale()
    assert isinstance(t, LossScale)
    assert (t.init_scale, t.window, t.hysteresis, t.min_scale, t.static, t.consecutive_hysteresis) == \
        (2.0 ** 16, 1000, 2, 1.0, False, False)


def test_clip_outside_loss_scale_is_a_stack_error():
    with pytest.raises(StackError, match="inside loss_scale"):
        compose(clip_grad_norm(1.0), loss_scale())
