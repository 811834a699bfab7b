"""`from_ds_config`: MiCS's and ZeRO++ hpZ's keys (DeepSpeed 0.19.2 semantics,
/work/shared/reference/scale_out.md sections 1-2).

- `mics_shard_size: k` (k > 0, stage 3) -> `shard_zero(3, shard_group=k, cross_node=True)`;
  -1 (the default) and 0 are off;
- `zero_hpz_partition_size: k` (k > 1, stage 3) -> `shard_zero(3, hpz=min(k, dp))`; 1 (the
  default) and 0 are off;
- either at stage < 3, with sequence / tensor parallelism, or both together: a ConfigError
  naming the key and the fix;
- `mics_hierarchical_params_gather: true` -> `hierarchical_gather=True` (with MiCS; alone, a
  named refusal); the quantized ZeRO++ keys stay named refusals.

A MiCS config trains bitwise like the hand-written hybrid stack at world 4 with 2 ranks per
node, and its state really is hybrid (leaves split over "dp_shard"; the same config without
the key gives flat "dp" leaves and other numbers).
"""
import warnings

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError
from dsfn.migrate import from_ds_config
from dsfn.runtime import init_mesh
from dsfn.state.layout import Placed, is_placed
from dsfn.testing import assert_trees_equal, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import mse_loss_fp32, train_step_for
from dsfn.transforms import clip_grad_norm, shard_zero

BASE = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}


def _cfg(**zero):
    return {**BASE, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _zero(cfg, world=4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = from_ds_config(cfg, world_size=world)
    (zero,) = [t for t in got.transforms if t.name == "shard_zero"]
    return zero


@pytest.mark.parametrize("zero, expected", [
    ({"mics_shard_size": 2}, (2, True, None)),
    ({"mics_shard_size": 4}, (4, True, None)),
    ({"mics_shard_size": -1}, (None, False, None)),          # DeepSpeed's default: off
    ({"mics_shard_size": 0}, (None, False, None)),
    ({"mics_hierarchical_params_gather": False, "mics_shard_size": 2}, (2, True, None)),
    ({"zero_hpz_partition_size": 2}, (None, False, 2)),
    ({"zero_hpz_partition_size": 16}, (None, False, 4)),     # clamped to dp 4, as DeepSpeed clamps to the world
    ({"zero_hpz_partition_size": 1}, (None, False, None)),   # DeepSpeed's default: off
    ({}, (None, False, None)),
])
def test_keys_map_to_shard_zero_options(zero, expected):
    z = _zero(_cfg(**zero))
    assert (z.stage, z.shard_group, z.cross_node, z.hpz) == (3, *expected)


@pytest.mark.parametrize("cfg, match", [
    ({**BASE, "zero_optimization": {"stage": 2, "mics_shard_size": 2}},
     r"mics_shard_size: DeepSpeed reads it only at ZeRO stage 3; set stage 3 \(then it is shard_zero\(3, "
     r"shard_group=2, cross_node=True\)\)"),
    ({**BASE, "zero_optimization": {"stage": 1, "zero_hpz_partition_size": 2}},
     r"zero_hpz_partition_size: DeepSpeed reads it only at ZeRO stage 3; set stage 3 \(then it is "
     r"shard_zero\(3, hpz=2\)\)"),
    (_cfg(mics_shard_size=2, zero_hpz_partition_size=2), r"zero_hpz_partition_size: with mics_shard_size.*keep one"),
    (_cfg(mics_hierarchical_params_gather=True),
     r"mics_hierarchical_params_gather: .*no mics_shard_size is set: set mics_shard_size, or remove the key"),
    ({**_cfg(mics_shard_size=2), "sequence_parallel_size": 2},
     r"mics_shard_size: DeepSpeed forms its groups over the whole world.*shard_zero\(3, shard_group=2\) by hand"),
    ({**BASE, "zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
     r"zero_quantized_weights: DeepSpeed quantizes ZeRO-3's weight gathers; set stage 3 \(then it is "
     r"shard_zero\(3, quantize_weights='int8'\)\)"),
    ({**BASE, "zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
     r"zero_quantized_gradients: DeepSpeed quantizes ZeRO-3's gradient reduce-scatter; set stage 3 \(then it is "
     r"shard_zero\(3, quantize_grads='int4'\)\)"),
    ({**BASE, "zero_optimization": {"stage": 1, "zero_quantized_nontrainable_weights": True}},
     r"zero_quantized_nontrainable_weights: DeepSpeed quantizes ZeRO-3's frozen weight shards; set stage 3"),
    (_cfg(zero_quantized_gradients="yes"), r"zero_quantized_gradients='yes': expected true or false"),
    (_cfg(mics_shard_size="2"), r"mics_shard_size='2': expected a whole number"),
])
def test_refusals_are_config_errors_naming_the_key_and_the_fix(cfg, match):
    with pytest.raises(ConfigError, match=match):
        _zero(cfg)


@pytest.mark.parametrize("key,attr,fmt", [("zero_quantized_weights", "wire", "int8"),
                                          ("zero_quantized_gradients", "grad_wire", "int4"),
                                          ("zero_quantized_nontrainable_weights", "frozen_wire", "int8")])
def test_zero_quantized_keys_map_to_zeropp_options(key, attr, fmt):
    """DeepSpeed's ZeRO++ keys are shard_zero(3, quantize_weights / quantize_grads /
    quantize_frozen); false leaves them off, and each turns on only its own."""
    on = _zero(_cfg(**{key: True}))
    assert getattr(on, attr).fmt == fmt
    assert [a for a in ("wire", "grad_wire", "frozen_wire") if getattr(on, a) is not None] == [attr]
    assert getattr(_zero(_cfg(**{key: False})), attr) is None


def test_hierarchical_gather_maps_to_the_two_stage_gather():
    """With MiCS the key turns the two-stage gather on; false leaves it off."""
    on = _zero(_cfg(mics_shard_size=2, mics_hierarchical_params_gather=True))
    assert (on.shard_group, on.cross_node, on.hierarchical_gather) == (2, True, True)
    off = _zero(_cfg(mics_shard_size=2, mics_hierarchical_params_gather=False))
    assert (off.shard_group, off.hierarchical_gather) == (2, False)


STEPS = 3


def _train(how):
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 3], 0))
    if how == "hand":
        transforms = [shard_zero(3, reduce_bucket_size=500_000_000, allgather_bucket_size=500_000_000,
                                 shard_group=2, cross_node=True), clip_grad_norm(1.0)]
        tx = dsfn.optim.adamw(1e-3, weight_decay=0.1)
    else:
        cfg = _cfg(mics_shard_size=2) if how == "mics" else _cfg()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            got = from_ds_config(cfg, world_size=4)
        transforms, tx = got.transforms, got.tx
    step = dsfn.compose(*transforms)(train_step_for(apply_fn, mse_loss_fp32))
    state = step.init_state(params, tx)
    axes = sorted({x.layout.axis for x in dsfn.tree.leaves(state.params, is_leaf=is_placed) if isinstance(x, Placed)})
    losses = []
    for b in regression_batches(STEPS, 8, 6, 3, seed=2):
        state, m = step(state, b)
        losses.append(m["loss"])
    full = step.gather(state)
    return axes, {"losses": torch.stack(losses), "params": full.params, "opt_state": full.opt_state}


def _all():
    return {how: _train(how) for how in ("mics", "hand", "flat")}


def test_mics_config_trains_like_the_hand_written_hybrid_stack():
    for rank, runs in enumerate(run_on_ranks(_all, 4, timeout=120, ranks_per_node=2)):
        (axes, got), (hand_axes, hand), (flat_axes, flat) = runs["mics"], runs["hand"], runs["flat"]
        assert axes == hand_axes == ["dp_shard"] and flat_axes == ["dp"], (rank, axes, hand_axes, flat_axes)
        assert_trees_equal(got, hand)
        with pytest.raises(AssertionError):        # the key is in effect: flat ZeRO-3 reduces otherwise
            assert_trees_equal(flat, hand)
