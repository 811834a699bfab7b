"""dsfn.logical: values of the whole for code that runs on pieces (global norms, whole matrices).

The user-written way to clip — `chain(clip_by_global_norm(c), optimizer)` — must clip by
the single-process norm under every sharding stack. Tolerances: fp32 rtol 1e-5 on losses
and the final logical state with SGD-momentum (reduction order differs from the reference
in the last bits; SGD keeps them there). Negative control: the same stack with a
transform that answers `reduce_leaves` locally (each rank's own piece only, what the
optimizer saw before the primitive) must NOT match.
"""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn import logical
from dsfn.errors import LayoutError
from dsfn.runtime import init_mesh
from dsfn.state.layout import FlatShard, Placed
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import assert_matches_reference, run_training
from dsfn.transforms import offload, shard_zero, tensor_parallel
from dsfn.transforms.core import Transform

SIZES = [6, 10, 3]
BATCHES = regression_batches(3, 8, SIZES[0], SIZES[-1], seed=3)


def make_model():
    return make_mlp(SIZES, seed=1)


def clipped_sgd():
    # max_norm far below the gradients' norm: clipping is active at every step
    return dsfn.optim.chain(dsfn.optim.clip_by_global_norm(0.05), dsfn.optim.sgd(lr=0.3, momentum=0.9))


def clipped_adamw():
    return dsfn.optim.chain(dsfn.optim.clip_by_global_norm(0.05), dsfn.optim.adamw(lr=0.05))


class LocalOnly(Transform):
    """Test-only: answers `reduce_leaves` with each rank's own partials (the defect)."""
    name = "local_only"

    def handle_reduce_leaves(self, call_next, partials, pending, op):
        return call_next(partials, [() for _ in pending], op)


TP_PLAN = {"layers.0": "colwise", "layers.1": "rowwise"}


def _stack(kind: str, local: bool = False):
    def make():
        if kind == "zero3+offload":
            s = [shard_zero(3), offload("cpu")]
        else:
            s = [shard_zero(int(kind[-1]))]
        return ([LocalOnly()] if local else []) + s
    return make


def _tp_run(local: bool):
    def fn():
        init_mesh(tp=2)
        res = run_training(make_model, clipped_sgd, BATCHES, lambda model: ([LocalOnly()] if local else [])
                           + [tensor_parallel(TP_PLAN, model=model)])
        return res.losses, res.state.params
    return fn


@pytest.mark.parametrize("kind", ["zero1", "zero2", "zero3", "zero3+offload"])
def test_clip_in_the_optimizer_chain_under_zero_equals_the_reference(kind):
    assert_matches_reference(_stack(kind), make_model, clipped_sgd, BATCHES, world_size=2)


def test_clip_in_the_chain_under_zero3_with_adamw_matches_losses():
    # AdamW: losses compared (state would amplify reduction-order bits near eps)
    ref = run_training(make_model, clipped_adamw, BATCHES)
    res = run_on_ranks(lambda: run_training(make_model, clipped_adamw, BATCHES, (shard_zero(3),)).losses, 2)
    for losses in res:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-6)


def test_clip_in_the_chain_under_tensor_parallel_equals_the_reference():
    ref = run_training(make_model, clipped_sgd, BATCHES)
    for losses, params in run_on_ranks(_tp_run(False), 2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-6)
        assert_trees_close(params, ref.state.params, rtol=1e-5, atol=1e-6)


def test_negative_control_local_norms_do_not_match():
    """The primitive switched off (each rank clips by its own piece's norm) is visibly wrong,
    so the equality tests above can fail."""
    ref = run_training(make_model, clipped_sgd, BATCHES)
    for kind in ("zero3",):
        res = run_on_ranks(lambda: run_training(make_model, clipped_sgd, BATCHES, tuple(_stack(kind, True)()))
                           .state.params, 2)
        diff = max(float((a - b).abs().max()) for a, b in zip(dsfn.tree.leaves(res[0]),
                                                                dsfn.tree.leaves(ref.state.params)))
        assert diff > 1e-4, f"{kind}: local clipping should differ from the reference, max diff {diff}"
    for losses, params in run_on_ranks(_tp_run(True), 2):
        diff = max(float((a - b).abs().max()) for a, b in zip(dsfn.tree.leaves(params),
                                                                dsfn.tree.leaves(ref.state.params)))
        assert diff > 1e-4, f"tp: local clipping should differ from the reference, max diff {diff}"


def test_global_norm_of_pieces_outside_their_step_is_a_layout_error():
    piece = Placed(torch.ones(3), FlatShard("dp", (6,)))
    with pytest.raises(LayoutError, match="no transform of the running stack owns"):
        dsfn.optim.global_norm({"w": piece})
    with pytest.raises(LayoutError, match="no transform of the running stack can assemble"):
        logical.map_whole(lambda i, w: w, [piece])


def test_reduce_leaves_outside_a_step_is_local_for_whole_tensors():
    xs = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0]])]
    assert logical.reduce_leaves([x.square().sum() for x in xs], xs) == [torch.tensor(25.0), torch.tensor(1.0)]
    torch.testing.assert_close(dsfn.optim.global_norm(xs), torch.tensor(26.0).sqrt())


def test_reduce_leaves_counts_each_element_once_over_every_axis():
    """Max and sum of pieces split over dp (ZeRO shards) on 2 and 4 ranks equal the whole's."""
    full = [torch.arange(7.0) - 3, torch.arange(12.0).reshape(3, 4), torch.tensor(2.5)]

    def fn():
        step = dsfn.compose(shard_zero(3))(lambda s, b: (s, {}))
        state = step.place(dsfn.TrainState.create({f"p{i}": x for i, x in enumerate(full)}, dsfn.optim.sgd(0.1)))
        from dsfn.effects import activate
        with activate(step.stack):
            pieces = logical.leaves(state.params)
            sums = logical.reduce_leaves([logical.local(x).square().sum() for x in pieces], pieces)
            maxes = logical.reduce_leaves([logical.local(x).abs().max() for x in pieces], pieces, "max")
        return [float(s) for s in sums], [float(m) for m in maxes]
    for world in (2, 4):
        for sums, maxes in run_on_ranks(fn, world):
            assert sums == [float(x.square().sum()) for x in full]
            assert maxes == [float(x.abs().max()) for x in full]
