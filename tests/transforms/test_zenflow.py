"""zenflow(topk_ratio, update_interval): the top columns (dim 1 of [out, in]) by gradient norm
take the optimizer every step; the others' gradients are averaged over update_interval steps
and applied by a second optimizer state (the host path); moments migrate at re-selection."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn import tree
from dsfn.errors import ConfigError, StackError
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import (
    assert_matches_reference,
    mse_loss,
    run_training,
    train_step_for,
)
from dsfn.transforms import (
    clip_grad_norm,
    compose,
    data_parallel,
    loss_scale,
    mixed_precision,
    offload,
    shard_zero,
    zenflow,
)
from dsfn.transforms.zenflow import num_selected

SIZES = [5, 7, 3]          # matrices 7x5 and 3x7: at most 50 columns, so topk_ratio=0.99 selects all


def grad_step(state, batch):
    """A train step whose gradients are the batch: the update sees exactly what the test chose."""
    return state.apply_gradients({"b": batch["gb"], "w": batch["gw"]}), {"loss": 0.0}


def make_state(step, w, tx):
    return step.place(dsfn.TrainState.create({"b": torch.zeros(w.shape[0]), "w": w.clone()}, tx))


def sel_idx(mask):
    """The selected column indices of a zenflow selection mask."""
    assert mask.dtype == torch.bool
    return mask.nonzero().flatten().tolist()


def assert_trees_equal(a, b):
    la, sa = tree.flatten(a)
    lb, sb = tree.flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)


def test_hand_checked_sgd_three_steps():
    """W 3x4, SGD lr=1, topk 0.5 (k=2 columns), update_interval 2 (= select_interval).
    step 0: column sq-norms 3,4,9,1 -> columns {1,2} take G0; columns {0,3} go to the buffer;
    step 1: {1,2} take G1; flush: columns {0,3} take (G0+G1)/2;
    step 2: all norms tie -> lower indices {0,1} take G2; columns {2,3} wait in the buffer.
    The bias (1-D) takes its gradient every step."""
    w0 = torch.tensor([[0., 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    g = [torch.tensor([[1., 0, 3, 0], [1, 2, 0, 0], [1, 0, 0, 1]]),
         torch.tensor([[2., 1, 1, 4], [0, 1, 1, 2], [2, 1, 1, 0]]),
         torch.ones(3, 4)]
    step = compose(zenflow(topk_ratio=0.5, update_interval=2))(grad_step)
    state = make_state(step, w0, dsfn.optim.sgd(lr=1.0))
    expected_w = [torch.tensor([[0., 1, -1, 3], [4, 3, 6, 7], [8, 9, 10, 11]]),
                  torch.tensor([[-1.5, 0, -2, 1], [3.5, 2, 5, 6], [6.5, 8, 9, 10.5]]),
                  torch.tensor([[-2.5, -1, -2, 1], [2.5, 1, 5, 6], [5.5, 7, 9, 10.5]])]
    expected_sel = [[1, 2], [1, 2], [0, 1]]
    expected_buf = [torch.tensor([[1., 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 1]]),
                    torch.zeros(3, 4),
                    torch.tensor([[0., 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]])]
    before = state
    for t in range(3):
        state, _ = step(state, {"gb": torch.tensor([1., 2, 3]) * (t + 1), "gw": g[t]})
        assert torch.equal(state.params["w"], expected_w[t]), (t, state.params["w"])
        zs = state.extra["zenflow"]
        assert sel_idx(zs["selected"]["w"]) == expected_sel[t]
        assert torch.equal(zs["buffer"]["w"], expected_buf[t]), (t, zs["buffer"]["w"])
        assert int(zs["step"]) == int(state.step) == t + 1
    assert torch.equal(state.params["b"], torch.tensor([-6., -12, -18]))
    assert torch.equal(before.params["w"], w0)             # the input state was not written


def test_hand_checked_topk_quarter_selects_one_column():
    """topk 0.25 of 4 columns = 1 column (the largest norm, column 2 of G0); update_interval 1
    applies the other columns' gradient in the same step, so with SGD it is plain SGD."""
    w0 = torch.zeros(3, 4)
    g0 = torch.tensor([[1., 0, 3, 0], [1, 2, 0, 0], [1, 0, 0, 1]])
    step = compose(zenflow(topk_ratio=0.25, update_interval=1))(grad_step)
    state, _ = step(make_state(step, w0, dsfn.optim.sgd(lr=1.0)), {"gb": torch.ones(3), "gw": g0})
    assert sel_idx(state.extra["zenflow"]["selected"]["w"]) == [2]
    assert torch.equal(state.params["w"], -g0)


def test_num_selected_rounds_half_up_and_clamps():
    assert [num_selected(0.1, 64), num_selected(0.25, 4), num_selected(0.5, 4), num_selected(0.3, 10),
            num_selected(0.01, 5), num_selected(0.99, 50), num_selected(0.99, 51), num_selected(0.125, 4)] == \
        [6, 1, 2, 3, 1, 50, 50, 1]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(1, 4), cols=st.integers(1, 12), ratio=st.floats(0.01, 0.99),
       data=st.data())
def test_selection_is_top_k_column_norms_lower_index_first(rows, cols, ratio, data):
    """Integer gradients make squared norms exact (and ties frequent): the selection equals a
    reference sorted by (-norm², index); the unselected columns are untouched (no flush yet)."""
    vals = data.draw(st.lists(st.integers(-3, 3), min_size=rows * cols, max_size=rows * cols))
    gw = torch.tensor(vals, dtype=torch.float32).reshape(rows, cols)
    sq = [sum(vals[r * cols + j] ** 2 for r in range(rows)) for j in range(cols)]
    k = min(cols, max(1, math.floor(ratio * cols + 0.5)))
    ref = sorted(sorted(range(cols), key=lambda j: (-sq[j], j))[:k])
    step = compose(zenflow(topk_ratio=ratio, update_interval=2))(grad_step)
    w0 = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    state, _ = step(make_state(step, w0, dsfn.optim.sgd(lr=1.0)), {"gb": torch.zeros(rows), "gw": gw})
    assert sel_idx(state.extra["zenflow"]["selected"]["w"]) == ref
    expected = w0.clone()
    expected[:, ref] -= gw[:, ref]
    assert torch.equal(state.params["w"], expected)


def _train(transforms, tx, n=6, seed=1):
    batches = regression_batches(n, 8, 5, 3, seed=seed)
    return run_training(lambda: make_mlp(SIZES, 0), tx, batches, transforms)


def test_limit_all_columns_selected_is_adamw_bitwise():
    """topk 0.99 selects every column of these matrices (k == n_in): the reference bitwise."""
    tx = lambda: dsfn.optim.adamw(lr=1e-2)
    ref, got = _train([], tx), _train([zenflow(topk_ratio=0.99, update_interval=3)], tx)
    assert got.losses == ref.losses
    assert_trees_equal(got.state.params, ref.state.params)
    assert_trees_equal(got.state.opt_state, ref.state.opt_state)
    other = _train([zenflow(topk_ratio=0.3, update_interval=3)], tx)      # a real selection differs
    assert not torch.equal(other.state.params["layers.0.weight"], ref.state.params["layers.0.weight"])


def test_limit_update_interval_one_with_plain_sgd_is_sgd_bitwise():
    tx = lambda: dsfn.optim.sgd(lr=0.1)
    ref, got = _train([], tx), _train([zenflow(topk_ratio=0.3, update_interval=1)], tx)
    assert got.losses == ref.losses
    assert_trees_equal(got.state.params, ref.state.params)


def test_adam_state_per_path_and_migration():
    """Device moments move only in selected columns, host moments only in the others (at a flush);
    counts: device = updates, host = flushes; at re-selection both get each column's current
    moments (device where it was selected, host elsewhere)."""
    batches = regression_batches(3, 8, 5, 3, seed=4)
    torch.manual_seed(0)
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))

    train_step = train_step_for(apply_fn, mse_loss)
    step = compose(zenflow(topk_ratio=0.4, update_interval=2))(train_step)
    s0 = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    name = "layers.0.weight"
    s1, _ = step(s0, batches[0])
    sel = torch.tensor(sel_idx(s1.extra["zenflow"]["selected"][name]))
    unsel = [j for j in range(5) if j not in sel.tolist()]
    dev, host = s1.opt_state[1], s1.extra["zenflow"]["host_opt"][1]
    assert len(sel) == 2 and torch.all(dev.mu[name][:, sel] != 0) and torch.all(dev.mu[name][:, unsel] == 0)
    assert torch.all(host.mu[name] == 0) and int(host.count) == 0 and int(dev.count) == 1
    s2, _ = step(s1, batches[1])                                      # flush
    dev, host = s2.opt_state[1], s2.extra["zenflow"]["host_opt"][1]
    assert int(host.count) == 1 and int(dev.count) == 2
    assert torch.all(host.mu[name][:, unsel] != 0) and torch.all(host.mu[name][:, sel] == 0)
    merged = torch.where(torch.isin(torch.arange(5), sel)[None], dev.mu[name], host.mu[name])
    s3, _ = step(s2, batches[2])                                      # re-selection
    sel3 = torch.tensor(sel_idx(s3.extra["zenflow"]["selected"][name]))
    unsel3 = [j for j in range(5) if j not in sel3.tolist()]
    assert torch.equal(s3.opt_state[1].mu[name][:, unsel3], merged[:, unsel3])      # frozen, migrated
    assert torch.equal(s3.extra["zenflow"]["host_opt"][1].mu[name], merged)          # no flush at step 3


def test_checkpoint_round_trip_mid_interval_is_bitwise(tmp_path):
    """Save after 3 updates (buffer non-empty, between flushes), load, continue: the
    uninterrupted run's state (params, both optimizer states, buffer, selection) bitwise."""
    batches = regression_batches(6, 8, 5, 3, seed=2)
    torch.manual_seed(0)
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))

    train_step = train_step_for(apply_fn, mse_loss)
    step = compose(zenflow(topk_ratio=0.3, update_interval=2, select_interval=4))(train_step)
    tx = dsfn.optim.adamw(lr=1e-2)
    full = step.init_state(params, tx)
    for b in batches:
        full, _ = step(full, b)
    part = step.init_state(params, tx)
    for b in batches[:3]:
        part, _ = step(part, b)
    assert any(torch.any(v != 0) for v in part.extra["zenflow"]["buffer"].values())
    dsfn.checkpoint.save(tmp_path, part)
    resumed = dsfn.checkpoint.load(tmp_path, like=step.init_state(params, tx))
    assert_trees_equal(resumed, part)
    for b in batches[3:]:
        resumed, _ = step(resumed, b)
    assert_trees_equal(resumed.replace(tx=None), full.replace(tx=None))


@pytest.mark.parametrize("outer", ["data_parallel", "shard_zero0"])
def test_two_ranks_equal_single_process_zenflow(outer):
    """Gradients whole (data parallel / ZeRO-0): 2 ranks equal one process with zenflow."""
    batches = regression_batches(4, 8, 5, 3, seed=3)
    par = (lambda: data_parallel()) if outer == "data_parallel" else (lambda: shard_zero(0))
    assert_matches_reference(lambda: [par(), zenflow(topk_ratio=0.3, update_interval=2)],
                             lambda: make_mlp(SIZES, 0), lambda: dsfn.optim.adamw(lr=1e-2), batches, 2,
                             make_reference_transforms=lambda: [zenflow(topk_ratio=0.3, update_interval=2)],
                             rtol=1e-5, atol=1e-6)


def test_composes_inside_loss_scale_clip_and_offload():
    """zenflow sees unscaled, clipped gradients: with every column selected the stack equals the
    stack without zenflow bitwise; offload('cpu', host_kernel=False) outside changes nothing."""
    tx = lambda: dsfn.optim.adamw(lr=1e-2)
    ref = _train([loss_scale(), clip_grad_norm(0.5)], tx)
    got = _train([loss_scale(), clip_grad_norm(0.5), zenflow(topk_ratio=0.99, update_interval=2)], tx)
    assert got.losses == ref.losses
    assert_trees_equal(got.state.params, ref.state.params)
    plain = _train([zenflow(topk_ratio=0.3, update_interval=2)], tx)
    off = _train([offload("cpu", host_kernel=False), zenflow(topk_ratio=0.3, update_interval=2)], tx)
    assert off.losses == plain.losses
    assert_trees_equal(off.state.params, plain.state.params)


def test_mixed_precision_outside_runs_on_fp32_master():
    res = _train([mixed_precision(torch.bfloat16), zenflow(topk_ratio=0.3, update_interval=2)],
                 lambda: dsfn.optim.adamw(lr=1e-2), n=4)
    assert all(math.isfinite(v) for v in res.losses)
    zs = res.state.extra["zenflow"]
    assert all(b.dtype == torch.float32 for b in zs["buffer"].values())
    assert all(p.dtype == torch.float32 for p in res.state.params.values())   # gathered: the masters


def test_tiny_gpt_converges_comparably_to_adamw():
    """The example's tiny GPT, 40 steps of AdamW vs AdamW + zenflow(0.1, 4): the zenflow loss falls
    well below ln 256 and ends within 0.3 of AdamW's (mean of the last 5 steps)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import corpus

    from dsfn.models import GPT, GPTConfig, gpt_loss
    data = corpus.load_corpus(1_000_000)
    cfg = GPTConfig.preset("tiny")

    def run(transforms):
        apply_fn, params = dsfn.functionalize(GPT(cfg, seed=0))

        def train_step(state, batch):
            loss, grads = dsfn.value_and_grad(
                lambda p, b: gpt_loss(apply_fn(p, b["input_ids"]), b["labels"]))(state.params, batch)
            return state.apply_gradients(grads), {"loss": loss}
        step = compose(*transforms)(train_step)
        state = step.init_state(params, dsfn.optim.adamw(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1))
        it = corpus.batches(data, 16, cfg.seq_len, seed=0)
        losses = []
        for _ in range(40):
            state, m = step(state, next(it))
            losses.append(float(m["loss"]))
        return losses
    ref, zf = run([]), run([zenflow(topk_ratio=0.1, update_interval=4)])
    assert abs(zf[0] - math.log(256)) < 0.3
    ref_end, zf_end = sum(ref[-5:]) / 5, sum(zf[-5:]) / 5
    print(f"final loss (mean of last 5): adamw {ref_end:.3f}, zenflow {zf_end:.3f}")
    assert zf_end < math.log(256) - 1.5
    assert zf_end <= ref_end + 0.3


@pytest.mark.parametrize("kwargs, match", [
    ({"topk_ratio": 0}, "topk_ratio"), ({"topk_ratio": 1.0}, "topk_ratio"), ({"topk_ratio": True}, "topk_ratio"),
    ({"topk_ratio": "0.1"}, "topk_ratio"), ({"update_interval": 0}, "update_interval"),
    ({"update_interval": 2.0}, "update_interval"), ({"update_interval": "auto"}, "update_interval"),
    ({"select_interval": 0}, "select_interval"), ({"update_interval": 4, "select_interval": 6}, "multiple"),
    ({"full_warm_up_rounds": -1}, "full_warm_up_rounds"), ({"topk": 0.1}, "unknown argument"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        zenflow(**kwargs)


@pytest.mark.parametrize("stack, match", [
    (lambda: [shard_zero(1), zenflow()], r"shard_zero\(1\).*shard_zero\(0\) or data_parallel"),
    (lambda: [shard_zero(3), zenflow()], r"needs whole gradients"),
    (lambda: [zenflow(), clip_grad_norm(1.0)], r"innermost.*clip_grad_norm sits inside"),
    (lambda: [zenflow(), loss_scale()], r"loss_scale sits inside"),
    (lambda: [zenflow(), mixed_precision()], r"mixed_precision sits inside"),
    (lambda: [zenflow(), offload("cpu")], r"offload sits inside"),
])
def test_bad_stack(stack, match):
    with pytest.raises(StackError, match=match):
        compose(*stack())


def test_warm_up_rounds_update_everything_then_select():
    """full_warm_up_rounds=2: the first 2 updates are plain SGD on every column; selection starts at
    update 3."""
    w0 = torch.zeros(2, 4)
    g = torch.tensor([[1., 2, 3, 4], [1, 2, 3, 4]])
    step = compose(zenflow(topk_ratio=0.25, update_interval=2, full_warm_up_rounds=2))(grad_step)
    state = make_state(step, w0, dsfn.optim.sgd(lr=1.0))
    for _ in range(2):
        state, _ = step(state, {"gb": torch.zeros(2), "gw": g})
    assert torch.equal(state.params["w"], -2 * g)
    state, _ = step(state, {"gb": torch.zeros(2), "gw": g})
    assert sel_idx(state.extra["zenflow"]["selected"]["w"]) == [3]
    assert torch.equal(state.params["w"], -2 * g - g * torch.tensor([0., 0, 0, 1]))


# ----------------------------------------------------------------------------------------------
# overlap=True: the host update one step behind
# ----------------------------------------------------------------------------------------------

def test_overlap_hand_checked_host_update_lands_one_step_late():
    """The case of test_hand_checked_sgd_three_steps with overlap: at step 1 the flush of
    columns {0,3} is started but not applied (they keep w0's values); step 2 applies it
    before re-selecting, so with gradients that do not depend on w the run rejoins the
    synchronous one exactly."""
    w0 = torch.tensor([[0., 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    g = [torch.tensor([[1., 0, 3, 0], [1, 2, 0, 0], [1, 0, 0, 1]]),
         torch.tensor([[2., 1, 1, 4], [0, 1, 1, 2], [2, 1, 1, 0]]),
         torch.ones(3, 4)]
    step = compose(zenflow(topk_ratio=0.5, update_interval=2, overlap=True))(grad_step)
    state = make_state(step, w0, dsfn.optim.sgd(lr=1.0))
    expected_w = [torch.tensor([[0., 1, -1, 3], [4, 3, 6, 7], [8, 9, 10, 11]]),
                  torch.tensor([[0., 0, -2, 3], [4, 2, 5, 7], [8, 8, 9, 11]]),       # cols 0, 3 pending
                  torch.tensor([[-2.5, -1, -2, 1], [2.5, 1, 5, 6], [5.5, 7, 9, 10.5]])]
    expected_pending = [False, True, False]
    for t in range(3):
        state, _ = step(state, {"gb": torch.tensor([1., 2, 3]) * (t + 1), "gw": g[t]})
        assert torch.equal(state.params["w"], expected_w[t]), (t, state.params["w"])
        pend = state.extra["zenflow"]["pending"]
        assert bool(pend["active"]) == expected_pending[t]
        if expected_pending[t]:
            assert torch.equal(pend["grads"]["w"], (g[0] + g[1]).mul(torch.tensor([1., 0, 0, 1])) / 2)


def _overlap_run(batches, tmp_path=None, resume_at=None):
    import importlib
    Z = importlib.import_module("dsfn.transforms.zenflow")   # the package re-exports the function
    calls = []
    real = Z._host_update

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    Z._host_update = spy
    try:
        torch.manual_seed(0)
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))

        train_step = train_step_for(apply_fn, mse_loss)

        made = []

        def fresh():
            made.append(zenflow(topk_ratio=0.3, update_interval=2, overlap=True))
            return compose(made[-1])(train_step)
        step = fresh()
        tx = dsfn.optim.adamw(lr=1e-2)
        state = step.init_state(params, tx)
        for i, b in enumerate(batches):
            if i == resume_at:          # a new process would start here: new transform, no worker result
                dsfn.checkpoint.save(tmp_path, state)
                step = fresh()
                state = dsfn.checkpoint.load(tmp_path, like=step.init_state(params, tx))
            state, _ = step(state, b)
        for t in made:      # a discarded transform's worker may still be running its job: count it
            if t._pool is not None:
                t._pool.shutdown(wait=True)
        return state, len(calls)
    finally:
        Z._host_update = real


def test_overlap_worker_result_is_used_and_a_resume_recomputes_it_exactly(tmp_path):
    batches = regression_batches(6, 8, 5, 3, seed=2)
    full, calls = _overlap_run(batches)
    assert calls == 3                          # flushes after updates 2, 4, 6: each computed once, behind
    resumed, calls_r = _overlap_run(batches, tmp_path, resume_at=2)   # saved with a flush pending
    assert calls_r == 4                        # the pending one recomputed after the load
    assert_trees_equal(resumed.replace(tx=None), full.replace(tx=None))
    # and it differs from the synchronous schedule (the staleness is real)
    torch.manual_seed(0)
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))

    train_step = train_step_for(apply_fn, mse_loss)
    step = compose(zenflow(topk_ratio=0.3, update_interval=2))(train_step)
    sync = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    for b in batches:
        sync, _ = step(sync, b)
    assert not torch.equal(sync.params["layers.0.weight"], full.params["layers.0.weight"])


def test_overlap_bad_input():
    with pytest.raises(ConfigError, match="overlap"):
        zenflow(overlap="yes")
    w0 = torch.zeros(3, 4)
    sync_step = compose(zenflow(topk_ratio=0.5, update_interval=2))(grad_step)
    state = make_state(sync_step, w0, dsfn.optim.sgd(lr=1.0))
    async_step = compose(zenflow(topk_ratio=0.5, update_interval=2, overlap=True))(grad_step)
    with pytest.raises(ConfigError, match="placed with overlap=False"):
        async_step(state, {"gb": torch.ones(3), "gw": torch.ones(3, 4)})
