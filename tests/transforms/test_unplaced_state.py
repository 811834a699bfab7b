"""A state that never went through `step.place` (straight from `TrainState.create`) is
refused by every stack that lays the state out, with an error naming `step.place` /
`step.init_state` — it never trains unsharded (or un-offloaded, or without master
weights) in silence, nor fails deep inside an optimizer. The same state placed trains."""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.errors import UnplacedStateError
from dsfn.testing import run_on_ranks
from dsfn.transforms import data_parallel, mixed_precision, offload, shard_zero

STACKS = {
    "zero1": lambda: [shard_zero(1)],
    "zero2": lambda: [shard_zero(2)],
    "zero3": lambda: [shard_zero(3, param_persistence_threshold=0)],
    "zero3_default_threshold": lambda: [shard_zero(3)],
    "data_parallel": lambda: [data_parallel()],
    "zero0": lambda: [shard_zero(0)],
    "offload": lambda: [offload("cpu")],
    "zero2_offload": lambda: [shard_zero(2), offload("cpu")],
    "mixed_precision": lambda: [mixed_precision()],
    "zero3_mixed_precision": lambda: [shard_zero(3, param_persistence_threshold=0), mixed_precision()],
}


def _each_stack(names):
    torch.manual_seed(0)
    # 64 x 64: above ZeRO-3's default persistence threshold, so its default stores it sharded
    model = torch.nn.Sequential(torch.nn.Linear(8, 400), torch.nn.Linear(400, 2))
    apply_fn, params = dsfn.functionalize(model)

    def loss_fn(p, batch):
        return ((apply_fn(p, batch["x"]) - batch["y"]) ** 2).mean()

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 2, generator=g)}
    out = {}
    for name in names:
        step = dsfn.compose(*STACKS[name]())(train_step)
        fresh = dsfn.TrainState.create(params, tx=dsfn.optim.adamw(1e-3))
        try:
            step(fresh, batch)
            refused = None
        except UnplacedStateError as e:
            refused = str(e)
        placed, _ = step(step.place(fresh), batch)                 # the control: placed, it trains
        init, _ = step(step.init_state(params, dsfn.optim.adamw(1e-3)), batch)
        replaced, _ = step(step.place(fresh).replace(extra={"k": torch.zeros(())}), batch)  # replace keeps placement
        out[name] = (refused, float(placed.step), float(init.step), float(replaced.step))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_an_unplaced_state_is_refused_and_the_placed_one_trains(world):
    out = run_on_ranks(_each_stack, world, list(STACKS), timeout=240)[0]
    for name in STACKS:
        refused, *steps = out[name]
        assert steps == [1.0, 1.0, 1.0], (name, steps)
        if world == 1 and name in ("data_parallel", "zero0", "zero1", "zero2", "zero3", "zero3_default_threshold"):
            # a dp axis of size 1: place is the identity (ZeRO shards nothing over one rank), so
            # the logical state is the placed one
            assert refused is None, (name, refused)
            continue
        assert refused is not None, f"{name} at world {world}: an unplaced state trained"
        assert "step.place(state)" in refused and "step.init_state(params, tx)" in refused, refused


def test_the_check_walks_a_state_only_when_it_is_not_the_last_returned(monkeypatch):
    """The loop `state, m = step(state, batch)` pays no walk over the leaves; a state the step
    did not just return (the first, a loaded or a replaced one) is checked."""
    import importlib
    C = importlib.import_module("dsfn.transforms.compose")     # the module (the package exports the function)
    calls = []
    real = C._check_placed
    monkeypatch.setattr(C, "_check_placed", lambda stack, state: (calls.append(1), real(stack, state)))
    model = torch.nn.Linear(4, 2)
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: apply_fn(p, b).square().mean())(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(mixed_precision())(train_step)
    state = step.init_state(params, dsfn.optim.sgd(0.1))
    x = torch.randn(3, 4)
    for _ in range(3):
        state, _ = step(state, x)
    assert len(calls) == 1
    step(state.replace(extra={"k": torch.zeros(())}), x)
    assert len(calls) == 2
