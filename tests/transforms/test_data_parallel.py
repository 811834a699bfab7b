"""data_parallel: equals the single-process reference; communicates exactly the gradients."""
import torch
from hypothesis import given, settings, strategies as st

import dsfn
from dsfn import tree
from dsfn.errors import ShapeError
from dsfn.runtime import counters, init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches, token_batches
from dsfn.testing.reference import assert_matches_reference, lm_loss
from dsfn.transforms import data_parallel


@settings(deadline=None, max_examples=15, derandomize=True)
@given(world=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000),
       hidden=st.lists(st.integers(1, 9), min_size=0, max_size=2),
       rows_per_rank=st.integers(1, 3))
def test_data_parallel_equals_single_process_reference(world, seed, hidden, rows_per_rank):
    sizes = [5, *hidden, 3]
    batches = regression_batches(3, 4 * rows_per_rank, 5, 3, seed=seed)   # 4*k rows: divisible by 1, 2, 4
    assert_matches_reference(lambda: [data_parallel(bucket_mb=1e-4)],   # tiny buckets: many collectives
                             lambda: make_mlp(sizes, seed), lambda: dsfn.optim.adamw(lr=1e-2),
                             batches, world, rtol=1e-5, atol=1e-6, seed=seed)


def test_data_parallel_on_the_tiny_gpt_equals_reference():
    from dsfn.models.gpt import GPT, GPTConfig

    def make_model():
        return GPT(GPTConfig.preset("tiny"))
    batches = token_batches(2, 4, 16, 256, seed=3)
    # SGD, not Adam: the key bias's gradient is exactly zero in exact arithmetic (softmax is
    # shift-invariant), so Adam would turn reduction-order rounding noise into +-lr steps.
    assert_matches_reference(lambda: [data_parallel()], make_model, lambda: dsfn.optim.sgd(lr=0.1, momentum=0.9),
                             batches, 2, loss_fn=lm_loss, rtol=1e-5, atol=1e-6)


def _count_bytes():
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([4, 8, 2], 0))
    step = dsfn.compose(data_parallel())(_train_step(apply_fn))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    counters.reset()
    state, _ = step(state, regression_batches(1, 4, 4, 2)[0])
    grad_bytes = sum(p.numel() * p.element_size() for p in tree.leaves(params))
    # the loss metric travels in one extra float64 all-reduce (lr is not reduced)
    return counters.bytes("dp", "all_reduce"), grad_bytes, counters.calls("dp", "all_reduce")


def _train_step(apply_fn):
    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(
            lambda p, b: torch.nn.functional.mse_loss(apply_fn(p, b["x"]), b["y"]))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return train_step


def test_all_reduce_bytes_per_step_equal_gradient_bytes():
    for total, grad_bytes, calls in run_on_ranks(_count_bytes, 2, timeout=60):
        assert total == grad_bytes + 8     # + the loss metric, one float64 (lr is not reduced)
        assert calls == 2   # one gradient bucket + one metrics vector


def _step_does_not_mutate():
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([4, 8, 2], 0))
    step = dsfn.compose(data_parallel())(_train_step(apply_fn))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=0.1)))
    before = tree.map(torch.clone, state)
    new, _ = step(state, regression_batches(1, 4, 4, 2)[0])
    same = all(torch.equal(a, b) for a, b in zip(tree.leaves(before), tree.leaves(state)))
    changed = not torch.equal(tree.leaves(new.params)[0], tree.leaves(state.params)[0])
    return same, changed, int(new.step)


def test_step_never_mutates_the_input_state():
    for same, changed, step in run_on_ranks(_step_does_not_mutate, 2, timeout=60):
        assert same and changed and step == 1


def _place_broadcasts():
    mesh = init_mesh()
    params = {"w": torch.full((3,), float(mesh.rank))}       # ranks start different
    state = dsfn.compose(data_parallel())(lambda s, b: (s, {})).place(
        dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    return state.params["w"].tolist(), params["w"].tolist()


def test_place_broadcasts_rank0_state_without_mutating_input():
    out = run_on_ranks(_place_broadcasts, 2, timeout=60)
    assert [o[0] for o in out] == [[0.0] * 3, [0.0] * 3]
    assert out[1][1] == [1.0] * 3


def _indivisible():
    init_mesh()
    step = dsfn.compose(data_parallel())(lambda s, b: (s, {}))
    try:
        step({}, {"x": torch.zeros(3, 2)})
    except ShapeError as e:
        return str(e)
    return "no error"


def test_batch_not_divisible_by_dp_is_a_clear_error():
    msgs = run_on_ranks(_indivisible, 2, timeout=60)
    assert all("'x'" in m and "divisible by 2" in m for m in msgs), msgs


def _rows_seen():
    mesh = init_mesh()
    seen = []
    step = dsfn.compose(data_parallel())(lambda s, b: (seen.append(b["x"].clone()) or s, {}))
    step({}, {"x": torch.arange(8.0).reshape(4, 2)})
    return mesh.rank, seen[0].tolist()


def test_each_rank_trains_on_its_own_rows():
    """The global batch is split, not replicated: with a mean loss a rank given the whole batch
    computes the same gradient, so the comparisons above cannot see it (BatchNorm would)."""
    assert run_on_ranks(_rows_seen, 2, timeout=60) == [(0, [[0.0, 1.0], [2.0, 3.0]]), (1, [[4.0, 5.0], [6.0, 7.0]])]


def test_single_process_data_parallel_is_identity():
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([4, 2], 0))
    batch = regression_batches(1, 3, 4, 2)[0]        # 3 rows: fine with dp=1
    ref_state, ref_m = dsfn.compose()(_train_step(apply_fn))(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)), batch)
    st_, m = dsfn.compose(data_parallel())(_train_step(apply_fn))(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)), batch)
    assert torch.equal(m["loss"], ref_m["loss"])
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(st_.params), tree.leaves(ref_state.params)))
