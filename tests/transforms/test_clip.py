"""clip_grad_norm: the global norm over every shard and axis, counted once; torch's rule.

The single-process run is checked against torch (`nn.utils.clip_grad_norm_` + `torch.optim.SGD`);
sharded runs are checked against the single process with the same clipping, and every ZeRO
stage must report the reference's norm (DeepSpeed issue #4298: stages disagreeing on it).
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import dsfn
from dsfn.errors import ConfigError, StackError
from dsfn.testing import assert_trees_close, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import assert_matches_reference, run_training
from dsfn.transforms import clip_grad_norm, compose, loss_scale, shard_zero

FP32 = dict(rtol=1e-5, atol=1e-6)


def torch_clipped_sgd(sizes, seed, batches, max_norm, lr):
    """The reference of the reference: torch's own clip_grad_norm_ and SGD."""
    model = make_mlp(sizes, seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    for b in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(b["x"]), b["y"])
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("max_norm", [0.05, 1e4])
def test_single_process_clipping_equals_torch(max_norm):
    """Clipping active (0.05) and inactive (1e4): losses, the grad_norm metric and parameters
    equal torch's clip_grad_norm_ + SGD (the norm to float32 rounding; params within an ulp per
    step, as dsfn's SGD adds -lr*g where torch fuses it)."""
    sizes, batches = [5, 7, 3], regression_batches(3, 6, 5, 3, seed=1)
    t_losses, t_norms, t_params = torch_clipped_sgd(sizes, 0, batches, max_norm, lr=0.1)
    res = run_training(lambda: make_mlp(sizes, 0), lambda: dsfn.optim.sgd(lr=0.1), batches, [clip_grad_norm(max_norm)])
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(t_losses), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor([m["grad_norm"] for m in res.metrics]), torch.tensor(t_norms),
                               rtol=1e-6, atol=0)
    assert_trees_close(res.state.params, t_params, rtol=1e-6, atol=1e-7)
    if max_norm < 1:
        assert all(n > max_norm for n in t_norms)   # clipping was active


def test_clipped_update_has_norm_max_norm():
    """Hand check: with SGD(lr=1) the first update is exactly -clipped_grad, whose norm is
    max_norm (to float32 rounding) when the raw norm is larger."""
    batches = regression_batches(1, 4, 5, 3, seed=0)
    model = make_mlp([5, 7, 3], 0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    res = run_training(lambda: make_mlp([5, 7, 3], 0), lambda: dsfn.optim.sgd(lr=1.0), batches, [clip_grad_norm(0.01)])
    step_norm = torch.sqrt(sum(((res.state.params[k] - before[k]).double() ** 2).sum() for k in before))
    assert res.metrics[0]["grad_norm"] > 0.01
    assert abs(float(step_norm) - 0.01) < 1e-7


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(deadline=None, max_examples=2, derandomize=True)
@given(world=st.sampled_from([2, 4]), seed=st.integers(0, 10_000), max_norm=st.sampled_from([0.02, 0.3, 1e4]))
def test_sharded_clipping_equals_reference_and_reports_the_same_norm(stage, world, seed, max_norm):
    """Property: every stage and world size clips by the single-process global norm — the
    grad_norm metric equals the reference's (rtol 1e-5) on every rank and the state matches."""
    sizes = [5, 9, 3]       # 45, 9, 27, 3 elements: padded under 2 and 4
    batches = regression_batches(3, 4, 5, 3, seed=seed)
    ref, results = assert_matches_reference(
        lambda: [shard_zero(stage, param_persistence_threshold=0, reduce_bucket_size=7), clip_grad_norm(max_norm)],
        lambda: make_mlp(sizes, seed), lambda: dsfn.optim.adamw(lr=1e-2), batches, world, seed=seed,
        make_reference_transforms=lambda: [clip_grad_norm(max_norm)], **FP32)
    want = torch.tensor([m["grad_norm"] for m in ref.metrics], dtype=torch.float64)
    for res in results:
        got = torch.tensor([m["grad_norm"] for m in res.metrics], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_norm_counts_replicated_params_once_and_sharded_pieces_once():
    """Stage 3 with a persistence threshold: the biases stay replicated (held whole by all 4
    ranks) while the weights are sharded; the norm must count each logical element once."""
    sizes = [6, 9, 4]
    ref, results = assert_matches_reference(
        lambda: [shard_zero(3, param_persistence_threshold=20), clip_grad_norm(0.05)],
        lambda: make_mlp(sizes, 1), lambda: dsfn.optim.sgd(lr=0.1), regression_batches(2, 4, 6, 4, seed=2), 4,
        make_reference_transforms=lambda: [clip_grad_norm(0.05)], **FP32)
    for res in results:
        torch.testing.assert_close(torch.tensor([m["grad_norm"] for m in res.metrics]),
                                   torch.tensor([m["grad_norm"] for m in ref.metrics]), rtol=1e-5, atol=0)


def test_stages_1_2_3_report_identical_norms():
    """Same batches, same model, 2 ranks: stages 1, 2, 3 report the same grad_norm to rtol 1e-5
    at every step (they all hold reduce-scattered shards; stage 0 holds all-reduced copies)."""
    batches = regression_batches(3, 4, 5, 3, seed=4)

    def rank_fn():
        return {s: [m["grad_norm"] for m in run_training(lambda: make_mlp([5, 9, 3], 4), lambda: dsfn.optim.sgd(lr=0.1),
                                                         batches, [shard_zero(s, param_persistence_threshold=0),
                                                                   clip_grad_norm(0.1)]).metrics]
                for s in range(4)}

    for norms in run_on_ranks(rank_fn, 2, timeout=60):
        for s in (0, 2, 3):
            torch.testing.assert_close(torch.tensor(norms[s]), torch.tensor(norms[1]), rtol=1e-5, atol=0)


def test_grad_norm_metric_on_a_skipped_step_is_that_steps_norm():
    """With loss_scale, an overflowed step's grad_norm must describe that step's gradients (whose
    norm is inf/NaN), not repeat the previous step's value; and the metric is reported on every
    step (also when the very first step overflows), so logs keep one set of keys."""
    batches = regression_batches(3, 4, 5, 3, seed=0)
    batches[1]["x"][0, 0] = float("inf")
    res = run_training(lambda: make_mlp([5, 3], 0), lambda: dsfn.optim.sgd(lr=0.1), batches,
                       [loss_scale(init_scale=4.0, hysteresis=1), clip_grad_norm(1.0)])
    assert [m["skipped"] for m in res.metrics] == [0.0, 1.0, 0.0]
    assert all("grad_norm" in m for m in res.metrics)
    assert res.metrics[1]["grad_norm"] != res.metrics[0]["grad_norm"]
    assert not torch.isfinite(torch.tensor(res.metrics[1]["grad_norm"]))
    first = [dict(b) for b in batches]
    first[0] = {"x": batches[1]["x"], "y": batches[1]["y"]}
    res = run_training(lambda: make_mlp([5, 3], 0), lambda: dsfn.optim.sgd(lr=0.1), first,
                       [loss_scale(init_scale=4.0, hysteresis=1), clip_grad_norm(1.0)])
    assert res.metrics[0]["skipped"] == 1.0 and "grad_norm" in res.metrics[0]


@pytest.mark.parametrize("max_norm", [0, -1.0, "1", None])
def test_bad_max_norm_is_a_config_error(max_norm):
    with pytest.raises(ConfigError):
        clip_grad_norm(max_norm)


def test_clip_must_sit_inside_loss_scale():
    with pytest.raises(StackError, match="inside loss_scale"):
        compose(shard_zero(2), clip_grad_norm(1.0), loss_scale())
    compose(shard_zero(2), loss_scale(), clip_grad_norm(1.0))
