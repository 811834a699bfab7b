"""A Hugging Face causal LM's own loss (`labels=`) under `accumulate(n)` equals the
single-process loss of the whole batch, also when the micro-batches hold different numbers
of ignored labels: each micro-batch's loss divides by the valid targets of the whole batch
(of the global batch with data parallel / ZeRO / sequence parallel), not its own, so the
gradients ZeRO-2/3 reduce during backward are right as they are.

Equality: SGD-momentum, 3 steps, losses and final state at fp32 rtol 1e-5. Negative control:
with the whole-batch count switched off (each micro-batch's own mean, averaged) the run
differs. Labels the model gets that are no slice of the batch are refused (ConfigError),
and so is a batch captured by a closure (accumulate could not split it).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import hf_labels_loss as loss_labels
from dsfn.testing.reference import hf_shift_labels_loss as loss_shift_labels
from dsfn.testing.reference import run_steps, with_shift_labels
from dsfn.transforms import accumulate, compose, data_parallel, sequence_parallel, shard_zero

pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-6)


def make_batches(steps=3, rows=4, t=12, seed=7):
    """Rows 0-1 (micro-batch 0 at accumulate(2), world 1) hold many ignored labels, rows 2-3
    few: their means weigh differently from the batch's token mean."""
    out = []
    for i in range(steps):
        ids = token_batches(1, rows, t, 101, seed=seed + i)[0]["input_ids"]
        labels = ids.clone()
        labels[0, :7] = -100
        labels[1, 3:9] = -100
        labels[2, -2:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out








LOSSES = {"labels": loss_labels, "shift_labels": loss_shift_labels}


def train(make_transforms, loss="labels", mesh=None, sabotage=False):
    import sys
    acc = sys.modules["dsfn.transforms.accumulate"]       # (the package exports the factory)
    if not sabotage:
        return _train(make_transforms, loss, mesh)
    real = acc.micro_batches
    acc.micro_batches = lambda counts: contextlib.nullcontext(counts)   # each micro-batch its own count
    try:
        return _train(make_transforms, loss, mesh)
    finally:
        acc.micro_batches = real


def _train(make_transforms, loss, mesh):
    if mesh:
        init_mesh(**mesh)
    model = make_tiny_causal_lm("llama")
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        value, grads = dsfn.value_and_grad(lambda p, b: LOSSES[loss](apply_fn, p, b))(state.params, batch)
        return state.apply_gradients(grads), {"loss": value}
    step = compose(*make_transforms())(train_step)
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    batches = make_batches()
    if loss == "shift_labels":
        batches = [with_shift_labels(b) for b in batches]
    return run_steps(step, state, batches)


# name -> (transforms, world, mesh); sequence_parallel is outermost, accumulate anywhere inside
STACKS = {
    "accumulate": (lambda: (accumulate(2),), 1, None),
    "dp2 x accumulate": (lambda: (data_parallel(), accumulate(2)), 2, {"dp": 2}),
    "accumulate x zero2": (lambda: (accumulate(2), shard_zero(2)), 2, {"dp": 2}),
    "zero3 x accumulate": (lambda: (shard_zero(3), accumulate(2)), 2, {"dp": 2}),
    "sp2 x accumulate": (lambda: (sequence_parallel(), accumulate(2)), 2, {"sp": 2}),
}


def _run(stack, loss, sabotage=False):
    make, world, mesh = STACKS[stack]
    if world == 1:
        return [train(make, loss, mesh, sabotage)]
    return run_on_ranks(train, world, make, loss, mesh, sabotage, timeout=180)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_hf_loss_under_accumulate_is_the_whole_batch_token_mean(stack, loss):
    ref_losses, ref_state = train(lambda: (), loss)
    for losses, state in _run(stack, loss):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        assert_trees_close(state, ref_state, **TOL)


@pytest.mark.parametrize("stack", ["accumulate", "zero3 x accumulate", "sp2 x accumulate"])
def test_negative_control_micro_batch_means_differ(stack):
    ref_losses, _ = train(lambda: (), "labels")
    losses, _ = _run(stack, "labels", sabotage=True)[0]
    assert not torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), **TOL), (losses, ref_losses)


def test_labels_that_are_no_slice_of_the_batch_are_refused():
    model = make_tiny_causal_lm("llama")
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss = lambda p, b: apply_fn(p, input_ids=b["input_ids"], labels=b["labels"].clone()).loss   # noqa: E731
        value, grads = dsfn.value_and_grad(loss)(state.params, batch)
        return state.apply_gradients(grads), {"loss": value}
    step = compose(accumulate(2))(train_step)
    state = step.init_state(params, dsfn.optim.sgd(0.5))
    with pytest.raises(ConfigError, match="not a slice of the batch"):
        step(state, make_batches()[0])


def test_a_batch_captured_by_a_closure_is_refused():
    model = make_tiny_causal_lm("llama")
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        value, grads = dsfn.value_and_grad(lambda p: loss_labels(apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads), {"loss": value}
    step = compose(accumulate(2))(train_step)
    state = step.init_state(params, dsfn.optim.sgd(0.5))
    with pytest.raises(ConfigError, match="no batch tensors"):
        step(state, make_batches()[0])
