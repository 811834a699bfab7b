"""Devices under ZeRO and offload, checked on a CPU-only machine with the `meta` device
standing in for the GPU (a meta tensor mixed with a CPU tensor in one op is an error, as a
CUDA one would be, and every result says which device it is on).

- ZeRO stages 2/3: the gradient the optimizer sees for a parameter the loss never touches
  is on the parameter's device (a zero made on the host would mix devices on a GPU).
- ZeRO-3 + offload(params=True): the shards live in host memory while the compute device is
  elsewhere (the layout's `home`); the unit gather must hand the forward weights on the
  compute device, and the gradient autograd gets for a host shard must be on the host.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import dsfn
from dsfn import tree
from dsfn.state.layout import Offloaded, Placed, is_placed
from dsfn.transforms import offload, shard_zero
from dsfn.transforms.zero import ShardZero


@pytest.fixture(autouse=True)
def _zero_machinery_in_one_process(monkeypatch):
    """One process stands in for the ranks: ZeRO keeps its sharded machinery at world 1 (which
    it otherwise skips: a one-rank shard is the whole tensor)."""
    monkeypatch.setattr(ShardZero, "_shard_single_rank", True)


class WithUnused(nn.Module):
    """Two units (a ModuleList) and a parameter the loss never reaches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _seen_by_optimizer(seen: list):
    """An SGD whose update records the device of every gradient leaf it gets."""
    inner = dsfn.optim.sgd(lr=0.1)

    def update(updates, state, params=None):
        seen.extend(t.device for t in tree.leaves(updates))
        return inner.update(updates, state, params)
    return dsfn.optim.GradientTransformation(inner.init, update)


def _step_on_meta(stage: int, seen: list):
    """One ZeRO step of `WithUnused` on meta tensors (a bucket per tensor), the optimizer
    recording the device of every gradient it gets into `seen`; returns the new state."""
    model = WithUnused().to("meta")
    apply_fn, params = dsfn.functionalize(model)
    state = dsfn.TrainState.create(params, tx=_seen_by_optimizer(seen))

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: apply_fn(p, b["x"]).pow(2).mean())(state.params, batch)
        return state.apply_gradients(grads), {}

    step = dsfn.compose(shard_zero(stage, reduce_bucket_size=1))(train_step)   # a bucket per tensor
    new, _ = step(step.place(state), {"x": torch.zeros(2, 4, device="meta")})
    return new, len(params)


@pytest.mark.parametrize("stage", [2, 3])
def test_untouched_parameter_gradient_is_on_the_parameter_device(stage):
    seen: list[torch.device] = []
    new, n_params = _step_on_meta(stage, seen)
    assert len(seen) == n_params and set(seen) == {torch.device("meta")}
    assert {t.device.type for t in tree.leaves(new.params)} == {"meta"}


@pytest.mark.parametrize("stage", [2, 3])
def test_control_host_zeros_are_caught(stage, monkeypatch):
    """The control: with the zero-fill device forced to the host (the defect), the optimizer
    does see a CPU gradient among the meta ones, so the test above can fail."""
    import dsfn.engines.zero.shards as Z       # where the reducer decides the zero-fill device
    monkeypatch.setattr(Z, "compute_device", lambda x: torch.device("cpu"))
    seen: list[torch.device] = []
    try:
        _step_on_meta(stage, seen)
    except RuntimeError:
        return                # mixed devices failed in the update itself: caught as well
    assert torch.device("cpu") in seen


def _home_on_meta(state):
    """The placed state with its offloaded parameter shards' compute device set to meta (the
    shards stay in host memory): what offload(params=True) makes from a GPU state."""
    def rehome(x):
        if isinstance(x, Placed) and isinstance(x.layout, Offloaded):
            return Placed(x.data, dataclasses.replace(x.layout, home="meta"))
        return x
    return state.replace(params=tree.map(rehome, state.params, is_leaf=is_placed))


def test_offloaded_zero3_shards_are_gathered_to_the_compute_device():
    model = WithUnused()
    apply_fn, params = dsfn.functionalize(model)
    state = dsfn.TrainState.create(params, tx=dsfn.optim.sgd(lr=0.1))
    weights: list[torch.device] = []

    for m in (model.inp, *model.blocks):      # the weight each layer computes with (gathered)
        m.register_forward_hook(lambda mod, args, out: weights.append(mod.weight.device))

    def loss_fn(p, b):
        return apply_fn(p, b["x"]).pow(2).mean()

    grads_out = {}

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        grads_out["grads"] = grads
        return state, {}

    step = dsfn.compose(shard_zero(3), offload("cpu", params=True))(train_step)
    placed = step.place(state)
    shards = [x for x in tree.leaves(placed.params, is_leaf=is_placed) if isinstance(x, Placed)]
    assert shards and all(isinstance(x.layout, Offloaded) and x.data.device.type == "cpu" for x in shards)
    step(_home_on_meta(placed), {"x": torch.zeros(2, 4, device="meta")})
    assert weights and set(weights) == {torch.device("meta")}
    # the reduced gradient shards are where the gradients were computed (then offload moves them)
    g = [x.data if isinstance(x, Placed) else x for x in tree.leaves(grads_out["grads"], is_leaf=is_placed)]
    assert {t.device.type for t in g} == {"meta"}


def test_offloaded_zero3_stand_in_gradient_matches_the_host_shard():
    """_Gather.backward's stand-in for a host shard is a host tensor: autograd accepts it
    (a device stand-in for a host input raises 'invalid gradient ... expected device')."""
    from dsfn.engines.zero.units import Gather as _Gather

    class FakeGatherer:
        def __init__(self, shard):
            self.shard, self.got = shard, None

        def full(self, i):
            return torch.ones(4, device="meta")

        def shard_shape(self, i):
            return tuple(self.shard.shape)

        def grads_ready(self, pairs):
            (_, self.got), = pairs

    shard = torch.zeros(2, requires_grad=True)
    g = FakeGatherer(shard)
    out = _Gather.apply(shard, g, 0)
    assert out.device.type == "meta"
    out.sum().backward()
    assert g.got.device.type == "meta" and shard.grad.device.type == "cpu"
