"""accumulate(n): n micro-batches, the loss scaled once by 1/n, one optimizer step — the
full-batch mean. Under ZeRO-2/3 every micro-batch's gradient is reduced into the shard
(DeepSpeed's choice; measured here from the runtime counters), under stage 0/1 once per step.
"""
import pytest
import torch
import torch.nn.functional as F

import dsfn
from dsfn.errors import ConfigError, ShapeError
from dsfn.runtime import counters, init_mesh
from dsfn.testing import assert_trees_close, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import assert_matches_reference, mse_loss, run_training
from dsfn.transforms import accumulate, clip_grad_norm, compose, shard_zero

FP32 = dict(rtol=1e-5, atol=1e-6)
SIZES = [5, 7, 3]


def make_step(apply_fn, transforms):
    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: mse_loss(apply_fn, p, b))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return compose(*transforms)(train_step)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_single_process_accumulation_equals_full_batch(n):
    """One process: accumulate(n) equals the full-batch step (mean loss) to fp32 rounding, and
    the optimizer stepped once per batch, not once per micro-batch."""
    batches = regression_batches(3, 8, 5, 3, seed=n)
    ref = run_training(lambda: make_mlp(SIZES, 0), lambda: dsfn.optim.adamw(lr=1e-2), batches)
    got = run_training(lambda: make_mlp(SIZES, 0), lambda: dsfn.optim.adamw(lr=1e-2), batches, [accumulate(n)])
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), **FP32)
    assert_trees_close(got.state.params, ref.state.params, **FP32)
    assert int(got.state.step) == len(batches)


def test_accumulated_gradient_is_the_mean_over_micro_batches_by_hand():
    """Hand check with torch: the gradient the optimizer receives is (1/n) Σ_i ∇ mean-loss(micro_i)
    = ∇ mean-loss(full batch) (SGD lr=1 exposes it as the parameter change)."""
    batch = regression_batches(1, 6, 5, 3, seed=9)[0]
    model = make_mlp(SIZES, 0)
    grads = [torch.autograd.grad(F.mse_loss(model(batch["x"][i:i + 2]), batch["y"][i:i + 2]),
                                 list(model.parameters())) for i in (0, 2, 4)]
    mean = [sum(gs) / 3 for gs in zip(*grads)]
    got = run_training(lambda: make_mlp(SIZES, 0), lambda: dsfn.optim.sgd(lr=1.0), [batch], [accumulate(3)])
    for (name, p), g in zip(model.named_parameters(), mean):
        torch.testing.assert_close(p.detach() - got.state.params[name], g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_under_zero_equals_full_batch_reference(stage, n):
    """2 ranks x n micro-batches of 8/(2n) rows: equals the single-process full batch."""
    batches = regression_batches(3, 8, 5, 3, seed=10 * stage + n)
    _, results = assert_matches_reference(
        lambda: [shard_zero(stage, param_persistence_threshold=0, reduce_bucket_size=11), accumulate(n)],
        lambda: make_mlp(SIZES, stage), lambda: dsfn.optim.adamw(lr=1e-2), batches, 2, **FP32)
    assert all(int(r.state.step) == len(batches) for r in results)


def test_accumulation_with_clipping_on_4_ranks():
    """Clipping sees the accumulated (full-batch) gradient: same as clipping the full batch."""
    assert_matches_reference(
        lambda: [shard_zero(3, param_persistence_threshold=0), accumulate(2), clip_grad_norm(0.05)],
        lambda: make_mlp(SIZES, 1), lambda: dsfn.optim.adamw(lr=1e-2), regression_batches(3, 16, 5, 3, seed=1), 4,
        make_reference_transforms=lambda: [clip_grad_norm(0.05)], **FP32)


def test_accumulate_outside_shard_zero_is_equivalent():
    """Order freedom: accumulate(2) placed outside shard_zero (each micro-batch reduced by ZeRO
    before summing) gives the same result as the canonical order."""
    for stage in (1, 3):
        assert_matches_reference(lambda: [accumulate(2), shard_zero(stage, param_persistence_threshold=0)],
                                 lambda: make_mlp(SIZES, 2), lambda: dsfn.optim.sgd(lr=0.1, momentum=0.9),
                                 regression_batches(2, 8, 5, 3, seed=2), 2, **FP32)


def _reduction_counts(n):
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    pad = sum(2 * -(-p.numel() // 2) for p in params.values())
    psi = sum(p.numel() for p in params.values())
    out = {}
    for stage in range(4):
        # a reduce bucket of exactly one micro-batch's gradients: it launches as soon as a
        # micro-batch's backward has queued them all
        step = make_step(apply_fn, [shard_zero(stage, param_persistence_threshold=0, reduce_bucket_size=psi),
                                    accumulate(n)])
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
        counters.reset()
        state, _ = step(state, regression_batches(1, 8, 5, 3)[0])
        out[stage] = dict(ar=counters.bytes("dp", "all_reduce"), rs=counters.bytes("dp", "reduce_scatter"),
                          rs_calls=counters.calls("dp", "reduce_scatter"), ag=counters.bytes("dp", "all_gather"),
                          step=int(state.step))
    return psi, pad, out


@pytest.mark.parametrize("n", [2, 4])
def test_where_gradients_are_reduced_is_measured(n):
    """Stage 0 all-reduces once per step and stage 1 reduce-scatters once per step (local sums
    over the micro-batches first); stages 2 and 3 reduce-scatter every micro-batch into the
    shard: n x the gradient bytes, one bucket per micro-batch when the bucket holds exactly one
    micro-batch's gradients (with larger buckets several micro-batches share a collective, the
    bytes are the same). The optimizer steps once either way."""
    for psi, pad, out in run_on_ranks(_reduction_counts, 2, n, timeout=60):
        assert out[0]["ar"] == 4 * psi + 8 and out[0]["rs"] == 0   # + the loss metric (one float64)
        assert out[1]["rs"] == 4 * pad and out[1]["rs_calls"] == 1
        for stage in (2, 3):
            assert out[stage]["rs"] == n * 4 * pad, (stage, out[stage])
            assert out[stage]["rs_calls"] == n
        assert all(o["step"] == 1 for o in out.values())


def test_batch_not_divisible_by_n_is_a_shape_error():
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = make_step(apply_fn, [accumulate(4)])
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    with pytest.raises(ShapeError, match="multiple of 4"):
        step(state, regression_batches(1, 6, 5, 3)[0])


def _indivisible_per_rank():
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = make_step(apply_fn, [shard_zero(2), accumulate(2)])
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    try:
        step(state, regression_batches(1, 6, 5, 3)[0])      # 3 rows per rank: not divisible by 2
    except ShapeError as e:
        return str(e)
    return "no error"


def test_per_rank_batch_not_divisible_by_n_is_a_shape_error_on_every_rank():
    for msg in run_on_ranks(_indivisible_per_rank, 2, timeout=60):
        assert "accumulate(2)" in msg and "multiple of 2" in msg, msg


@pytest.mark.parametrize("n", [0, -1, True, 1.5, "2", None])
def test_accumulation_steps_below_one_or_not_int_is_a_config_error(n):
    with pytest.raises(ConfigError, match="accumulate"):
        accumulate(n)


def _accumulated_peak(n: int) -> tuple[int, int]:
    """(the allocation high-water mark of one step of accumulate(n) over n micro-batches of 256
    rows on an MLP whose activations outweigh its gradients, its parameter bytes)."""
    from dsfn.testing.alloc import allocation_peak
    apply_fn, params = dsfn.functionalize(make_mlp([64, 256, 256, 8], 0))
    step = compose(accumulate(n), donate=True)(dsfn.testing.reference.train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.01)))
    batch = regression_batches(1, 256 * n, 64, 8, seed=0)[0]
    state, _ = step(state, batch)
    holder = [state]

    def one():
        holder[0], _ = step(holder[0], batch)
    return allocation_peak(one)[1], sum(p.numel() * 4 for p in dsfn.tree.leaves(params))


@pytest.mark.parametrize("n", [3, 6])
def test_accumulation_holds_one_gradient_sum_between_micro_batches(n):
    """Micro-batches of the same size: going from 1 to n of them adds the running sum of the
    gradients (one gradient's bytes) at the end of the last micro-batch's forward, and nothing
    that grows with n. A micro-batch's own gradients are dropped as they are added (they stayed
    bound through the next micro-batch's forward: two gradient copies)."""
    one, grad_bytes = _accumulated_peak(1)
    many, _ = _accumulated_peak(n)
    assert many - one <= 1.1 * grad_bytes, (many - one, grad_bytes)
