"""Sharded evaluation (README): a step of the training stack whose function returns the
state unchanged, under `torch.no_grad()`, evaluates the whole global batch with the
sharded parameters (ZeRO gathers unit by unit, tp computes on its pieces), equals the
single-process loss of the same trained parameters, and touches no optimizer state."""
from __future__ import annotations

import torch

import dsfn
from dsfn.models.gpt import GPT, GPTConfig, tp_plan
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import data_parallel, offload, shard_zero, tensor_parallel

STACKS = {
    "data_parallel": ({}, lambda m: [data_parallel()]),
    "zero2": ({}, lambda m: [shard_zero(2)]),
    "zero3": ({}, lambda m: [shard_zero(3)]),
    "zero3+offload": ({}, lambda m: [shard_zero(3), offload("cpu", params=True, pin_memory=False)]),
    "dp2xtp2+zero3": (dict(dp=2, tp=2), lambda m: [shard_zero(3), tensor_parallel(tp_plan(), model=m)]),
}
CFG = dict(n_layer=2)
TRAIN = token_batches(2, 8, 16, 256, seed=3)
EVAL = token_batches(1, 8, 16, 256, seed=9)[0]


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", **CFG))


def _optimizer():
    return dsfn.optim.sgd(lr=0.5, momentum=0.9)


def _evaluate_under(kinds):
    out = {}
    for kind in kinds:
        mesh, make = STACKS[kind]
        init_mesh(**mesh)
        model = _model()
        apply_fn, params = dsfn.functionalize(model)
        step = dsfn.compose(*make(model))(train_step_for(apply_fn, lm_loss))
        state = step.init_state(params, _optimizer())
        for b in TRAIN:
            state, _ = step(state, b)

        def eval_step(s, batch):
            with torch.no_grad():
                return s, {"loss": lm_loss(apply_fn, s.params, batch)}
        evaluate = dsfn.compose(*make(model))(eval_step)
        before = [t for t in dsfn.tree.leaves(state.opt_state)]
        same_state, m = evaluate(state, EVAL)
        untouched = (same_state is state and all(a is b for a, b in zip(dsfn.tree.leaves(state.opt_state), before))
                     and all(not isinstance(t, torch.Tensor) or t.grad is None for t in dsfn.tree.leaves(state.params)))
        full = step.gather(state).params
        out[kind] = (float(m["loss"]), untouched, full)
    return out


def test_sharded_eval_equals_the_single_process_loss_of_the_trained_params():
    """Every stack's eval loss over the global batch equals the reference loss of the
    gathered trained parameters on that batch, on every rank; the state passes through
    untouched. Control: the untrained parameters' loss differs (the equality is not vacuous)."""
    kinds = list(STACKS)
    results = run_on_ranks(_evaluate_under, 4, kinds, timeout=240)
    apply_fn, untrained = dsfn.functionalize(_model())
    untrained_loss = float(lm_loss(apply_fn, untrained, EVAL))
    for kind in kinds:
        full = results[0][kind][2]
        expect = float(lm_loss(apply_fn, full, EVAL))
        assert abs(expect - untrained_loss) > 1e-2, (kind, expect, untrained_loss)
        for r, res in enumerate(results):
            loss, untouched, _ = res[kind]
            assert untouched, (kind, r)
            assert abs(loss - expect) <= 1e-5 * abs(expect), (kind, r, loss, expect)
