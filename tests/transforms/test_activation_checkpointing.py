"""A model's own activation checkpointing is right under functionalize and every stack.

Hugging Face's `gradient_checkpointing_enable()` (both `use_reentrant` modes) and a user's
own `torch.utils.checkpoint` calls recompute part of the forward in backward. The
recompute must see the step's parameters (not the module's own), ZeRO-3 must re-gather
the unit for it, tensor and sequence parallel must re-issue their collectives. Each run
is compared with the same model trained without checkpointing: 3 SGD-momentum steps,
fp32 rtol 1e-5 on losses and the final logical state. Negative control: the step's
set-up for the forward torn down as soon as the forward returns (what dsfn did before),
so the recompute runs on the module's own stale weights: the run must differ.
"""
from __future__ import annotations

import contextlib
import functools
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import dsfn
import dsfn.functional as functional
from dsfn.errors import ConfigError, RankFailure
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import lm_loss, mse_loss, train_step_for
from dsfn.transforms import data_parallel, sequence_parallel, shard_zero, tensor_parallel

pytest.importorskip("transformers")

BATCHES = token_batches(3, 4, 12, 101, seed=2)


def _model(family: str, mode: str | None):
    m = make_tiny_causal_lm(family)
    if mode in ("non_reentrant", "reentrant"):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    elif mode is not None:      # transformers 5's name for it
        m.activation_checkpointing_enable({"use_reentrant": mode == "ac_reentrant"})
    m.train()
    return m


def _train(family, mode, make_stack, mesh=None, stale: bool = False):
    if mesh:
        init_mesh(**mesh)
    model = _model(family, mode)
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(*make_stack(model))(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.5, momentum=0.9)))
    losses = []
    patch = mock.patch.object(functional, "until_backward", _exit_at_once) if stale else contextlib.nullcontext()
    with patch:
        for b in BATCHES:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
    full = step.gather(state)
    return losses, {"params": full.params, "opt_state": full.opt_state}


@contextlib.contextmanager
def _exit_at_once(cm):
    with cm as v:
        yield v


def _check(family, mode, make_stack, world, mesh=None, ref=None):
    ref = ref or _train(family, None, lambda m: [])
    runs = [_train(family, mode, make_stack, mesh)] if world == 1 else \
        run_on_ranks(_train, world, family, mode, make_stack, mesh, timeout=180)
    for losses, state in runs:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
        assert_trees_close(state, ref[1], rtol=1e-5, atol=1e-6)


MODES = ["non_reentrant", "reentrant"]
STACKS = {
    "none": (lambda m: [], 1, None),
    "data_parallel": (lambda m: [data_parallel()], 2, None),
    "zero3": (lambda m: [shard_zero(3)], 2, None),
    "tp2": (lambda m: [tensor_parallel("auto", model=m)], 2, {"tp": 2}),
    "sp2": (lambda m: [sequence_parallel()], 2, {"sp": 2}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_gradient_checkpointing_equals_no_checkpointing(family, stack, mode):
    make, world, mesh = STACKS[stack]
    _check(family, mode, make, world, mesh)


@pytest.mark.parametrize("mode", ["ac", "ac_reentrant"])
@pytest.mark.parametrize("stack", ["none", "zero3", "sp2"])
def test_activation_checkpointing_enable_equals_no_checkpointing(stack, mode):
    """transformers 5's name, `activation_checkpointing_enable(...)`, in both reentrant modes.
    (Its `offload=True` pins host memory through torch's save_on_cpu, which raises on a
    machine without CUDA before dsfn is involved, so it is not tested here.)"""
    import transformers
    if not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
        pytest.skip("this transformers has no activation_checkpointing_enable (added in transformers 5)")
    make, world, mesh = STACKS[stack]
    _check("llama", mode, make, world, mesh)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dp2_x_tp2_with_zero3(family, mode):
    _check(family, mode, lambda m: [shard_zero(3), tensor_parallel("auto", model=m)], 4, {"dp": 2, "tp": 2})


def test_negative_control_a_recompute_on_stale_weights_differs():
    ref = _train("llama", None, lambda m: [])
    losses, state = _train("llama", "non_reentrant", lambda m: [], stale=True)
    diff = max(float((state["params"][k] - ref[1]["params"][k]).abs().max()) for k in ref[1]["params"])
    assert diff > 1e-4, diff


# -- a user's own checkpoint calls ------------------------------------------------------------------

class Blocks(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)      # the blocks' input requires grad (reentrant needs that)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 2)
        self.how = how

    def forward(self, x):
        x = self.inp(x)
        if self.how == "checkpoint":
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=False)
        elif self.how == "sequential":
            x = checkpoint_sequential(nn.Sequential(*self.blocks), 2, x, use_reentrant=False)
        elif self.how == "reentrant":
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=True)
        else:
            for b in self.blocks:
                x = b(x)
        return self.head(x)


def _blocks_run(how, make_stack):
    apply_fn, params = dsfn.functionalize(Blocks(how))
    step = dsfn.compose(*make_stack())(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.3, momentum=0.9)))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        state, _ = step(state, {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 2, generator=g)})
    return step.gather(state).params


@pytest.mark.parametrize("how", ["checkpoint", "sequential"])
@pytest.mark.parametrize("stack", ["none", "zero3"])
def test_users_own_checkpoint_calls_equal_no_checkpointing(how, stack):
    make = (lambda: []) if stack == "none" else (lambda: [shard_zero(3)])
    ref = _blocks_run("plain", lambda: [])
    got = [_blocks_run(how, make)] if stack == "none" else run_on_ranks(_blocks_run, 2, how, make)
    for params in got:
        assert_trees_close(params, ref, rtol=1e-5, atol=1e-6)


def _gpt_run(ckpt, make_stack, mesh=None):
    """The example GPT (AutoSP attention: a torch-function mode) with each block run through the
    user's own `checkpoint(...)` call (or not), 3 SGD-momentum steps."""
    from dsfn.models.gpt import GPT, GPTConfig
    from dsfn.testing.models import token_batches
    if mesh:
        init_mesh(**mesh)
    model = GPT(GPTConfig(vocab_size=97, seq_len=16, n_layer=3, n_head=4, d_model=32), seed=0)
    if ckpt:
        for b in model.blocks:
            b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False)
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(*make_stack())(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.5, momentum=0.9)))
    for b in token_batches(3, 4, 16, 97, seed=3):
        state, _ = step(state, b)
    return step.gather(state).params


def _gpt_run_without_mode_reentry(*args):
    with mock.patch.object(functional, "_recompute_under_forward_modes", contextlib.nullcontext):
        return _gpt_run(*args)


def test_users_own_checkpoint_under_autosp_equals_no_checkpointing():
    """A non-HF model's own checkpoint under sequence_parallel: the recompute re-enters the
    AutoSP attention mode, so it attends over the whole sequence as the forward did."""
    ref = _gpt_run(False, lambda: [])
    for params in run_on_ranks(_gpt_run, 2, True, lambda: [sequence_parallel()], {"sp": 2}, timeout=180):
        assert_trees_close(params, ref, rtol=1e-5, atol=1e-6)


def test_negative_control_without_reentering_the_mode_the_recompute_differs():
    with pytest.raises(RankFailure, match="CheckpointError"):
        run_on_ranks(_gpt_run_without_mode_reentry, 2, True, lambda: [sequence_parallel()], {"sp": 2}, timeout=180)


def test_users_reentrant_checkpoint_is_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match="use_reentrant=False"):
        _blocks_run("reentrant", lambda: [])


def _held_units(mode):
    from dsfn.runtime import collectives as C
    model = make_tiny_causal_lm("llama", num_hidden_layers=6)
    if mode:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(shard_zero(3))(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.5)))
    C.reset_gauges()
    step(state, BATCHES[0])
    return C.gauge_max.get("zero3.backward_units"), C.gauge_max.get("zero3.live_units")


def test_zero3_recompute_keeps_the_gathered_units_bounded():
    """6 layers, prefetch 1: backward (recompute included) holds at most the unit it works on
    and the next one, as without checkpointing — the recompute re-gathers, then frees."""
    for with_ckpt, (bw, fw) in zip((False, True), run_on_ranks(lambda: [_held_units(m) for m in (False, True)], 2)[0]):
        assert bw is not None and bw <= 2, (with_ckpt, bw)
        assert fw <= 2, (with_ckpt, fw)
