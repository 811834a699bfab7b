"""Step.explain: a dry run whose counts equal what a real step does, and that names layouts."""
import torch

import dsfn
from dsfn.runtime import counters, init_mesh
from dsfn.state import FlatShard
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.transforms import shard_zero


def _explain(stage):
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([4, 6, 2], 0))

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(
            lambda p, b: torch.nn.functional.mse_loss(apply_fn(p, b["x"]), b["y"]))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(shard_zero(stage, param_persistence_threshold=0))(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=0.1)))
    batch = regression_batches(1, 4, 4, 2)[0]
    ex = step.explain(state, batch)
    counters.reset()
    step(state, batch)
    real = {k: (v.calls, v.bytes) for k, v in counters.snapshot().items()}
    layouts = {p: l for p, l, *_ in ex.leaves}
    return ex.collectives, real, layouts, str(ex), ex.stack


def test_explain_counts_equal_a_real_step_and_show_layouts():
    for comm, real, layouts, text, notes in run_on_ranks(_explain, 2, 3, timeout=60):
        assert comm == real and ("dp", "all_gather") in comm
        assert isinstance(layouts["params.layers.0.weight"], FlatShard)
        assert "all_gather" in text and "FlatShard" in text and "size 2" in notes[0]


def test_explain_says_zero_is_identity_on_a_single_rank():
    comm, real, layouts, text, notes = _explain(2)
    assert comm == {} and "identity" in notes[0]


def test_explain_lists_each_primitives_handlers_outermost_first():
    """The order `bind` runs handlers in, per primitive: the stack's order, a transform without
    a handler passed over; "micro_batch" is handled by ZeRO (its rounds), not by the others."""
    from dsfn.transforms import accumulate, clip_grad_norm, mixed_precision
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([4, 6, 2], 0))

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(
            lambda p, b: torch.nn.functional.mse_loss(apply_fn(p, b["x"]).float(), b["y"]))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(shard_zero(2), mixed_precision(), clip_grad_norm(1.0), accumulate(2))(train_step)
    ex = step.explain(step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1))),
                      regression_batches(1, 4, 4, 2)[0])
    assert ex.handlers["value_and_grad"] == ["shard_zero", "mixed_precision", "accumulate"]
    assert ex.handlers["apply_gradients"][:2] == ["shard_zero", "mixed_precision"]
    assert "clip_grad_norm" in ex.handlers["apply_gradients"]
    assert ex.handlers["micro_batch"] == ["shard_zero"]
    assert "micro_batch" in str(ex) and "shard_zero -> mixed_precision -> accumulate" in str(ex)
    # the same order as a reversed stack gives reversed (the stack decides, not registration)
    from dsfn.transforms.compose import handler_order
    assert handler_order(list(reversed(step.stack)))["value_and_grad"] == ["accumulate", "mixed_precision",
                                                                            "shard_zero"]
