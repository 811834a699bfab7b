"""fp32 training whose gradients travel in bf16: `mixed_precision(torch.float32, reduce_dtype=torch.bfloat16)`.

DeepSpeed's `communication_data_type` for fp32 training: parameters, optimizer state and
gradient accumulation stay fp32; only the gradient reductions run in bf16. On 2 gloo
ranks, under data_parallel, shard_zero 1-3 and accumulate (inside ZeRO-2: one bf16
reduce-scatter per micro-batch, summed in fp32; inside data_parallel: one bf16 all-reduce
of the fp32 sum), the trained parameters equal a plain-torch emulation: each rank's fp32
gradient of its rows (computed here, in one process), rounded to bf16, averaged over the
2 ranks in bf16 (round(a + b) / 2, what gloo computes), back to fp32, and
torch.optim.SGD(momentum) on the fp32 parameters. Compared on the parameters' change over
3 steps, rtol 1e-4 (the update's own fp32 rounding; the bf16 reduce moves the change by
~1e-3 relative, so a reduce in fp32 misses). Negative control: the same stack with the
option dropped (`mixed_precision(torch.float32)`) does not match the emulation. Tensor and
sequence parallel: their gradient reductions carry bf16 (bytes on the wire), and the
gradients that come back stay fp32. A reduce dtype in a stack with no reduction is refused.
"""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.errors import StackError
from dsfn.runtime import init_mesh
from dsfn.runtime.collectives import counters
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import mse_loss, train_step_for
from dsfn.transforms import accumulate, data_parallel, mixed_precision, shard_zero

SIZES = [6, 10, 3]
WORLD, STEPS, LR, MOM = 2, 3, 0.1, 0.9
BATCHES = regression_batches(STEPS, 8, SIZES[0], SIZES[-1], seed=4)

STACKS = {
    "dp": (lambda: [data_parallel()], 1, False),
    "zero1": (lambda: [shard_zero(1)], 1, False),
    "zero2": (lambda: [shard_zero(2)], 1, False),
    "zero3": (lambda: [shard_zero(3, param_persistence_threshold=0)], 1, False),
    "zero3_persistent": (lambda: [shard_zero(3, param_persistence_threshold=40)], 1, False),   # all-reduced too
    "zero2+accumulate": (lambda: [shard_zero(2), accumulate(2)], 2, True),     # a reduce per micro-batch
    "dp+accumulate": (lambda: [data_parallel(), accumulate(2)], 2, False),     # one reduce of the fp32 sum
}


def _train(stack: str, reduce_dtype):
    init_mesh(dp=WORLD)
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    transforms = STACKS[stack][0]() + [mixed_precision(torch.float32, reduce_dtype=reduce_dtype)]
    step = dsfn.compose(*transforms)(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(LR, momentum=MOM)))
    for b in BATCHES:
        state, _ = step(state, b)
    return {k: v.clone() for k, v in step.gather(state).params.items()}


def _bf16_mean(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The average of two ranks' gradients as a bf16 reduce computes it, back in fp32."""
    return ((a.bfloat16().float() + b.bfloat16().float()).bfloat16() / 2).float()


def _emulated(micro: int, per_micro: bool) -> dict[str, torch.Tensor]:
    """Plain torch: the fp32 model, each rank's gradient of its rows (in `micro` micro-batches,
    each loss / micro), the bf16 average per micro-batch (`per_micro`) or of the fp32 sums,
    and torch.optim.SGD on the fp32 parameters."""
    model = make_mlp(SIZES, 0)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=LR, momentum=MOM)
    rows = 8 // WORLD // micro
    for batch in BATCHES:
        grads = {}        # (rank, micro) -> {name: fp32 gradient}
        for r in range(WORLD):
            for k in range(micro):
                sl = slice(r * 8 // WORLD + k * rows, r * 8 // WORLD + (k + 1) * rows)
                model.zero_grad()
                (torch.nn.functional.mse_loss(model(batch["x"][sl]), batch["y"][sl]) * (1.0 / micro)).backward()
                grads[r, k] = {n: p.grad.clone() for n, p in params.items()}
        for n, p in params.items():
            if per_micro:
                total = None
                for k in range(micro):
                    m = _bf16_mean(grads[0, k][n], grads[1, k][n])
                    total = m if total is None else total + m
            else:
                sums = [None, None]
                for r in range(WORLD):
                    for k in range(micro):
                        sums[r] = grads[r, k][n] if sums[r] is None else sums[r] + grads[r, k][n]
                total = _bf16_mean(*sums)
            p.grad = total
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


def _change(params: dict, init: dict) -> dict:
    return {n: params[n] - init[n] for n in init}


@pytest.mark.parametrize("stack", list(STACKS))
def test_fp32_training_reduces_in_bf16_like_the_emulation(stack):
    micro, per_micro = STACKS[stack][1], STACKS[stack][2]
    got, dropped = run_on_ranks(lambda: (_train(stack, torch.bfloat16), _train(stack, None)), WORLD, timeout=120)[0]
    init = {n: p.detach().clone() for n, p in make_mlp(SIZES, 0).named_parameters()}
    want = _emulated(micro, per_micro)
    assert {p.dtype for p in got.values()} == {torch.float32}
    assert_trees_close(_change(got, init), _change(want, init), rtol=1e-4, atol=1e-7)
    # negative control: without the option the gradients travel in fp32, and the run misses
    with pytest.raises(AssertionError):
        assert_trees_close(_change(dropped, init), _change(want, init), rtol=1e-4, atol=1e-7)


def test_one_transform_object_in_two_stacks_trains_each_as_alone():
    """One shard_zero object composed into a bf16 stack reducing in fp32 and then into a
    second one with plain mixed_precision() (reducing in bf16): the first trains bitwise as
    when composed alone (composing never writes to a transform). Negative control: the
    second stack's own training differs from the first's (the reduce dtype matters here)."""
    def rank():
        init_mesh(dp=WORLD)
        zero = shard_zero(2)
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
        make = {"fp32": lambda: mixed_precision(torch.bfloat16, reduce_dtype=torch.float32),
                "bf16": lambda: mixed_precision(torch.bfloat16)}

        def train(step):
            state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(LR, momentum=MOM)))
            for b in BATCHES:
                state, _ = step(state, b)
            return step.gather(state).params
        alone = train(dsfn.compose(zero, make["fp32"]())(train_step_for(apply_fn, mse_loss)))
        first = dsfn.compose(zero, make["fp32"]())(train_step_for(apply_fn, mse_loss))
        second = dsfn.compose(zero, make["bf16"]())(train_step_for(apply_fn, mse_loss))
        return alone, train(first), train(second)
    alone, first, second = run_on_ranks(rank, WORLD, timeout=120)[0]
    assert_trees_close(first, alone, rtol=0, atol=0)
    with pytest.raises(AssertionError):
        assert_trees_close(second, alone, rtol=0, atol=0)


def test_tensor_parallel_gradient_reductions_travel_in_bf16():
    """tp: the partial gradients of a `replicated` module's parameters are summed over tp in
    bf16 (2 bytes an element fewer on the wire than fp32), and come back fp32."""
    from dsfn.transforms import tensor_parallel

    def rank():
        init_mesh(tp=WORLD)
        out = {}
        for red in (None, torch.bfloat16):
            model = make_mlp([6, 8, 3], 0)
            # (layers.1 sees the gathered activation: its tp sum is only what is counted here)
            plan = {"layers.0": "colwise_rep", "layers.1": "replicated"}
            apply_fn, params = dsfn.functionalize(model)
            seen = []

            def train_step(state, batch):
                loss, grads = dsfn.value_and_grad(lambda p, b: mse_loss(apply_fn, p, b))(state.params, batch)
                seen.append({k: (g.data if hasattr(g, "layout") else g).dtype for k, g in grads.items()})
                return state.apply_gradients(grads), {"loss": loss}
            step = dsfn.compose(tensor_parallel(plan, model=model),
                                mixed_precision(torch.float32, reduce_dtype=red))(train_step)
            state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(LR)))
            counters.reset()
            step(state, BATCHES[0])
            out[str(red)] = (counters.bytes("tp", "all_reduce"), seen[0],
                             sum(p.numel() for n, p in params.items() if n.startswith("layers.1")))
        return out
    for out in run_on_ranks(rank, WORLD, timeout=120):
        (fp32_bytes, dtypes, n_rep), (bf16_bytes, dtypes_bf16, _) = out["None"], out["torch.bfloat16"]
        assert fp32_bytes - bf16_bytes == 2 * n_rep
        assert set(dtypes_bf16.values()) == set(dtypes.values()) == {torch.float32}


def test_a_reduce_dtype_with_nothing_to_reduce_is_refused():
    with pytest.raises(StackError, match="reduce_dtype"):
        dsfn.compose(mixed_precision(torch.float32, reduce_dtype=torch.bfloat16))
    # control: with a reduction in the stack it is accepted, and without the option too
    dsfn.compose(shard_zero(2), mixed_precision(torch.float32, reduce_dtype=torch.bfloat16))
    dsfn.compose(mixed_precision(torch.float32))
