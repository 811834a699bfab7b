"""Whole stacks: compose(shard_zero(s), accumulate(n), mixed_precision(...), loss_scale(),
clip_grad_norm(c)) on 2 or 4 ranks equals the single-process run of the transforms that change
the math (mixed precision, loss scaling, clipping), for every stage.

Tolerances (SGD lr=0.05, momentum 0.9, 3 steps: each parameter moves ≈ 0.28 gradient units;
|g| ≲ 1 here). The multi-rank run computes the same sums in other orders and over other batch
splits, so the two differ by rounding in the compute dtype:
- fp32: rtol 1e-5, atol 1e-6 (the project-wide reference tolerance);
- bf16 (8 significant bits, ulp 2^-8..2^-7 relative): losses rtol 1e-2 (about one ulp of a
  mean rounded to bf16), params atol 2e-3 (0.28 x 2^-7);
- fp16 (11 significant bits, ulp 2^-11..2^-10): losses rtol 2e-3 (two ulps), params atol 5e-4
  (0.28 x 2 x 2^-10).
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dsfn
from dsfn.errors import StackError
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.testing import assert_trees_close, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches, token_batches
from dsfn.testing.reference import lm_loss, mse_loss, run_training
from dsfn.transforms import (accumulate, clip_grad_norm, compose, data_parallel, loss_scale, mixed_precision,
                             shard_zero)

TOL = {None: dict(loss_rtol=1e-5, rtol=1e-5, atol=1e-6),
       torch.bfloat16: dict(loss_rtol=1e-2, rtol=0.0, atol=2e-3),
       torch.float16: dict(loss_rtol=2e-3, rtol=0.0, atol=5e-4)}
SIZES = [6, 10, 3]


def sgd():
    return dsfn.optim.sgd(lr=0.05, momentum=0.9)


def math_transforms(dtype, clip):
    """The transforms that change the math, in canonical order (the reference runs these)."""
    out = []
    if dtype is not None:
        out.append(mixed_precision(dtype))
    if dtype == torch.float16:
        out.append(loss_scale(init_scale=2.0 ** 8, window=2))    # small: no overflow in these runs
    if clip is not None:
        out.append(clip_grad_norm(clip))
    return out


def run_stack(stage, world, n_acc, dtype, clip, make_model, batches, loss_fn=mse_loss, **zero_kw):
    def rank_fn():
        res = run_training(make_model, sgd, batches,
                           [shard_zero(stage, param_persistence_threshold=0, **zero_kw), accumulate(n_acc),
                            *math_transforms(dtype, clip)], loss_fn)
        return res.losses, res.metrics, res.state.params, int(res.state.step)
    return run_on_ranks(rank_fn, world, timeout=120)


def check_against_reference(ref, results, dtype, clip, n_batches):
    tol = TOL[dtype]
    for rank, (losses, metrics, params, step) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref.losses, dtype=torch.float64), rtol=tol["loss_rtol"], atol=0,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        assert_trees_close(params, ref.state.params, rtol=tol["rtol"], atol=tol["atol"], msg=f"rank {rank} params")
        assert {p.dtype for p in params.values()} == {torch.float32}     # logical state: fp32 masters
        assert step == n_batches
        assert metrics == results[0][1], "metrics are reduced: every rank reports the same"
        if dtype == torch.float16:
            assert [m["loss_scale"] for m in metrics] == [m["loss_scale"] for m in ref.metrics]
            assert all(m["skipped"] == 0.0 for m in metrics)
        if clip is not None:
            norm_rtol = 1e-5 if dtype is None else 3 * tol["loss_rtol"]
            torch.testing.assert_close(torch.tensor([m["grad_norm"] for m in metrics]),
                                       torch.tensor([m["grad_norm"] for m in ref.metrics]), rtol=norm_rtol, atol=0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@settings(deadline=None, max_examples=2, derandomize=True)
@given(world=st.sampled_from([2, 4]), n_acc=st.sampled_from([1, 2]), clip=st.sampled_from([None, 0.3]),
       seed=st.integers(0, 10_000))
def test_random_stacks_equal_the_single_process_run(stage, world, n_acc, dtype, clip, seed):
    batches = regression_batches(3, 8, 6, 3, seed=seed)
    make_model = lambda: make_mlp(SIZES, seed)
    ref = run_training(make_model, sgd, batches, math_transforms(dtype, clip))
    results = run_stack(stage, world, n_acc, dtype, clip, make_model, batches, reduce_bucket_size=13)
    check_against_reference(ref, results, dtype, clip, len(batches))


def test_tiny_gpt_full_bf16_stack_on_stage3():
    """The tiny GPT under shard_zero(3) + accumulate(2) + bf16 + clipping on 2 ranks vs the
    single-process bf16 + clipping run."""
    batches = token_batches(2, 4, 16, 256, seed=5)
    make_model = lambda: GPT(GPTConfig.preset("tiny"))
    ref = run_training(make_model, sgd, batches, math_transforms(torch.bfloat16, 1.0), lm_loss)
    results = run_stack(3, 2, 2, torch.bfloat16, 1.0, make_model, batches, lm_loss)
    check_against_reference(ref, results, torch.bfloat16, 1.0, len(batches))


def test_full_fp16_stack_reports_every_metric():
    """loss, lr, grad_norm, loss_scale and skipped come back, equal on all ranks, with the
    optimizer's lr and a power-of-two scale."""
    batches = regression_batches(2, 8, 6, 3, seed=0)
    results = run_stack(2, 2, 2, torch.float16, 0.3, lambda: make_mlp(SIZES, 0), batches)
    for _, metrics, _, _ in results:
        for m in metrics:
            assert set(m) == {"loss", "lr", "grad_norm", "loss_scale", "skipped"}
            assert m["lr"] == pytest.approx(0.05, rel=1e-7)
            assert m["skipped"] == 0.0 and m["grad_norm"] > 0
            assert float(m["loss_scale"]).is_integer() and (int(m["loss_scale"]) & (int(m["loss_scale"]) - 1)) == 0
        assert metrics == results[0][1]


# ----------------------------------------------------------------------------------------------
# invalid stacks fail at compose time, with an error that says what to change
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stack,match", [
    (lambda: (data_parallel(), shard_zero(2)), "remove data_parallel"),
    (lambda: (shard_zero(3), data_parallel()), "remove data_parallel"),
    (lambda: (mixed_precision(torch.bfloat16), shard_zero(1)), "inside shard_zero"),
    (lambda: (mixed_precision(torch.float16), data_parallel()), "inside data_parallel"),
    (lambda: (shard_zero(2), clip_grad_norm(1.0), loss_scale()), "inside loss_scale"),
    (lambda: (shard_zero(2), accumulate(2), accumulate(2)), "twice"),
    (lambda: (shard_zero(2), loss_scale(), loss_scale()), "twice"),
    (lambda: (shard_zero,), "forget to call"),
])
def test_invalid_stacks_are_stack_errors(stack, match):
    with pytest.raises(StackError, match=match):
        compose(*stack())


def test_canonical_stack_composes():
    step = compose(shard_zero(3), accumulate(2), mixed_precision(torch.float16), loss_scale(),
                   clip_grad_norm(1.0))(lambda s, b: (s, {}))
    assert [t.name for t in step.stack] == ["shard_zero", "accumulate", "mixed_precision", "loss_scale",
                                            "clip_grad_norm"]
