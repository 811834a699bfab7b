"""Donation (`compose(..., donate=True)`, `step(state, batch, donate=True)`): a donated step
reuses its input state's buffers (the optimizer updates in place) and gives bitwise the
states of the non-donated step; the donated state is invalid afterwards and any use of it
raises DonatedStateError; async checkpoints captured by reference stay correct.

Every equality below has its control: the donated run must have reused the input's
buffers (the same storage before and after a step) and the non-donated run must not have,
so switching donation off (or an update path that ignored it) fails the test.
"""
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.errors import ConfigError, DonatedStateError, StackError
from dsfn.models.gpt import GPT, GPTConfig, tp_plan
from dsfn.runtime import init_mesh
from dsfn.state import donation
from dsfn.state.layout import is_placed
from dsfn.testing import assert_trees_equal, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches, token_batches
from dsfn.testing.reference import lm_loss, mse_loss_fp32, train_step_for
from dsfn.transforms import (accumulate, async_checkpoint, clip_grad_norm, compose, mixed_precision, offload,
                             shard_zero, tensor_parallel)

SIZES = [6, 10, 3]                      # 10 and 3 do not divide by 2: ZeRO's padding
BATCHES = regression_batches(4, 8, 6, 3, seed=1)
VOCAB = 64
TOKENS = token_batches(3, 4, 12, VOCAB, seed=1)

OPTIMIZERS = {
    "adamw": lambda: dsfn.optim.adamw(lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda: dsfn.optim.adam(lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adamw-tensor-lr": lambda: dsfn.optim.adamw(lr=torch.tensor(1e-2, dtype=torch.float64), weight_decay=0.1),
    "sgd-momentum": lambda: dsfn.optim.sgd(lr=0.05, momentum=0.9),
    "sgd-nesterov": lambda: dsfn.optim.sgd(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}


def _moment_ptrs(state):
    """Storage addresses of the optimizer state's tensors that mirror parameters (moments,
    momentum, master weights): what a donated step updates in place."""
    out = {}
    for path, x in tree.leaves_with_path(state.opt_state, is_leaf=is_placed):
        t = getattr(x, "data", x)
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            out[path] = t.data_ptr()
    return out


def _train(make_step, make_state, batches, donate):
    """(losses, final logical state, every step's buffers reused?, input states unchanged?)"""
    step = make_step(donate)
    state = make_state(step)
    losses, reused, kept = [], [], []
    for b in batches:
        before = _moment_ptrs(state)
        snapshot = None if donate else tree.map(torch.clone, step.gather(state).replace(tx=None))
        old = state
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        after = _moment_ptrs(state)
        reused.append(bool(before) and all(after.get(p) == v for p, v in before.items()))
        if snapshot is not None:     # immutability, the default: the input reads as before
            kept.append(_equal(snapshot, step.gather(old).replace(tx=None)))
    return losses, step.gather(state).replace(tx=None), reused, kept


def _equal(a, b):
    la, lb = tree.leaves_with_path(a), tree.leaves_with_path(b)
    return [p for p, _ in la] == [p for p, _ in lb] and all(
        x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(la, lb))


def _both(make_step, make_state, batches):
    """The non-donated and the donated run of the same stack, in this process."""
    plain = _train(make_step, make_state, batches, donate=False)
    donated = _train(make_step, make_state, batches, donate=True)
    return plain, donated


def _check_pair(plain, donated, what=""):
    assert donated[0] == plain[0], f"{what}: losses differ {donated[0]} vs {plain[0]}"
    assert_trees_equal(donated[1], plain[1], msg=f"{what}: donated vs non-donated final state")
    assert all(donated[2]), f"{what}: the donated steps did not reuse the input's buffers {donated[2]}"
    assert not any(plain[2]), f"{what}: a non-donated step reused its input's buffers {plain[2]}"
    assert all(plain[3]), f"{what}: a non-donated step changed its input state"


def _mlp_run(stack_fn, tx_fn, batches=BATCHES, loss=mse_loss_fp32):
    def make_step(donate):
        torch.manual_seed(0)
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
        step = compose(*stack_fn(), donate=donate)(train_step_for(apply_fn, loss))
        make_step.params = params
        return step

    def make_state(step):
        return step.place(dsfn.TrainState.create(make_step.params, tx_fn()))
    return _both(make_step, make_state, batches)


# ----------------------------------------------------------------------------------------------
# one process: every update path, bitwise
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("precision", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_donated_steps_equal_non_donated_bitwise(opt, precision):
    stack = (lambda: [mixed_precision(precision)]) if precision is not None else (lambda: [])
    plain, donated = _mlp_run(stack, OPTIMIZERS[opt])
    _check_pair(plain, donated, f"{opt} {precision}")


def test_the_fused_kernel_writes_in_place_under_donation(monkeypatch):
    """The Triton AdamW kernel (Triton's CPU interpreter here; CUDA on a GPU) with out= the inputs."""
    monkeypatch.setenv("DSFN_KERNELS", "triton")
    calls = []
    from dsfn.ops import adamw as kernel
    real = kernel.adamw_update_multi

    def spy(params, *a, **k):
        out = k.get("out")
        calls.append(out is not None and all(o[0] is p for o, p in zip(out, params)))
        return real(params, *a, **k)
    monkeypatch.setattr(kernel, "adamw_update_multi", spy)
    plain, donated = _mlp_run(lambda: [], OPTIMIZERS["adamw"])
    _check_pair(plain, donated, "triton adamw")
    n = len(calls) // 2
    assert calls and not any(calls[:n]) and all(calls[n:]), calls    # the kernel ran, in place when donated


def test_per_call_flag_overrides_the_steps_default():
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = compose(donate=True)(train_step_for(apply_fn))
    s0 = step.place(dsfn.TrainState.create(params, OPTIMIZERS["adamw"]()))
    s1, _ = step(s0, BATCHES[0], donate=False)
    step(s0, BATCHES[1])                           # s0 is still valid: usable once more
    s2, _ = step(s1, BATCHES[1])                   # the Step's default: donates s1
    with pytest.raises(DonatedStateError):
        step(s1, BATCHES[2])
    plain = compose()(train_step_for(apply_fn))    # a non-donating Step donates when asked
    s3, _ = plain(s2, BATCHES[2], donate=True)
    with pytest.raises(DonatedStateError):
        s2.params


def test_explain_is_a_dry_run_even_on_a_donating_step():
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = compose(donate=True)(train_step_for(apply_fn))
    s0 = step.place(dsfn.TrainState.create(params, OPTIMIZERS["adamw"]()))
    before = tree.map(torch.clone, s0.replace(tx=None))
    step.explain(s0, BATCHES[0])
    assert _equal(s0.replace(tx=None), before)


# ----------------------------------------------------------------------------------------------
# a donated state cannot be used again
# ----------------------------------------------------------------------------------------------

def test_every_use_of_a_donated_state_raises(tmp_path):
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    step = compose(donate=True)(train_step_for(apply_fn))
    old = step.place(dsfn.TrainState.create(params, OPTIMIZERS["adamw"]()))
    new, _ = step(old, BATCHES[0])
    uses = {
        "step": lambda: step(old, BATCHES[1]),
        "non-donating step": lambda: step(old, BATCHES[1], donate=False),
        "gather": lambda: step.gather(old),
        "place": lambda: step.place(old),
        "params": lambda: old.params,
        "opt_state": lambda: old.opt_state,
        "step count": lambda: old.step,
        "tree": lambda: tree.leaves(old),
        "replace": lambda: old.replace(step=new.step),
        "apply_gradients": lambda: old.apply_gradients(new.params),
        "checkpoint.save": lambda: ck.save(str(tmp_path / "c"), old),
    }
    for what, use in uses.items():
        with pytest.raises(DonatedStateError, match="donated to the step that made step 1") as e:
            use()
        assert "donate=False" in str(e.value), what
    assert not (tmp_path / "c").exists()
    # the state the donated step returned is whole: it trains on, and (control) a
    # non-donated step leaves its input usable
    newer, _ = step(new, BATCHES[1], donate=False)
    again, _ = step(new, BATCHES[1], donate=False)
    assert _equal(step.gather(newer).replace(tx=None), step.gather(again).replace(tx=None))


def test_a_donated_step_that_fails_invalidates_its_input():
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    inner = train_step_for(apply_fn)

    def failing(state, batch):
        new, m = inner(state, batch)                  # the update has run (in place)
        raise RuntimeError("boom")
    step = compose(donate=True)(failing)
    state = step.place(dsfn.TrainState.create(params, OPTIMIZERS["adamw"]()))
    with pytest.raises(RuntimeError, match="boom"):
        step(state, BATCHES[0])
    with pytest.raises(DonatedStateError, match="failed part-way"):
        state.params
    # control: without donation the same failure leaves the input valid
    state2 = compose()(failing).place(dsfn.TrainState.create(dict(params), OPTIMIZERS["adamw"]()))
    with pytest.raises(RuntimeError, match="boom"):
        compose()(failing)(state2, BATCHES[0])
    assert set(state2.params) == set(params)


def test_bad_donate_arguments_are_dsfn_errors():
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    with pytest.raises(StackError, match="donate"):
        compose(donate="yes")
    step = compose()(train_step_for(apply_fn))
    with pytest.raises(StackError, match="donate"):
        step(dsfn.TrainState.create(params, OPTIMIZERS["adamw"]()), BATCHES[0], donate=1)

    def dict_step(state, batch):
        return state, {}
    with pytest.raises(ConfigError, match="TrainState"):
        compose(donate=True)(dict_step)({"w": torch.ones(2)}, BATCHES[0])
    assert compose(donate=False)(dict_step)({"w": torch.ones(2)}, BATCHES[0])[0]["w"].sum() == 2


def test_writable_refuses_a_tensor_listed_twice():
    a, b = torch.zeros(3), torch.zeros(3)
    assert not donation.writable([a, b])              # donation off
    with donation.donating():
        assert donation.writable([a, b])
        assert not donation.writable([a, b, a])       # an in-place update would apply twice
    assert not donation.may_alias()


# ----------------------------------------------------------------------------------------------
# two ranks: ZeRO 0-3, offload, tensor parallel, and hypothesis over stacks
# ----------------------------------------------------------------------------------------------

def _gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=2, n_head=4, d_model=32))


def _gpt_pair(stack_fn, mesh, tx="adamw"):
    def fn():
        init_mesh(**mesh)

        def make_step(donate):
            torch.manual_seed(0)
            model = _gpt()
            apply_fn, params = dsfn.functionalize(model)
            make_step.params = params
            return compose(*stack_fn(model), donate=donate)(train_step_for(apply_fn, lm_loss))

        def make_state(step):
            return step.init_state(make_step.params, OPTIMIZERS[tx]())
        return _both(make_step, make_state, TOKENS)
    return run_on_ranks(fn, 2, timeout=180)


STACKS = {
    "zero0": ({}, lambda m: [shard_zero(0)]),
    "zero1": ({}, lambda m: [shard_zero(1)]),
    "zero2": ({}, lambda m: [shard_zero(2)]),
    "zero3": ({}, lambda m: [shard_zero(3)]),
    "zero3+offload": ({}, lambda m: [shard_zero(3), offload("cpu")]),
    "zero2+offload+bf16": ({}, lambda m: [shard_zero(2), offload("cpu"), mixed_precision(torch.bfloat16)]),
    "tp2": ({"tp": 2}, lambda m: [tensor_parallel(tp_plan(), model=m)]),
}


@pytest.mark.parametrize("name", sorted(STACKS))
def test_two_ranks_donated_equals_non_donated_bitwise(name):
    mesh, stack = STACKS[name]
    for rank, (plain, donated) in enumerate(_gpt_pair(stack, mesh)):
        _check_pair(plain, donated, f"{name} rank {rank}")


@settings(max_examples=6, deadline=None, derandomize=True)
@given(stage=st.sampled_from([0, 1, 2, 3]), precision=st.sampled_from([None, torch.bfloat16]),
       n_acc=st.sampled_from([1, 2]), clip=st.sampled_from([None, 0.5]),
       tx=st.sampled_from(["adamw", "sgd-momentum"]), off=st.booleans())
def test_hypothesis_stacks_donated_equal_non_donated(stage, precision, n_acc, clip, tx, off):
    def stack(model):
        out = [shard_zero(stage), accumulate(n_acc)]
        if off:
            out.append(offload("cpu"))
        if precision is not None:
            out.append(mixed_precision(precision))
        if clip is not None:
            out.append(clip_grad_norm(clip))
        return out
    for rank, (plain, donated) in enumerate(_gpt_pair(stack, {}, tx)):
        _check_pair(plain, donated, f"stage {stage} offload {off} {precision} acc {n_acc} clip {clip} {tx} "
                                    f"rank {rank}")


# ----------------------------------------------------------------------------------------------
# async checkpoints captured by reference
# ----------------------------------------------------------------------------------------------

WRITE_DELAY_S = 0.4
SAVED = [2, 4]


def _ckpt_run(root, capture, settle):
    """ZeRO-3 on 2 ranks, saving every 2 steps with a slowed writer; the donated run's
    checkpoints against the non-donated run's states. `settle=False` switches off the
    donated step's wait for the writer (the control)."""
    from dsfn.checkpoint import writer
    init_mesh()
    real = writer._write_rank_file

    def slow(*a, **k):
        time.sleep(WRITE_DELAY_S)
        return real(*a, **k)
    writer._write_rank_file = slow
    if not settle:
        donation.settle_readers = lambda: None
    batches = regression_batches(5, 8, 6, 3, seed=2)

    def run(donate, ckpt):
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
        stack = [shard_zero(3)] + ([ckpt] if ckpt is not None else [])
        step = compose(*stack, donate=donate)(train_step_for(apply_fn))
        state = step.init_state(params, OPTIMIZERS["adamw"]())
        logical, blocked = {}, []
        for b in batches:
            t0 = time.perf_counter()
            state, m = step(state, b)
            blocked.append(time.perf_counter() - t0)
            if not donate:
                logical[int(state.step)] = tree.map(torch.clone, step.gather(state).replace(tx=None))
        if ckpt is not None:
            ckpt.wait()
        return step, logical, blocked, step.gather(state).replace(tx=None)

    step, logical, _, plain_final = run(False, None)
    t = async_checkpoint(f"{root}/{capture}", every=2, capture=capture)
    step, _, blocked, donated_final = run(True, t)
    equal = {"final state": _equal(donated_final, plain_final)}
    for s in SAVED:
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
        like = compose(shard_zero(3))(train_step_for(apply_fn)).init_state(params, OPTIMIZERS["adamw"]())
        loaded = step.gather(ck.load(f"{root}/{capture}/step_{s:08d}", like)).replace(tx=None)
        equal[s] = _equal(loaded, logical[s])
    return equal, blocked


@pytest.mark.parametrize("capture", ["reference", "copy"])
def test_async_checkpoints_stay_correct_under_donation(tmp_path, capture):
    for rank, (equal, blocked) in enumerate(run_on_ranks(_ckpt_run, 2, str(tmp_path), capture, True, timeout=120)):
        assert all(equal.values()), f"rank {rank} {capture}: checkpoint != the non-donated state {equal}"
        after_save = [blocked[s] for s in SAVED]          # the step after each save (0-based index s)
        if capture == "reference":
            # the donated step waits for the writer that still reads the old buffers
            assert min(after_save) >= WRITE_DELAY_S / 2, (capture, blocked)
        else:
            # a copied capture holds no references: the next donated step never waits
            assert max(after_save) < WRITE_DELAY_S / 2, (capture, blocked)


def test_control_without_the_wait_a_reference_capture_would_be_overwritten(tmp_path):
    for rank, (equal, _) in enumerate(run_on_ranks(_ckpt_run, 2, str(tmp_path), "reference", False, timeout=120)):
        assert not all(equal.values()), f"rank {rank}: the control did not corrupt the checkpoint {equal}"
