"""`compile_units`: torch.compile of each repeated block inside a dsfn step (torchtitan's
per-block compile), composing with the transforms around it.

The default tests trace with `backend="eager"` (dynamo captures each block's forward and
runs the captured graph without changing any arithmetic), so the compiled step equals the
eager one bitwise and the composition (functional parameters swapped in each step, ZeRO-3's
gathers in hooks around the block, data parallel at 2 ranks) is what is tested, in seconds.
The slow test compiles with inductor and compares at rtol 1e-5.
"""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_llama, token_batches
from dsfn.testing.reference import assert_matches_reference, run_steps
from dsfn.transforms import compile_units, data_parallel, shard_zero

pytest.importorskip("transformers")
BATCHES = token_batches(3, 4, 16, 128)


def hf_loss(apply_fn, params, batch):
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss


def _run(transforms, tx=lambda: dsfn.optim.adamw(lr=1e-2)):
    model = make_tiny_llama()
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, b):
        loss, grads = dsfn.value_and_grad(lambda p, bb: hf_loss(apply_fn, p, bb))(state.params, b)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(*transforms)(train_step)
    state = step.place(dsfn.TrainState.create(params, tx=tx()))
    losses, final = run_steps(step, state, BATCHES)
    return model, losses, final


def test_blocks_are_compiled_and_the_step_equals_eager():
    from torch._dynamo.utils import counters
    _, ref_losses, ref = _run([data_parallel()])
    cu = compile_units(backend="eager")
    counters.clear()
    model, losses, got = _run([data_parallel(), cu])
    layers = list(model.model.layers)
    assert cu.compiled == layers and len(layers) == model.config.num_hidden_layers
    assert all(hasattr(cu.compiled_forward(layer), "_torchdynamo_orig_callable") for layer in layers)
    assert counters["frames"]["ok"] >= 1          # the compiled forwards ran: dynamo captured frames
    assert losses == ref_losses
    assert_trees_close(got, ref, rtol=0, atol=0)
    assert all("forward" not in layer.__dict__ for layer in layers)      # the modules are as they were
    cu.close()
    assert cu.compiled == []


def test_zero3_at_two_ranks_with_compiled_blocks_equals_the_reference():
    assert_matches_reference(lambda: [shard_zero(3), compile_units(backend="eager")], make_tiny_llama,
                             lambda: dsfn.optim.sgd(lr=0.1, momentum=0.9), token_batches(2, 4, 16, 128), 2,
                             loss_fn=hf_loss, rtol=1e-5, atol=1e-6)


def test_bad_arguments_and_models_without_blocks_are_refused():
    with pytest.raises(ConfigError, match="module-name patterns"):
        compile_units(units="model.layers.*")
    apply_fn, params = dsfn.functionalize(torch.nn.Linear(3, 2))
    step = dsfn.compose(compile_units())(lambda s, b: (s, {"y": apply_fn(s.params, b)}))
    with pytest.raises(ConfigError, match="no repeated blocks"):
        step(step.place(dsfn.TrainState.create(params, tx=dsfn.optim.sgd(lr=0.1))), torch.ones(1, 3))


@pytest.mark.slow
def test_inductor_compiled_blocks_train_like_eager():
    """Inductor reassociates: losses with AdamW, the state with SGD-momentum (Adam turns last-bit
    gradient differences into visible ones near eps)."""
    _, ref_losses, _ = _run([data_parallel()])
    _, losses, _ = _run([data_parallel(), compile_units()])
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5)
    sgd = lambda: dsfn.optim.sgd(lr=0.1, momentum=0.9)  # noqa: E731
    _, _, ref = _run([data_parallel()], sgd)
    _, _, got = _run([data_parallel(), compile_units()], sgd)
    assert_trees_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_compiled_blocks_under_zero3_at_two_ranks_equal_the_reference():
    """Inductor-compiled blocks whose weights live in ZeRO-3's resized unit storages (saved by
    the compiled forward, re-gathered before the compiled backward)."""
    assert_matches_reference(lambda: [shard_zero(3), compile_units()], make_tiny_llama,
                             lambda: dsfn.optim.sgd(lr=0.1, momentum=0.9), token_batches(2, 4, 16, 128), 2,
                             loss_fn=hf_loss, rtol=1e-5, atol=1e-6)
