"""mixed_precision: bf16/fp16 compute with fp32 master weights in the (sharded) optimizer state.

Tolerances. bf16 keeps 8 significant bits: a rounding changes a value by up to 2^-8..2^-7
relative (≈ 0.4-0.8 %). Losses here are means computed in bf16, and a 2-rank run averages two
bf16 half-batch means where the single process rounds one full-batch mean, so the two differ by
about one bf16 ulp: losses rtol 1e-2. Parameters: SGD(lr=0.05, momentum=0.9) for 3 steps moves
each parameter by lr · (1 + 1.9 + 2.71) ≈ 0.28 gradient units; gradients (|g| ≲ 1 here) that
differ by one bf16 ulp (2^-7) give at most 0.28 · 2^-7 ≈ 2.2e-3: params atol 2e-3. (SGD rather
than Adam, whose sign-like steps turn a rounding difference in a near-zero gradient into ±lr.)
Between dsfn layouts of the same precision on the same 2 ranks (stage 0 vs stages 1-3) nothing
is reordered, so those runs are compared bitwise.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import dsfn
from dsfn import tree
from dsfn.errors import ConfigError, StackError
from dsfn.runtime import counters, current_mesh, init_mesh
from dsfn.state.layout import FlatShard, Placed
from dsfn.testing import assert_trees_close, assert_trees_equal, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import mse_loss, run_training
from dsfn.transforms import accumulate, compose, data_parallel, mixed_precision, shard_zero
from dsfn.transforms.mixed_precision import MasterState

BF16_LOSS_RTOL = 1e-2
BF16_PARAM_ATOL = 2e-3
SIZES = [6, 10, 3]


def sgd():
    return dsfn.optim.sgd(lr=0.05, momentum=0.9)


def _strip(state):
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def make_step(apply_fn, transforms, capture=None):
    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: mse_loss(apply_fn, p, b))(state.params, batch)
        if capture is not None:
            capture.append(grads)
        return state.apply_gradients(grads), {"loss": loss}
    return dsfn.compose(*transforms)(train_step)


def has_master_state(opt_state) -> bool:
    return any(isinstance(x, MasterState) for x in tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MasterState)))


# ----------------------------------------------------------------------------------------------
# ZeRO stages vs data-parallel-equivalent stage 0, same precision, same ranks: bitwise
# ----------------------------------------------------------------------------------------------

def _stages_bf16(batches, seed, n_acc):
    out = {}
    for stage in ("data_parallel", 0, 1, 2, 3):
        parallel = data_parallel() if stage == "data_parallel" else \
            shard_zero(stage, param_persistence_threshold=0, reduce_bucket_size=16)
        res = run_training(lambda: make_mlp(SIZES, seed), lambda: dsfn.optim.adamw(lr=1e-2), batches,
                           [parallel, accumulate(n_acc), mixed_precision(torch.bfloat16)])
        out[stage] = (res.losses, _strip(res.state))
    return out


def test_bf16_zero_stages_equal_stage0_bitwise():
    """bf16 on 2 ranks: stages 1, 2, 3 give bitwise the losses and final (master) state of stage 0
    (plain data parallel, itself bitwise data_parallel()): the same bf16 gradients are averaged
    over the same 2 ranks, only where the result is stored differs. Adam is fine here: nothing
    is compared across orders."""
    batches = regression_batches(3, 8, 6, 3, seed=7)
    for res in run_on_ranks(_stages_bf16, 2, batches, 7, 1, timeout=60):
        for stage in ("data_parallel", 1, 2, 3):
            assert res[stage][0] == res[0][0], (stage, res[stage][0], res[0][0])
            assert_trees_equal(res[stage][1], res[0][1], msg=f"stage {stage} vs stage 0")


def test_bf16_zero_with_accumulation_near_stage0():
    """With accumulate(2), stages 2 and 3 reduce every micro-batch's bf16 gradient into the shard
    (zero.py) while stages 0/1 sum locally and reduce once: a different bf16 rounding order, so
    near (bf16 tolerance, SGD) rather than bitwise; stage 1 stays bitwise equal to stage 0."""
    batches = regression_batches(3, 8, 6, 3, seed=3)

    def rank_fn():
        out = {}
        for stage in range(4):
            res = run_training(lambda: make_mlp(SIZES, 3), sgd, batches,
                               [shard_zero(stage, param_persistence_threshold=0), accumulate(2),
                                mixed_precision(torch.bfloat16)])
            out[stage] = (res.losses, _strip(res.state))
        return out

    for res in run_on_ranks(rank_fn, 2, timeout=60):
        assert_trees_equal(res[1][1], res[0][1])
        for stage in (2, 3):
            torch.testing.assert_close(torch.tensor(res[stage][0]), torch.tensor(res[0][0]),
                                       rtol=BF16_LOSS_RTOL, atol=0)
            assert_trees_close(res[stage][1]["params"], res[0][1]["params"], rtol=0, atol=BF16_PARAM_ATOL)


# ----------------------------------------------------------------------------------------------
# ZeRO + bf16 on 2 ranks vs the single-process bf16 run
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(deadline=None, max_examples=2, derandomize=True)
@given(seed=st.integers(0, 10_000), n_acc=st.sampled_from([1, 2]))
def test_bf16_zero_matches_single_process_mixed_precision(stage, seed, n_acc):
    """Property over seeds and stages: 2-rank ZeRO + bf16 equals the single-process bf16 run
    within the tolerances stated in the module docstring; master weights come back fp32."""
    batches = regression_batches(3, 8, 6, 3, seed=seed)
    make_model = lambda: make_mlp(SIZES, seed)
    ref = run_training(make_model, sgd, batches, [mixed_precision(torch.bfloat16)])

    def rank_fn():
        res = run_training(make_model, sgd, batches, [shard_zero(stage, param_persistence_threshold=0),
                                                      accumulate(n_acc), mixed_precision(torch.bfloat16)])
        return res.losses, res.state.params

    for losses, params in run_on_ranks(rank_fn, 2, timeout=60):
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref.losses, dtype=torch.float64), rtol=BF16_LOSS_RTOL, atol=0)
        assert all(p.dtype == torch.float32 for p in params.values())
        assert_trees_close(params, ref.state.params, rtol=0, atol=BF16_PARAM_ATOL)


def test_single_process_bf16_is_near_fp32_reference():
    """Sanity of the tolerance: the single-process bf16 run itself is within it of fp32."""
    batches = regression_batches(3, 8, 6, 3, seed=1)
    fp32 = run_training(lambda: make_mlp(SIZES, 1), sgd, batches)
    bf16 = run_training(lambda: make_mlp(SIZES, 1), sgd, batches, [mixed_precision(torch.bfloat16)])
    torch.testing.assert_close(torch.tensor(bf16.losses), torch.tensor(fp32.losses), rtol=BF16_LOSS_RTOL, atol=0)
    assert_trees_close(bf16.state.params, fp32.state.params, rtol=0, atol=BF16_PARAM_ATOL)
    assert bf16.losses != fp32.losses      # bf16 really computed in bf16


# ----------------------------------------------------------------------------------------------
# layout: bf16 params, fp32 master in the (sharded) optimizer state
# ----------------------------------------------------------------------------------------------

def _placed_layout(stage):
    init_mesh()
    n = current_mesh().size("dp")
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = make_step(apply_fn, [shard_zero(stage, param_persistence_threshold=0), mixed_precision(torch.bfloat16)])
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    for batch in regression_batches(2, 4, 6, 3, seed=0):
        state, _ = step(state, batch)
    leaf = lambda x: isinstance(x, Placed)
    p_desc = {k: (isinstance(v, Placed), str(tree.leaves(v)[0].dtype)) for k, v in state.params.items()}
    ms = state.opt_state
    m_desc = {k: (isinstance(v, Placed), str(tree.leaves(v)[0].dtype)) for k, v in ms.master.items()} \
        if isinstance(ms, MasterState) else None
    moments = [(p, isinstance(x, Placed), str(tree.leaves(x)[0].dtype))
               for p, x in tree.leaves_with_path(ms.inner, is_leaf=leaf) if tree.leaves(x)[0].dim() > 0] \
        if isinstance(ms, MasterState) else None
    # the bf16 parameters are exactly the rounded master weights
    piece = lambda x: x.data if isinstance(x, Placed) else FlatShard("dp", tuple(x.shape)).shard(x)
    consistent = all(torch.equal(piece(state.params[k]), piece(ms.master[k]).to(torch.bfloat16)) for k in state.params)
    gathered = step.gather(state)
    return dict(n=n, params=p_desc, master=m_desc, moments=moments, consistent=consistent,
                gathered_dtypes={k: str(v.dtype) for k, v in gathered.params.items()},
                gathered_opt_is_master=has_master_state(gathered.opt_state))


@pytest.mark.parametrize("stage", [1, 3])
def test_placed_state_has_bf16_params_and_sharded_fp32_master(stage):
    for out in run_on_ranks(_placed_layout, 2, stage, timeout=60):
        assert all(dt == "torch.bfloat16" for _, dt in out["params"].values()), out["params"]
        assert all(sharded == (stage == 3) for sharded, _ in out["params"].values()), out["params"]
        assert out["master"] is not None, "mixed_precision must keep master weights in the optimizer state"
        assert set(out["master"]) == set(out["params"])
        assert all(sharded and dt == "torch.float32" for sharded, dt in out["master"].values()), out["master"]
        assert len(out["moments"]) == 2 * len(out["params"])      # Adam m and v
        assert all(sharded and dt == "torch.float32" for _, sharded, dt in out["moments"]), out["moments"]
        assert out["consistent"]
        assert set(out["gathered_dtypes"].values()) == {"torch.float32"}   # gather returns the master
        assert not out["gathered_opt_is_master"]


def test_same_param_and_master_dtype_makes_no_second_copy():
    """mixed_precision(float32) (fp32 params, e.g. under torch.autocast): no MasterState, the state
    is the plain one, and training is bitwise the run without the transform."""
    batches = regression_batches(2, 4, 6, 3, seed=2)
    plain = run_training(lambda: make_mlp(SIZES, 0), lambda: dsfn.optim.adamw(lr=1e-2), batches)
    same = run_training(lambda: make_mlp(SIZES, 0), lambda: dsfn.optim.adamw(lr=1e-2), batches,
                        [mixed_precision(torch.float32)])
    assert same.losses == plain.losses
    assert_trees_equal(_strip(same.state), _strip(plain.state))

    def rank_fn():
        init_mesh()
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
        sizes = {}
        for key, extra in (("mp32", [mixed_precision(torch.float32)]), ("none", [])):
            step = make_step(apply_fn, [shard_zero(3, param_persistence_threshold=0), *extra])
            state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
            state, _ = step(state, batches[0])
            sizes[key] = (has_master_state(state.opt_state),
                          sum(x.numel() * x.element_size() for x in tree.leaves((state.params, state.opt_state))))
        return sizes

    for sizes in run_on_ranks(rank_fn, 2, timeout=60):
        assert sizes["mp32"][0] is False
        assert sizes["mp32"][1] == sizes["none"][1]


def test_same_param_and_master_dtype_with_parameters_of_another_dtype_is_a_config_error():
    """Issue 31: with param_dtype == master_dtype the state is kept as it is, so fp32 parameters
    under mixed_precision(bf16, master_dtype=bf16) would train in fp32 with param_dtype accepted
    and ignored: place refuses it, naming both fixes. Parameters already in that dtype place."""
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = compose(mixed_precision(torch.bfloat16, master_dtype=torch.bfloat16))(lambda s, b: (s, {}))
    with pytest.raises(ConfigError, match=r"param_dtype=bfloat16, master_dtype=bfloat16.*parameters are float32.*"
                                          r"model.to\(torch.bfloat16\)"):
        step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    with pytest.raises(ConfigError, match="parameters are float32"):
        step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    half = {k: v.to(torch.bfloat16) for k, v in params.items()}
    state = step.place(dsfn.TrainState.create(half, dsfn.optim.adamw(lr=1e-2)))
    assert not isinstance(state.opt_state, MasterState)


def test_bf16_grads_and_loss_dtypes():
    """The step sees bf16 gradients (reduced in bf16 by default) and reports an fp32 loss."""
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    grads = []
    step = make_step(apply_fn, [mixed_precision(torch.bfloat16)], capture=grads)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    state, m = step(state, regression_batches(1, 4, 6, 3)[0])
    assert {g.dtype for g in tree.leaves(grads[0])} == {torch.bfloat16}
    assert m["loss"].dtype == torch.float32
    assert {x.dtype for x in tree.leaves(state.opt_state.master)} == {torch.float32}


def test_reduce_dtype_sets_the_bytes_on_the_wire():
    """Gradients are reduced in reduce_dtype: bf16 by default (2 bytes per element), fp32 with
    reduce_dtype=float32 (4 bytes), for stage 0 (all-reduce) and stages 2/3 (reduce-scatter)."""
    batch = regression_batches(1, 4, 6, 3)[0]

    def rank_fn():
        init_mesh()
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
        psi = sum(p.numel() for p in params.values())
        pad = sum(2 * -(-p.numel() // 2) for p in params.values())
        out = {}
        for stage in (0, 2, 3):
            for red in (None, torch.float32):
                step = make_step(apply_fn, [shard_zero(stage, param_persistence_threshold=0),
                                            mixed_precision(torch.bfloat16, reduce_dtype=red)])
                state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
                counters.reset()
                step(state, batch)
                out[(stage, str(red))] = (counters.bytes("dp", "all_reduce") - 8,   # minus the loss metric
                                          counters.bytes("dp", "reduce_scatter"))
        return psi, pad, out

    for psi, pad, out in run_on_ranks(rank_fn, 2, timeout=60):
        assert out[(0, "None")] == (2 * psi, 0)
        assert out[(0, "torch.float32")] == (4 * psi, 0)
        for stage in (2, 3):
            assert out[(stage, "None")] == (0, 2 * pad)
            assert out[(stage, "torch.float32")] == (0, 4 * pad)


class WithFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 3)
        self.frozen = nn.Linear(6, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.lin(x) + self.frozen(x)


def test_bf16_with_frozen_parameters_trains():
    """A frozen (requires_grad=False) fp32 layer under mixed_precision(bf16) with ZeRO-3: it stays
    out of the state and training matches the fp32 reference within the bf16 tolerance (frozen
    weights must be computed with in the compute dtype, as DeepSpeed's bf16 module cast does)."""
    batches = regression_batches(3, 8, 6, 3, seed=1)
    ref = run_training(WithFrozen, sgd, batches)

    def rank_fn():
        res = run_training(WithFrozen, sgd, batches, [shard_zero(3, param_persistence_threshold=0),
                                                      mixed_precision(torch.bfloat16)])
        return res.losses, res.state.params

    for losses, params in run_on_ranks(rank_fn, 2, timeout=60):
        assert sorted(params) == ["lin.bias", "lin.weight"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=BF16_LOSS_RTOL, atol=0)
        assert_trees_close(params, ref.state.params, rtol=0, atol=BF16_PARAM_ATOL)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

def test_mixed_precision_outside_the_parallel_transform_is_a_stack_error():
    for parallel in (shard_zero(2), data_parallel()):
        with pytest.raises(StackError, match="inside"):
            compose(mixed_precision(torch.bfloat16), parallel)
    compose(shard_zero(2), mixed_precision(torch.bfloat16))      # the documented order is fine


@pytest.mark.parametrize("kwargs", [dict(param_dtype=torch.int32), dict(master_dtype="fp32"),
                                    dict(reduce_dtype=torch.int8), dict(compute="bf16")])
def test_bad_dtypes_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        mixed_precision(**kwargs)
