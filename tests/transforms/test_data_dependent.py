"""Data-dependent parameter use: ranks that touch different parameters still equal the reference.

A routed model sends each row to one of two experts by the sign of its first feature and
does not call an expert no row reached (MoE-style). The global batch puts rank 0's rows
on expert 0 and rank 1's rows on expert 1, so on 2 ranks each rank uses a different
subset of the parameters, while the single process uses them all. Gradients must be
reduced over the same set on every rank (an untouched parameter contributes zeros) with
the same sequence of collectives. SGD-momentum, fp32 rtol 1e-5 on losses and the final
logical state. The scenario check (`test_the_ranks_really_use_different_parameters`)
is the control: without it the equality tests could pass on a model that is not
data-dependent at all.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dsfn
from dsfn.testing import run_on_ranks
from dsfn.testing.reference import assert_matches_reference
from dsfn.testing.models import Routed, routed_batches
from dsfn.transforms import accumulate, data_parallel, offload, shard_zero

BATCHES = routed_batches(3, 8)


def make_tx():
    return dsfn.optim.sgd(lr=0.2, momentum=0.9)


STACKS = {
    "data_parallel": lambda: [data_parallel()],
    "zero0": lambda: [shard_zero(0)],
    "zero1": lambda: [shard_zero(1)],
    "zero2": lambda: [shard_zero(2)],
    "zero3": lambda: [shard_zero(3)],
    "zero2+accumulate": lambda: [shard_zero(2), accumulate(2)],
    "zero3+accumulate": lambda: [shard_zero(3), accumulate(2)],
    "zero3+offload": lambda: [shard_zero(3), offload("cpu")],
    "data_parallel+small buckets": lambda: [data_parallel(bucket_mb=1e-4)],
}


@pytest.mark.parametrize("in_list", [False, True], ids=["experts in the root", "experts as units"])
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_ranks_using_different_parameters_equal_the_reference(stack, in_list):
    assert_matches_reference(STACKS[stack], lambda: Routed(in_list, seed=1), make_tx, BATCHES,
                             world_size=2)


def test_the_ranks_really_use_different_parameters():
    """The control: on each rank's half of the batch, plain autograd leaves the other expert
    without a gradient, while the whole batch reaches both."""
    model = Routed(False, seed=1)
    params = dict(model.named_parameters())
    x, y = BATCHES[0]["x"], BATCHES[0]["y"]

    def used(rows):
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        return {n for n, g in zip(params, grads) if g is not None}
    assert used(slice(0, 4)) == {"inp.weight", "inp.bias", "e0.weight", "e0.bias"}
    assert used(slice(4, 8)) == {"inp.weight", "inp.bias", "e1.weight", "e1.bias"}
    assert used(slice(0, 8)) == set(params)


def test_ranks_issue_the_same_collectives():
    """Every rank's counted collectives (axis, op, calls, bytes) are the same, although the
    ranks touch different parameters."""
    from dsfn.runtime import collectives as C

    def fn(stage):
        apply_fn, params = dsfn.functionalize(Routed(True, seed=1))
        from dsfn.testing.reference import train_step_for
        step = dsfn.compose(shard_zero(stage))(train_step_for(apply_fn))
        state = step.place(dsfn.TrainState.create(params, make_tx()))
        before = C.counters.snapshot()
        state, _ = step(state, BATCHES[0])
        after = C.counters.snapshot()
        return {k: (v.calls - before[k].calls if k in before else v.calls,
                    v.bytes - before[k].bytes if k in before else v.bytes) for k, v in after.items()}
    for stage in (2, 3):
        counts = run_on_ranks(fn, 2, stage)
        assert counts[0] == counts[1], f"stage {stage}: {counts}"
