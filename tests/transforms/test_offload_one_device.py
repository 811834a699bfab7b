"""Parameter offload on one device (ZeRO-Infinity at world 1, issue 40): `shard_zero(3)` with
`offload("cpu" | "nvme", params=True)` on a single rank keeps every parameter on the host
(or in files) and streams it to the device unit by unit.

Checked on CPU, where the "device" is the same memory: the same machinery runs (the
parameters are `Offloaded` / NVMe leaves, ZeRO-3's units are gathered one at a time with
the next prefetched — the gauge of units in flight stays at 1 + prefetch while the model has
more units), and training equals the single-process run bitwise with SGD-momentum (AdamW's
host update is the C++ CPU Adam: losses at rtol 1e-6). Negative control: with ZeRO's one-rank streaming off, the parameters stay whole where
they are and no unit is gathered, so the checks above are the streaming path's.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

import dsfn
from dsfn.runtime import collectives as C
from dsfn.runtime import init_mesh
from dsfn.state.layout import layout_of
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import run_training, train_step_for
from dsfn.transforms import offload, shard_zero
from dsfn.transforms.zero import ShardZero

SIZES = [6, 16, 16, 16, 3]           # 4 Linear units
BATCHES = regression_batches(3, 8, SIZES[0], SIZES[-1], seed=2)


def _stack(device: str, tmp_path) -> tuple:
    kw = {"path": str(tmp_path)} if device == "nvme" else {}
    return shard_zero(3), offload(device, params=True, **kw)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_one_device_parameter_offload_trains_as_one_process(device, tmp_path):
    init_mesh()
    sgd = lambda: dsfn.optim.sgd(0.1, momentum=0.9)  # noqa: E731
    ref = run_training(lambda: make_mlp(SIZES), sgd, BATCHES)
    got = run_training(lambda: make_mlp(SIZES), sgd, BATCHES, _stack(device, tmp_path))
    assert got.losses == ref.losses
    for a, b in zip(dsfn.tree.leaves(got.state.params), dsfn.tree.leaves(ref.state.params)):
        assert torch.equal(a, b)
    # AdamW's host update is the C++ CPU Adam (its own operation order): losses at rtol 1e-6
    adamw = lambda: dsfn.optim.adamw(1e-2)  # noqa: E731
    got = run_training(lambda: make_mlp(SIZES), adamw, BATCHES, _stack(device, tmp_path)).losses
    ref = run_training(lambda: make_mlp(SIZES), adamw, BATCHES).losses
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-6, atol=0)


def _placed_and_streamed(tmp_path) -> tuple[list[str], dict]:
    """(the parameters' layout types after place, the gauges' peaks of one step)."""
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES))
    step = dsfn.compose(*_stack("cpu", tmp_path))(train_step_for(apply_fn))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))
    layouts = [type(layout_of(x)).__name__ for x in dsfn.logical.leaves(state.params)]
    C.reset_gauges()
    step(state, BATCHES[0])
    return layouts, dict(C.gauge_max)


def test_the_parameters_live_on_the_host_and_stream_one_unit_at_a_time(tmp_path):
    layouts, gauges = _placed_and_streamed(tmp_path)
    assert layouts and all(lay == "Offloaded" for lay in layouts)
    # the root unit plus one layer and its prefetched successor at most, of 4 layers
    assert 1 <= gauges["zero3.live_units"] <= 2 < len(SIZES) - 1


def test_negative_control_without_one_rank_streaming_the_checks_above_fail(tmp_path):
    """With ZeRO's one-rank streaming off, the parameters stay whole where they are and no
    unit is gathered: what the test above asserts is the streaming path's."""
    with mock.patch.object(ShardZero, "streams_params", lambda self: False):
        layouts, gauges = _placed_and_streamed(tmp_path)
    assert not any(lay == "Offloaded" for lay in layouts) and "zero3.live_units" not in gauges


def test_transformers_zero3_offload_config_runs_on_one_rank_as_its_stack():
    """transformers' ds_config_zero3.json shape (ZeRO-3, optimizer and parameters offloaded to
    the CPU) on one rank: the stack from_ds_config builds trains as the hand-written one and as
    one process (SGD-momentum: bitwise; clipping at DeepSpeed's default 1.0 in both)."""
    from dsfn.transforms import clip_grad_norm
    init_mesh()
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "offload_param": {"device": "cpu", "pin_memory": True},
                                 "stage3_param_persistence_threshold": 0}}
    sgd = lambda: dsfn.optim.sgd(0.1, momentum=0.9)  # noqa: E731
    ds = dsfn.from_ds_config(cfg, world_size=1, tx=sgd())
    got = run_training(lambda: make_mlp(SIZES), sgd, BATCHES, ds.transforms)
    by_hand = run_training(lambda: make_mlp(SIZES), sgd, BATCHES,
                           (shard_zero(3), offload("cpu", params=True), clip_grad_norm(1.0)))
    alone = run_training(lambda: make_mlp(SIZES), sgd, BATCHES, (clip_grad_norm(1.0),))
    assert got.losses == by_hand.losses == alone.losses
    for a, b in zip(dsfn.tree.leaves(got.state.params), dsfn.tree.leaves(alone.state.params)):
        assert torch.equal(a, b)
