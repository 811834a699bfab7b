"""Parameter groups (`partition`, `masked`, `by_ndim`, `by_name`) under every stack.

The README's no-decay recipe is decided on logical paths and shapes, once at init, so it
picks the same leaves when the optimizer runs on ZeRO shards, tp slices or offloaded
copies. Tolerances: fp32 rtol 1e-5 with SGD-momentum (state compared); AdamW groups are
compared with torch.optim.AdamW's param groups on one process (rtol 1e-6) and on losses
under a stack. Negative control: labels decided on the pieces (what the optimizer saw
before) pick other groups and do not match.
"""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

import dsfn
from dsfn import logical
from dsfn.runtime import init_mesh
from dsfn.state.layout import is_placed
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import assert_matches_reference, run_training, train_step_for
from dsfn.transforms import mixed_precision, offload, shard_zero, tensor_parallel

SIZES = [6, 10, 3]
BATCHES = regression_batches(3, 8, SIZES[0], SIZES[-1], seed=3)


def make_model():
    return make_mlp(SIZES, seed=1)


def no_decay(path: str, x: torch.Tensor) -> str:
    return "decay" if x.dim() >= 2 else "no_decay"


def grouped_sgd():
    return dsfn.optim.partition({"decay": dsfn.optim.sgd(0.3, momentum=0.9, weight_decay=0.5),
                                 "no_decay": dsfn.optim.sgd(0.3, momentum=0.9)}, no_decay)


def grouped_adamw():
    return dsfn.optim.partition({"decay": dsfn.optim.adamw(0.05, weight_decay=0.5),
                                 "no_decay": dsfn.optim.adamw(0.05, weight_decay=0.0)}, no_decay)


def masked_decay_sgd():
    """Decay only on matrices, inside a chain (optax's `masked(..., others="pass")`)."""
    return dsfn.optim.chain(dsfn.optim.masked(dsfn.optim.add_decayed_weights(0.5), dsfn.optim.by_ndim(2),
                                              others="pass"),
                            dsfn.optim.trace(0.9), dsfn.optim.scale_by_learning_rate(0.3))


def test_no_decay_partition_equals_torch_adamw_param_groups():
    model = make_model()
    ref = make_model()
    decay = [p for n, p in ref.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in ref.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}], lr=0.05)
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose()(train_step_for(apply_fn))
    state = step.place(dsfn.TrainState.create(params, grouped_adamw()))
    for b in BATCHES:
        state, _ = step(state, b)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(b["x"]), b["y"]).backward()
        opt.step()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state.params[n], p.detach(), rtol=1e-6, atol=1e-7)


STACKS = {
    "zero1": lambda: [shard_zero(1)],
    "zero2": lambda: [shard_zero(2)],
    "zero3": lambda: [shard_zero(3)],
    "zero3+cpu": lambda: [shard_zero(3), offload("cpu")],
    "zero2+cpu overlap": lambda: [shard_zero(2), offload("cpu", overlap=True)],
    "zero3+nvme": lambda: [shard_zero(3), offload("nvme", path=os.environ["DSFN_TEST_NVME"])],
}


@pytest.fixture
def nvme_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSFN_TEST_NVME", str(tmp_path))


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("make_tx", [grouped_sgd, masked_decay_sgd], ids=["partition", "masked"])
def test_groups_under_zero_and_offload_equal_the_reference(stack, make_tx, nvme_dir):
    assert_matches_reference(STACKS[stack], make_model, make_tx, BATCHES, world_size=2)


def test_adamw_groups_under_zero3_offload_match_losses(nvme_dir):
    ref = run_training(make_model, grouped_adamw, BATCHES)
    for losses in run_on_ranks(lambda: run_training(make_model, grouped_adamw, BATCHES, tuple(STACKS["zero3+cpu"]()))
                               .losses, 2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-6)


def test_groups_under_mixed_precision_equal_single_process_mixed_precision():
    assert_matches_reference(lambda: [shard_zero(3), mixed_precision()], make_model, grouped_sgd, BATCHES,
                             world_size=2, make_reference_transforms=lambda: [mixed_precision()],
                             rtol=2e-2, atol=1e-2)


def _init_state_run(make_stack, tp: bool = False):
    def fn():
        if tp:
            init_mesh(tp=2)
        torch.manual_seed(0)
        model = make_model()
        apply_fn, params = dsfn.functionalize(model)
        stack = make_stack(model)
        step = dsfn.compose(*stack)(train_step_for(apply_fn))
        state = step.init_state(params, grouped_sgd())     # the optimizer's init sees this rank's pieces
        for b in BATCHES:
            state, _ = step(state, b)
        full = step.gather(state)
        return full.params, full.opt_state.labels
    return fn


def test_groups_from_init_state_on_pieces_choose_the_logical_groups():
    ref = run_training(make_model, grouped_sgd, BATCHES)
    expected = ref.state.opt_state.labels
    assert set(expected) == {"decay", "no_decay"}
    for stack in ([shard_zero(3)], [shard_zero(1), offload("cpu")]):
        for params, labels in run_on_ranks(_init_state_run(lambda m, s=stack: s), 2):
            assert labels == expected
            assert_trees_close(params, ref.state.params, rtol=1e-5, atol=1e-6)


def test_groups_under_tensor_parallel_equal_the_reference():
    plan = {"layers.0": "colwise", "layers.1": "rowwise"}
    ref = run_training(make_model, grouped_sgd, BATCHES)
    for params, labels in run_on_ranks(_init_state_run(lambda m: [tensor_parallel(plan, model=m)], tp=True), 2):
        assert labels == ref.state.opt_state.labels
        assert_trees_close(params, ref.state.params, rtol=1e-5, atol=1e-6)


def test_negative_control_groups_decided_on_pieces_differ():
    """Switch the logical view off (labels see flat shards: every leaf 1-D, so "no_decay"):
    the run differs from the reference, so the tests above can fail."""
    ref = run_training(make_model, grouped_sgd, BATCHES)

    def fn():
        on_pieces = lambda t: dsfn.tree.map(logical.local, t, is_leaf=is_placed)   # noqa: E731
        with mock.patch.object(logical, "logical_view", on_pieces):
            return _init_state_run(lambda m: [shard_zero(3)])()
    for params, labels in run_on_ranks(fn, 2):
        assert set(labels) == {"no_decay"}
        diff = max(float((params[k] - ref.state.params[k]).abs().max()) for k in params)
        assert diff > 1e-3


def test_checkpoint_of_groups_saved_under_zero3_loads_into_one_process(tmp_path):
    """Save the grouped state from ZeRO-3 on 2 ranks; load it into a plain single-process
    layout: params, per-group momentum and the group labels are the gathered state's."""
    ckpt = str(tmp_path / "ckpt")

    def fn():
        torch.manual_seed(0)
        apply_fn, params = dsfn.functionalize(make_model())
        step = dsfn.compose(shard_zero(3))(train_step_for(apply_fn))
        state = step.place(dsfn.TrainState.create(params, grouped_sgd()))
        for b in BATCHES[:2]:
            state, _ = step(state, b)
        dsfn.checkpoint.save(ckpt, state)
        full = step.gather(state)
        return full.params, full.opt_state.inner
    saved_params, saved_inner = run_on_ranks(fn, 2)[0]
    apply_fn, params = dsfn.functionalize(make_model())
    like = dsfn.TrainState.create(params, grouped_sgd())
    loaded = dsfn.checkpoint.load(ckpt, like=like)
    assert_trees_close(loaded.params, saved_params, rtol=0, atol=0)
    assert_trees_close(loaded.opt_state.inner, saved_inner, rtol=0, atol=0)
    assert loaded.opt_state.labels == like.opt_state.labels
    # and it trains on: one more step equals the uninterrupted reference's third step
    ref = run_training(make_model, grouped_sgd, BATCHES)
    step = dsfn.compose()(train_step_for(apply_fn))
    state, _ = step(loaded, BATCHES[2])
    assert_trees_close(state.params, ref.state.params, rtol=1e-5, atol=1e-6)


def test_groups_under_zenflow_and_zero2_equal_single_process_zenflow():
    """zenflow hands the optimizer column selections and host matrices in separate calls; the
    groups are decided on each call's logical shapes (a selected-columns compact is still a
    matrix: "decay"), the same on 2 ZeRO-2 ranks as on one process (AdamW: losses)."""
    from dsfn.transforms import zenflow
    zf = lambda: zenflow(topk_ratio=0.5, update_interval=2, full_warm_up_rounds=0)   # noqa: E731
    batches = regression_batches(6, 8, SIZES[0], SIZES[-1], seed=4)
    ref = run_training(make_model, grouped_adamw, batches, (zf(),))
    for losses in run_on_ranks(lambda: run_training(make_model, grouped_adamw, batches, (shard_zero(2), zf())).losses,
                               2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-6)
