"""zenflow(topk_ratio, update_interval): the top-k columns (dim 1 of [out, in]) by the L1 norm of
the gradient take the optimizer on the device every step (with moments that restart at each
selection); every gradient accumulates in host memory and the host optimizer applies the
interval's mean to the other columns every update_interval steps. Every optimizer call runs at
the global count (state.step). See dsfn/transforms/zenflow.py for the rule and how it differs
from DeepSpeed's."""
from __future__ import annotations

import functools
import math
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn import tree
from dsfn.errors import ConfigError, StackError
from dsfn.runtime import env
from dsfn.state.layout import FlatShard, MeshCoords, Offloaded, is_placed
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close, assert_trees_equal
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import mse_loss, run_training, train_step_for
from dsfn.transforms import (
    accumulate,
    clip_grad_norm,
    compose,
    data_parallel,
    loss_scale,
    mixed_precision,
    offload,
    shard_zero,
    zenflow,
)
from dsfn.engines.offload import NvmeOffloaded
from dsfn.engines.zenflow import col_l1 as _col_l1, gather_cols as _gather, scatter_cols as _scatter, \
    segments as _segments
from dsfn.transforms.zenflow import ZenFlowState, num_selected, select_columns

SIZES = [5, 7, 3]          # an MLP with matrices 7x5 and 3x7 and biases
ADAMW = lambda: dsfn.optim.adamw(lr=1e-2)     # noqa: E731


def grad_step(state, batch):
    """A train step whose gradients are the batch: the update sees exactly what the test chose."""
    return state.apply_gradients({"b": batch["gb"], "w": batch["gw"]}), {"loss": 0.0}


def make_state(step, w, tx):
    return step.place(dsfn.TrainState.create({"b": torch.zeros(w.shape[0]), "w": w.clone()}, tx))


def sel_idx(mask):
    """The selected column indices of a zenflow selection mask."""
    assert mask.dtype == torch.bool
    return mask.nonzero().flatten().tolist()


W0 = torch.tensor([[0., 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
# L1 column norms 3, 2, 3, 1 (top 2: columns 0, 2); L2 would pick 1, 2 (squared norms 3, 4, 9, 1)
G0 = torch.tensor([[1., 0, -3, 0], [1, -2, 0, 0], [1, 0, 0, 1]])
G1 = torch.tensor([[2., 1, 1, 4], [0, 1, 1, 2], [2, 1, 1, 0]])
G2 = torch.ones(3, 4)                                   # all norms tie: the lower indices 0, 1


def test_hand_checked_sgd_three_steps():
    """W 3x4, SGD lr=1, topk 0.5 (k = floor(2) = 2 columns), update_interval 2 (= select_interval).
    step 0: L1 norms 3,2,3,1 -> columns {0,2} take G0 on the device; the buffer holds G0 (all columns);
    step 1: {0,2} take G1; flush: columns {1,3} take (G0+G1)/2 from the step's input params; buffer 0;
    step 2: all norms tie -> {0,1} take G2; the buffer holds G2.
    The bias (1-D, dense) takes its gradient every step."""
    step = compose(zenflow(topk_ratio=0.5, update_interval=2))(grad_step)
    state = make_state(step, W0, dsfn.optim.sgd(lr=1.0))
    expected_w = [torch.tensor([[-1., 1, 5, 3], [3, 5, 6, 7], [7, 9, 10, 11]]),
                  torch.tensor([[-3., 0.5, 4, 1], [3, 5.5, 5, 6], [5, 8.5, 9, 10.5]]),
                  torch.tensor([[-4., -0.5, 4, 1], [2, 4.5, 5, 6], [4, 7.5, 9, 10.5]])]
    expected_sel = [[0, 2], [0, 2], [0, 1]]
    expected_buf = [G0, torch.zeros(3, 4), G2]
    before = state
    for t, g in enumerate([G0, G1, G2]):
        state, _ = step(state, {"gb": torch.tensor([1., 2, 3]) * (t + 1), "gw": g})
        assert torch.equal(state.params["w"], expected_w[t]), (t, state.params["w"])
        zs = state.extra["zenflow"]
        assert sel_idx(zs["selected"]["w"]) == expected_sel[t]
        assert torch.equal(state.opt_state.buffer["w"], expected_buf[t]), (t, state.opt_state.buffer["w"])
        assert int(zs["step"]) == int(state.step) == t + 1
    assert torch.equal(state.params["b"], torch.tensor([-6., -12, -18]))
    assert torch.equal(before.params["w"], W0)             # the input state was not written


def test_hand_checked_topk_quarter_selects_one_column_lower_index_on_ties():
    """topk 0.25 of 4 columns = 1 column: L1 norms 3,2,3,1 tie between 0 and 2 -> column 0;
    update_interval 1 flushes the others in the same step, so with SGD it is plain SGD."""
    step = compose(zenflow(topk_ratio=0.25, update_interval=1))(grad_step)
    state, _ = step(make_state(step, torch.zeros(3, 4), dsfn.optim.sgd(lr=1.0)), {"gb": torch.ones(3), "gw": G0})
    assert sel_idx(state.extra["zenflow"]["selected"]["w"]) == [0]
    assert torch.equal(state.params["w"], -G0)


def test_num_selected_is_deepspeeds_floor():
    assert [num_selected(0.1, 64), num_selected(0.25, 4), num_selected(0.5, 4), num_selected(0.3, 10),
            num_selected(0.01, 5), num_selected(0.99, 50), num_selected(0.1, 9), num_selected(0.29, 100)] == \
        [6, 1, 2, 3, 0, 49, 0, int(0.29 * 100)]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(1, 4), cols=st.integers(1, 12), ratio=st.floats(0.01, 0.99), data=st.data())
def test_selection_is_top_k_l1_column_norms_lower_index_first(rows, cols, ratio, data):
    """Integer gradients make the L1 norms exact (and ties frequent): the selection equals a
    reference sorted by (-|g|_1, index); only those columns move (no flush yet), and the buffer
    holds the whole gradient."""
    vals = data.draw(st.lists(st.integers(-3, 3), min_size=rows * cols, max_size=rows * cols))
    gw = torch.tensor(vals, dtype=torch.float32).reshape(rows, cols)
    l1 = [sum(abs(vals[r * cols + j]) for r in range(rows)) for j in range(cols)]
    k = int(ratio * cols)
    ref = sorted(sorted(range(cols), key=lambda j: (-l1[j], j))[:k])
    step = compose(zenflow(topk_ratio=ratio, update_interval=2))(grad_step)
    w0 = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    state, _ = step(make_state(step, w0, dsfn.optim.sgd(lr=1.0)), {"gb": torch.zeros(rows), "gw": gw})
    assert sel_idx(state.extra["zenflow"]["selected"]["w"]) == ref == select_columns(gw, k).tolist()
    expected = w0.clone()
    expected[:, ref] -= gw[:, ref]
    assert torch.equal(state.params["w"], expected)
    assert torch.equal(state.opt_state.buffer["w"], gw)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows=st.integers(1, 5), cols=st.integers(1, 7), world=st.integers(1, 4), data=st.data())
def test_flat_shard_pieces_see_exactly_their_columns(rows, cols, world, data):
    """ZeRO's FlatShard pieces cut rows anywhere: over every rank, the pieces' partial column
    sums add up to the column L1 norms, their gathered selected elements to full[:, sel], and a
    scatter writes exactly the piece's selected elements (padding untouched)."""
    sel = sorted(data.draw(st.sets(st.integers(0, cols - 1), max_size=cols)))
    full = torch.arange(1, rows * cols + 1, dtype=torch.float32).reshape(rows, cols) * (-1) ** torch.arange(cols)
    layout = FlatShard("dp", (rows, cols))
    total = torch.zeros(rows, len(sel))
    norms = torch.zeros(cols, dtype=torch.float64)
    marked = full.clone()
    marked[:, sel] = -100.0
    for r in range(world):
        mesh = MeshCoords.of({"dp": world}, {"dp": r})
        piece = layout.shard(full, mesh)
        segs = _segments(layout.runs(mesh), cols)
        part = torch.zeros(rows, len(sel))
        _gather(piece, segs, sel, part)
        total += part
        for c0, c1, s in _col_l1(piece, segs):
            norms[c0:c1] += s
        written = piece.clone()
        _scatter(written, segs, sel, torch.full((rows, len(sel)), -100.0))
        assert torch.equal(written, layout.shard(marked, mesh)), r
    assert torch.equal(total, full[:, sel])
    assert torch.equal(norms, full.abs().sum(0, dtype=torch.float64))


def _torch_adamw(p, g, step_before, lr=0.1, wd=0.1):
    """torch.optim.AdamW from zero moments, as if `step_before` steps had been taken."""
    p = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd)
    opt.state[p] = {"step": torch.tensor(float(step_before)), "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p)}
    p.grad = g.clone()
    opt.step()
    return p.detach()


def test_adamw_device_moments_restart_and_every_call_runs_at_the_global_count():
    """AdamW, W 3x4, topk 0.5, update_interval 2. Step 0 (c=0, selection {0,2}): the device
    moments are fresh: the selected columns take torch's AdamW step 1. Step 1 (c=1, flush): the
    host step is AdamW step 2 (count = c, DeepSpeed's step_id) from zero host moments with the
    mean gradient, in the unselected columns; the host moments move in every column. Step 2
    (c=2, re-selection {1,3}): the device moments restart from zero but the count goes on: the
    selected columns take AdamW step 3 from zero moments."""
    tx = dsfn.optim.adamw(lr=0.1, weight_decay=0.1)
    step = compose(zenflow(topk_ratio=0.5, update_interval=2, host_kernel=False))(grad_step)
    state = make_state(step, W0, tx)
    lerp0 = lambda g: torch.lerp(torch.zeros_like(g), g, 1.0 - 0.9)     # noqa: E731  one moment update from 0
    g2 = torch.tensor([[0., 5, 0, 1]] * 3)                                 # L1 0, 15, 0, 3: columns {1, 3}

    s1, _ = step(state, {"gb": torch.zeros(3), "gw": G0})
    cols, host = s1.extra["zenflow"]["cols"][1], s1.opt_state.host[1]
    assert torch.equal(cols.mu["w"], lerp0(G0[:, [0, 2]])) and int(cols.count) == 1
    assert int(host.count) == 0 and torch.all(host.mu["w"] == 0)
    assert int(s1.opt_state.dense[1].count) == 1
    assert torch.equal(s1.params["w"][:, [0, 2]], _torch_adamw(W0[:, [0, 2]], G0[:, [0, 2]], 0))
    assert torch.equal(s1.params["w"][:, [1, 3]], W0[:, [1, 3]])

    s2, _ = step(s1, {"gb": torch.zeros(3), "gw": G1})
    host = s2.opt_state.host[1]
    mean = (G0 + G1) / 2
    assert int(host.count) == 2 and torch.equal(host.mu["w"], lerp0(mean))
    assert torch.equal(s2.params["w"][:, [1, 3]], _torch_adamw(s1.params["w"], mean, 1)[:, [1, 3]])
    assert int(s2.extra["zenflow"]["cols"][1].count) == 2
    assert torch.all(s2.opt_state.buffer["w"] == 0)

    s3, _ = step(s2, {"gb": torch.zeros(3), "gw": g2})
    cols = s3.extra["zenflow"]["cols"][1]
    assert sel_idx(s3.extra["zenflow"]["selected"]["w"]) == [1, 3]
    assert torch.equal(cols.mu["w"], lerp0(g2[:, [1, 3]])) and int(cols.count) == 3
    assert torch.equal(s3.params["w"][:, [1, 3]], _torch_adamw(s2.params["w"][:, [1, 3]], g2[:, [1, 3]], 2))
    assert torch.equal(s3.params["w"][:, [0, 2]], s2.params["w"][:, [0, 2]])


def test_warm_up_rounds_update_everything_then_select():
    """full_warm_up_rounds=2: the first 2 updates are plain SGD on every column (on the host state);
    selection starts at update 3 (L1 norms 2,4,6,8 -> column 3)."""
    g = torch.tensor([[1., 2, 3, 4], [1, 2, 3, 4]])
    step = compose(zenflow(topk_ratio=0.25, update_interval=2, full_warm_up_rounds=2))(grad_step)
    state = make_state(step, torch.zeros(2, 4), dsfn.optim.sgd(lr=1.0))
    for _ in range(2):
        state, _ = step(state, {"gb": torch.zeros(2), "gw": g})
    assert torch.equal(state.params["w"], -2 * g)
    assert not state.extra["zenflow"]["selected"]["w"].any()
    state, _ = step(state, {"gb": torch.zeros(2), "gw": g})
    assert sel_idx(state.extra["zenflow"]["selected"]["w"]) == [3]
    assert torch.equal(state.params["w"], -2 * g - g * torch.tensor([0., 0, 0, 1]))
    assert torch.equal(state.opt_state.buffer["w"], g)


def _train(transforms, tx=ADAMW, n=6, seed=1, model=lambda: make_mlp(SIZES, 0)):
    return run_training(model, tx, regression_batches(n, 8, 5, 3, seed=seed), transforms)


def test_limits_are_the_plain_optimizer_bitwise():
    """Warm-up covering the run, and k = 0 for every matrix (topk 0.1 of 5 and 7 columns) with
    update_interval 1, are AdamW bitwise (elementwise tx, torch arithmetic on the host); a real
    selection differs."""
    ref = _train([])
    for zf in (zenflow(topk_ratio=0.3, update_interval=3, full_warm_up_rounds=6, host_kernel=False),
               zenflow(topk_ratio=0.1, update_interval=1, host_kernel=False)):
        got = _train([zf])
        assert got.losses == ref.losses
        assert_trees_equal(got.state.params, ref.state.params)
    other = _train([zenflow(topk_ratio=0.3, update_interval=3, host_kernel=False)])
    assert not torch.equal(other.state.params["layers.0.weight"], ref.state.params["layers.0.weight"])


def test_host_kernel_matches_torch_arithmetic_up_to_rounding():
    """The fused C++ host AdamW (the default; params within an ulp per step) vs torch's arithmetic:
    the same selection, params equal up to rounding after 6 steps."""
    a = _train([zenflow(topk_ratio=0.3, update_interval=2)])
    b = _train([zenflow(topk_ratio=0.3, update_interval=2, host_kernel=False)])
    assert_trees_equal(a.state.extra["zenflow"]["selected"], b.state.extra["zenflow"]["selected"])
    assert_trees_close(a.state.params, b.state.params, rtol=1e-5, atol=1e-6)


def test_state_placement_host_parts_in_host_memory_device_holds_only_selected_columns():
    """Without offload: the buffer and the host optimizer state are host tensors; the device-side
    zenflow state is the [rows, k] moments of the selected columns (2 * k * rows per matrix for
    AdamW), on env.device(); the dense state holds only the non-matrix parameters."""
    res = _train([zenflow(topk_ratio=0.3, update_interval=2)], n=3)
    zs, opt = res.state.extra["zenflow"], res.state.opt_state
    assert isinstance(opt, ZenFlowState)
    host_leaves = tree.leaves(opt.host[1].mu) + tree.leaves(opt.host[1].nu) + tree.leaves(opt.buffer)
    assert host_leaves and all(x.device.type == "cpu" for x in host_leaves)
    shapes = {"layers.0.weight": (7, 5), "layers.1.weight": (3, 7)}
    assert {n: tuple(x.shape) for n, x in opt.buffer.items()} == shapes
    k = {n: int(0.3 * s[1]) for n, s in shapes.items()}                   # 1 and 2 columns
    cols = zs["cols"][1]
    assert {n: tuple(x.shape) for n, x in cols.mu.items()} == {n: (s[0], k[n]) for n, s in shapes.items()}
    assert all(x.device == env.device() for x in tree.leaves(cols.mu) + tree.leaves(cols.nu))
    device_elems = sum(x.numel() for x in tree.leaves(cols.mu) + tree.leaves(cols.nu))
    assert device_elems == 2 * (7 * 1 + 3 * 2)
    assert set(opt.dense[1].mu) == {"layers.0.bias", "layers.1.bias"}


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_offload_moves_the_host_state_and_changes_nothing(where, tmp_path):
    """offload outside zenflow: the host state, buffer and dense state are offloaded leaves (host
    tensors / files), the selected-column state stays on the device, [rows, k]; the numbers are
    those without offload, bitwise (torch arithmetic everywhere)."""
    kw = {"path": tmp_path} if where == "nvme" else {}
    make = lambda: [offload(where, host_kernel=False, **kw), zenflow(topk_ratio=0.3, update_interval=2,  # noqa: E731
                                                                      host_kernel=False)]
    plain = _train([zenflow(topk_ratio=0.3, update_interval=2, host_kernel=False)], n=5)
    torch.manual_seed(0)
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = compose(*make())(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, ADAMW()))
    losses = []
    for b in regression_batches(5, 8, 5, 3, seed=1):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        opt = state.opt_state
        offl = [x for x in tree.leaves(opt, is_leaf=is_placed) if is_placed(x)]
        want = NvmeOffloaded if where == "nvme" else Offloaded
        assert offl and all(isinstance(x.layout, want) and x.data.device.type == "cpu" for x in offl)
        assert len(offl) == 2 * 2 + 2 + 2 * 2              # host mu/nu, buffer (2 matrices); dense mu/nu (2 biases)
        cols = state.extra["zenflow"]["cols"][1]
        assert all(isinstance(x, torch.Tensor) and x.device == env.device()
                   for x in tree.leaves(cols.mu, is_leaf=is_placed))
        assert {n: tuple(x.shape) for n, x in cols.mu.items()} == {"layers.0.weight": (7, 1),
                                                                  "layers.1.weight": (3, 2)}
    assert losses == plain.losses
    assert_trees_equal(step.gather(state).params, plain.state.params)


_ZB = regression_batches(4, 8, 5, 3, seed=3)


def _zero_rank_run(outer, overlap=False):
    """Train the MLP with `outer() + [zenflow]`; the final logical state (no tx) and the losses."""
    res = run_training(lambda: make_mlp(SIZES, 0), ADAMW, _ZB,
                       list(outer()) + [zenflow(topk_ratio=0.3, update_interval=2, host_kernel=False,
                                                overlap=overlap)])
    return res.losses, res.state.replace(tx=None)


@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_under_zero_equals_overlap_under_data_parallel(stage):
    """overlap=True (the host flush one step behind) under ZeRO on 2 ranks is bitwise the same
    schedule under data_parallel: the worker sees each rank's piece of the same mean gradient."""
    dp = run_on_ranks(_zero_rank_run, 2, lambda: [data_parallel()], True, timeout=120)
    got = run_on_ranks(_zero_rank_run, 2, lambda: [shard_zero(stage)], True, timeout=120)
    for r, ((losses, state), (dlosses, dstate)) in enumerate(zip(got, dp)):
        assert losses == dlosses, r
        assert_trees_equal(state.params, dstate.params, msg=f"rank {r}")
        assert_trees_equal(state.opt_state, dstate.opt_state, msg=f"rank {r}")


@functools.lru_cache(maxsize=None)
def _zero_references():
    single = _zero_rank_run(lambda: [])
    dp = run_on_ranks(_zero_rank_run, 2, lambda: [data_parallel()], timeout=120)
    return single, dp


@pytest.mark.parametrize("stack", ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload_params"])
def test_zero_on_two_ranks_equals_zenflow_without_zero(stack):
    """ZeRO 1/2/3 (and offload under ZeRO) on 2 ranks: the selection, params, both optimizer states,
    buffer and device columns equal data-parallel zenflow on 2 ranks bitwise (the same reduced
    gradients; each rank's piece contributes its elements), and zenflow on 1 process up to the
    rounding of the gradient mean: the same selection, params within rtol 1e-6."""
    outer = {"zero1": lambda: [shard_zero(1)], "zero2": lambda: [shard_zero(2)],
             "zero3": lambda: [shard_zero(3)],
             "zero2_offload": lambda: [shard_zero(2), offload("cpu", host_kernel=False)],
             "zero3_offload_params": lambda: [shard_zero(3), offload("cpu", params=True, host_kernel=False)]}[stack]
    (single_losses, single), dp = _zero_references()
    got = run_on_ranks(_zero_rank_run, 2, outer, timeout=120)
    for r, (losses, state) in enumerate(got):
        assert losses == dp[r][0], r
        assert_trees_equal(state.params, dp[r][1].params, msg=f"rank {r}")
        assert_trees_equal(state.opt_state, dp[r][1].opt_state, msg=f"rank {r}")
        assert_trees_equal(state.extra["zenflow"], dp[r][1].extra["zenflow"], msg=f"rank {r}")
        assert_trees_equal(state.extra["zenflow"]["selected"], single.extra["zenflow"]["selected"])
        assert_trees_close(state.params, single.params, rtol=1e-6, atol=1e-7, msg=f"rank {r} vs 1 process")
        assert torch.allclose(torch.tensor(losses), torch.tensor(single_losses), rtol=1e-6, atol=0)


def test_composes_with_accumulate_clip_loss_scale_and_mixed_precision():
    """zenflow updates with the gradient the stack hands it: under accumulate(2) it is the mean of
    the micro-batches (the same selection, params up to summation rounding); clip_grad_norm and
    loss_scale act before it (with warm-up covering the run the stack equals the stack without
    zenflow bitwise); under mixed_precision it updates the fp32 masters (fp32 host buffer and
    device columns, bf16 params)."""
    zf = lambda **kw: zenflow(topk_ratio=0.3, update_interval=2, host_kernel=False, **kw)  # noqa: E731
    plain = _train([zf()])
    acc = _train([accumulate(2), zf()])
    assert_trees_equal(acc.state.extra["zenflow"]["selected"], plain.state.extra["zenflow"]["selected"])
    assert_trees_close(acc.state.params, plain.state.params, rtol=1e-5, atol=1e-6)

    ref = _train([loss_scale(), clip_grad_norm(0.05)])
    got = _train([loss_scale(), clip_grad_norm(0.05), zf(full_warm_up_rounds=6)])
    assert got.losses == ref.losses
    assert_trees_equal(got.state.params, ref.state.params)
    clipped = _train([clip_grad_norm(0.05), zf()])
    assert not torch.equal(clipped.state.params["layers.0.weight"], plain.state.params["layers.0.weight"])

    torch.manual_seed(0)
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = compose(mixed_precision(torch.bfloat16), zf())(train_step_for(apply_fn, mse_loss))
    state = step.init_state(params, ADAMW())
    for b in regression_batches(4, 8, 5, 3, seed=1):
        state, m = step(state, b)
        assert math.isfinite(float(m["loss"]))
    assert all(p.dtype == torch.bfloat16 for p in state.params.values())
    inner = state.opt_state.inner                        # MasterState(master, inner=ZenFlowState)
    assert all(b.dtype == torch.float32 and b.device.type == "cpu" for b in inner.buffer.values())
    assert all(x.dtype == torch.float32 for x in state.extra["zenflow"]["cols"][1].mu.values())
    assert int(state.opt_state.inner.host[1].count) == 4     # flushes at counts 1 and 3: count = c + 1


def test_checkpoint_round_trip_mid_interval_is_bitwise(tmp_path):
    """Save after 3 updates (buffer non-empty, between flushes), load into a fresh state, continue:
    the uninterrupted run's state (params, every optimizer state, buffer, selection) bitwise."""
    batches = regression_batches(6, 8, 5, 3, seed=2)
    torch.manual_seed(0)
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = compose(zenflow(topk_ratio=0.3, update_interval=2, select_interval=4))(train_step_for(apply_fn))
    tx = ADAMW()
    full = step.init_state(params, tx)
    for b in batches:
        full, _ = step(full, b)
    part = step.init_state(params, tx)
    for b in batches[:3]:
        part, _ = step(part, b)
    assert any(torch.any(v != 0) for v in part.opt_state.buffer.values())
    dsfn.checkpoint.save(tmp_path, part)
    resumed = dsfn.checkpoint.load(tmp_path, like=step.init_state(params, tx))
    assert_trees_equal(resumed, part)
    for b in batches[3:]:
        resumed, _ = step(resumed, b)
    assert_trees_equal(resumed.replace(tx=None), full.replace(tx=None))


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
    ({"select_interval": 0}, "select_interval"), ({"select_interval": "auto"}, "select_interval"),
    ({"update_interval": 4, "select_interval": 6}, "multiple"),
    ({"full_warm_up_rounds": -1}, "full_warm_up_rounds"), ({"host_kernel": "yes"}, "host_kernel"),
    ({"topk": 0.1}, "unknown argument"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        zenflow(**kwargs)


@pytest.mark.parametrize("stack, match", [
    (lambda: [zenflow(), clip_grad_norm(1.0)], r"innermost.*clip_grad_norm sits inside"),
    (lambda: [zenflow(), loss_scale()], r"loss_scale sits inside"),
    (lambda: [zenflow(), mixed_precision()], r"mixed_precision sits inside"),
    (lambda: [zenflow(), offload("cpu")], r"offload sits inside"),
    (lambda: [zenflow(), shard_zero(1)], r"shard_zero sits inside"),
])
def test_bad_stack(stack, match):
    with pytest.raises(StackError, match=match):
        compose(*stack())


def test_host_kernel_false_under_an_offload_that_runs_the_kernel_is_a_config_error():
    """Under offload, offload's host_kernel decides how the host update runs: zenflow's
    host_kernel=False there would be accepted and ignored (issue 31), so it is refused; with
    offload(host_kernel=False) the two agree and the stack composes."""
    with pytest.raises(ConfigError, match=r"zenflow\(host_kernel=False\) under offload.*"
                                          r"offload\(\.\.\., host_kernel=False\)"):
        compose(offload("cpu"), zenflow(host_kernel=False))
    compose(offload("cpu", host_kernel=False), zenflow(host_kernel=False))
    compose(offload("cpu", host_kernel=False), zenflow())
    compose(zenflow(host_kernel=False))


def test_the_update_dtype_is_read_from_mixed_precisions_stack_facts():
    """zenflow learns mixed precision's master dtype from the stack facts (no attribute of the
    mixed_precision transform): with bf16 parameters under mixed_precision(bf16) its device
    columns and overlap's pending parameters are in the fp32 master dtype, as the update sees
    them. Control: alone (no mixed precision in the stack) they stay bf16."""
    def dtypes(stack):
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0).to(torch.bfloat16))
        step = compose(*stack)(train_step_for(apply_fn, mse_loss))
        state = step.place(dsfn.TrainState.create(params, ADAMW()))
        zs = getattr(state.opt_state, "inner", state.opt_state)
        cols = [x for x in tree.leaves(state.extra["zenflow"]["cols"]) if isinstance(x, torch.Tensor) and x.dim()]
        return {x.dtype for x in cols} | {_data(x).dtype for x in zs.pending["params"].values()}
    zf = lambda: zenflow(topk_ratio=0.3, update_interval=2, overlap=True)     # noqa: E731
    assert dtypes([mixed_precision(torch.bfloat16), zf()]) == {torch.float32}
    assert dtypes([zf()]) == {torch.bfloat16}


def test_overlap_under_offload_runs_the_host_kernel_with_offloads_cores(monkeypatch):
    """The host update behind (overlap) runs on a worker thread under offload's host-kernel
    setting, read from offload's stack facts (`host_kernel`, `host_cores`). Control: without
    offload the kernel runs with zenflow's own setting (no cores)."""
    from dsfn.ops import cpu_adam
    seen = []
    real = cpu_adam.cpu_adamw_multi_
    monkeypatch.setattr(cpu_adam, "cpu_adamw_multi_", lambda *a, **k: (seen.append(k.get("cores")), real(*a, **k))[1])

    def cores(stack):
        seen.clear()
        apply_fn, params = dsfn.functionalize(make_mlp([16, 32, 32, 4], 0))
        step = compose(*stack)(train_step_for(apply_fn, mse_loss))
        state = step.init_state(params, ADAMW())
        for b in regression_batches(3, 8, 16, 4, seed=1):
            state, _ = step(state, b)
        stack[-1]._pool.shutdown(wait=True)
        return set(seen)
    zf = lambda: zenflow(topk_ratio=0.3, update_interval=1, overlap=True)     # noqa: E731
    assert cores([offload("cpu", cores=0.5), zf()]) == {0.5}
    assert cores([zf()]) == {None}


def test_muon_and_unplaced_states_are_rejected():
    step = compose(zenflow())(grad_step)
    with pytest.raises(ConfigError, match="elementwise optimizer"):
        make_state(step, W0, dsfn.optim.muon(lr=0.02))
    plain = dsfn.TrainState.create({"b": torch.zeros(3), "w": W0.clone()}, dsfn.optim.sgd(lr=1.0))
    with pytest.raises(ConfigError, match="not placed by zenflow"):
        step(plain, {"gb": torch.ones(3), "gw": G0})


# ----------------------------------------------------------------------------------------------
# overlap=True: the host update one step behind
# ----------------------------------------------------------------------------------------------

def test_overlap_hand_checked_host_update_lands_one_step_late():
    """The case of test_hand_checked_sgd_three_steps with overlap: at step 1 the flush of columns
    {1,3} is started but not applied (they keep their step-0 values); step 2 applies it before
    re-selecting, so with gradients that do not depend on w the run rejoins the synchronous one."""
    step = compose(zenflow(topk_ratio=0.5, update_interval=2, overlap=True))(grad_step)
    state = make_state(step, W0, dsfn.optim.sgd(lr=1.0))
    w1 = torch.tensor([[-1., 1, 5, 3], [3, 5, 6, 7], [7, 9, 10, 11]])
    expected_w = [w1,
                  torch.tensor([[-3., 1, 4, 3], [3, 5, 5, 7], [5, 9, 9, 11]]),     # cols 1, 3 pending
                  torch.tensor([[-4., -0.5, 4, 1], [2, 4.5, 5, 6], [4, 7.5, 9, 10.5]])]
    expected_pending = [False, True, False]
    for t, g in enumerate([G0, G1, G2]):
        state, _ = step(state, {"gb": torch.tensor([1., 2, 3]) * (t + 1), "gw": g})
        assert torch.equal(state.params["w"], expected_w[t]), (t, state.params["w"])
        assert bool(state.extra["zenflow"]["pending"]) == expected_pending[t]
        if expected_pending[t]:
            assert torch.equal(state.opt_state.pending["grads"]["w"], (G0 + G1) / 2)
            assert torch.equal(state.opt_state.pending["params"]["w"], w1)


def _overlap_run(batches, tmp_path=None, resume_at=None):
    import importlib
    Z = importlib.import_module("dsfn.engines.zenflow")      # zenflow's machinery: the host update
    calls = []
    real = Z.host_update

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    Z.host_update = spy
    try:
        torch.manual_seed(0)
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
        train_step = train_step_for(apply_fn, mse_loss)
        made = []

        def fresh():
            made.append(zenflow(topk_ratio=0.3, update_interval=2, overlap=True))
            return compose(made[-1])(train_step)
        step = fresh()
        tx = ADAMW()
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
        Z.host_update = real


def test_overlap_worker_result_is_used_and_a_resume_recomputes_it_exactly(tmp_path):
    batches = regression_batches(6, 8, 5, 3, seed=2)
    full, calls = _overlap_run(batches)
    assert calls == 3                          # flushes after updates 2, 4, 6: each computed once, behind
    resumed, calls_r = _overlap_run(batches, tmp_path, resume_at=2)   # saved with a flush pending
    assert calls_r == 4                        # the pending one recomputed after the load
    assert_trees_equal(resumed.replace(tx=None), full.replace(tx=None))
    # and it differs from the synchronous schedule (the staleness is real)
    sync = _train([zenflow(topk_ratio=0.3, update_interval=2)], seed=2)
    assert not torch.equal(sync.state.params["layers.0.weight"], full.params["layers.0.weight"])


def test_overlap_bad_input():
    with pytest.raises(ConfigError, match="overlap"):
        zenflow(overlap="yes")
    sync_step = compose(zenflow(topk_ratio=0.5, update_interval=2))(grad_step)
    state = make_state(sync_step, torch.zeros(3, 4), dsfn.optim.sgd(lr=1.0))
    async_step = compose(zenflow(topk_ratio=0.5, update_interval=2, overlap=True))(grad_step)
    with pytest.raises(ConfigError, match="placed with overlap=False"):
        async_step(state, {"gb": torch.ones(3), "gw": torch.ones(3, 4)})


@pytest.mark.parametrize("overlap", [False, True])
def test_a_whole_gradient_value_inside_the_optimizer_is_refused(overlap):
    """zenflow hands the optimizer parts of each matrix in separate calls; a clip in the chain
    would clip each part by its own norm. It raises (on the host thread too, with overlap),
    while the stack's clip_grad_norm keeps working."""
    tx = lambda: dsfn.optim.chain(dsfn.optim.clip_by_global_norm(0.1), ADAMW())   # noqa: E731
    batches = regression_batches(6, 8, SIZES[0], SIZES[-1])
    with pytest.raises(StackError, match="clip_grad_norm"):
        run_training(lambda: make_mlp(SIZES, 0), tx, batches,
                     (zenflow(topk_ratio=0.5, update_interval=2, full_warm_up_rounds=0, overlap=overlap),))
    res = run_training(lambda: make_mlp(SIZES, 0), ADAMW, batches,
                       (clip_grad_norm(0.1), zenflow(topk_ratio=0.5, update_interval=2, full_warm_up_rounds=0,
                                                     overlap=overlap)))
    assert all(math.isfinite(x) for x in res.losses)


# ----------------------------------------------------------------------------------------------
# the host's share of a step (issue 24): the host optimizer runs once per update_interval
# ----------------------------------------------------------------------------------------------

def _host_adam_elements(update_interval: int, steps: int, under_offload: bool) -> tuple[int, int, int]:
    """(host-path updates, matrix elements they updated, elements every host AdamW call
    updated) over `steps` steps of zenflow on the MLP."""
    import dsfn.ops.cpu_adam as CA
    ZF = sys.modules["dsfn.engines.zenflow"]         # zenflow's machinery: the host update
    calls = [0, 0, 0]
    real, real_host = CA.cpu_adamw_multi_, ZF.host_update

    here = threading.get_ident()

    def counted(params, *a, **k):
        # only this test's calls: an earlier test's overlap worker may still be finishing a job
        if threading.get_ident() == here:
            calls[2] += sum(p.numel() for p in params)
        return real(params, *a, **k)

    def host_update(tx, grads, *a, **k):
        calls[0] += 1
        calls[1] += sum(_data(g).numel() for g in grads.values())
        return real_host(tx, grads, *a, **k)
    CA.cpu_adamw_multi_, ZF.host_update = counted, host_update
    try:
        apply_fn, params = dsfn.functionalize(make_mlp([16, 32, 32, 4], 0))
        stack = ([offload("cpu")] if under_offload else []) + \
            [zenflow(topk_ratio=0.1, update_interval=update_interval, full_warm_up_rounds=0)]
        step = compose(*stack)(train_step_for(apply_fn, mse_loss))
        state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
        for b in regression_batches(steps, 4, 16, 4, seed=0):
            state, _ = step(state, b)
    finally:
        CA.cpu_adamw_multi_, ZF.host_update = real, real_host
    return tuple(calls)


def _data(x):
    return x.data if hasattr(x, "layout") else x


@pytest.mark.parametrize("under_offload", [False, True])
def test_host_update_work_per_step_falls_by_update_interval(under_offload):
    """ZenFlow as published: the unselected columns update on the host every update_interval
    steps (the device path updates the top-k columns each step), so the host path's work per
    step falls by update_interval. Control: update_interval=1 runs it every step. Under
    offload the host also runs the dense parameters' and (on a CPU-only machine) the
    selected columns' update every step: the total falls by less."""
    steps = 8
    calls1, elems1, all1 = _host_adam_elements(1, steps, under_offload)
    calls4, elems4, all4 = _host_adam_elements(4, steps, under_offload)
    assert calls1 == steps and elems1 > 0
    assert calls4 == steps // 4 and elems4 * 4 == elems1        # a flush every 4th step: 2 of 8
    if under_offload:
        assert all4 < all1 / 2
    else:
        assert all4 * 4 == all1          # outside offload the host kernel runs the host path only
