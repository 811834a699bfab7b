"""A Hugging Face causal LM's own loss (`labels=`) under data parallel and ZeRO equals the
single-process loss of the whole batch, also when the ranks hold different numbers of
ignored labels (padding, prompts): the transform makes HF's loss divide by the whole
batch's count of valid targets (`num_items_in_batch`), not each rank's own.

Equality: SGD-momentum, 3 steps, losses and final state at fp32 rtol 1e-5. Negative
control: without it (each rank's own mean, averaged over dp: DDP's result) the run differs.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import dsfn
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import hf_labels_loss as loss_labels
from dsfn.testing.reference import run_steps
from dsfn.transforms import compose, data_parallel, shard_zero

pytest.importorskip("transformers")


def make_batches(steps=3, rows=4, t=12, seed=7):
    out = []
    for i in range(steps):
        ids = token_batches(1, rows, t, 101, seed=seed + i)[0]["input_ids"]
        labels = ids.clone()
        labels[0, :7] = -100            # rank 0's rows: many ignored labels
        labels[2, -2:] = -100           # rank 1's rows: few
        out.append({"input_ids": ids, "labels": labels})
    return out




def loss_shift_labels(apply_fn, params, batch):
    lab = batch["labels"]
    shifted = torch.cat([lab[:, 1:], lab.new_full((lab.shape[0], 1), -100)], dim=1)
    return apply_fn(params, input_ids=batch["input_ids"], labels=lab, shift_labels=shifted).loss


LOSSES = {"labels": loss_labels, "shift_labels": loss_shift_labels}


def train(make_transforms, loss="labels", mesh=None, sabotage=False):
    if mesh:
        init_mesh(**mesh)
    if sabotage:
        from dsfn.integrations.hf import losses
        losses.token_mean_over = lambda *a, **k: contextlib.nullcontext()
    model = make_tiny_causal_lm("llama")
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        value, grads = dsfn.value_and_grad(lambda p: LOSSES[loss](apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads), {"loss": value}
    step = compose(*make_transforms())(train_step)
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    return run_steps(step, state, make_batches())


STACKS = {"data_parallel": lambda: (data_parallel(),), "zero2": lambda: (shard_zero(2),),
          "zero3": lambda: (shard_zero(3),)}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_hf_loss_under_data_parallel_is_the_whole_batch_token_mean(stack, loss):
    ref_losses, ref_state = train(lambda: (), loss)
    for losses, state in run_on_ranks(train, 2, STACKS[stack], loss, {"dp": 2}, timeout=180):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert_trees_close(state, ref_state, rtol=1e-5, atol=1e-6)


def test_negative_control_each_ranks_own_mean_differs():
    ref_losses, _ = train(lambda: ())
    for losses, _ in run_on_ranks(train, 2, STACKS["data_parallel"], "labels", {"dp": 2}, True, timeout=180):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) > 1e-3, (losses, ref_losses)
