"""A mixture-of-experts model's router load-balancing loss (Mixtral, `output_router_logits=
True`: HF adds it to `labels=`'s loss) under data and sequence parallelism equals the
single-process loss of the whole batch: the assignment and row counts are summed over the
ranks (`dsfn.integrations.hf.global_router_balance`). HF's own function sees this rank's rows
only: averaged over dp it is not the batch's loss (it is not linear in the rows), summed over
sp it counts the loss sp times.

Equality: SGD-momentum, 3 steps, losses and final state at fp32 rtol 1e-5. Negative control:
HF's function left in place differs (sp: by about the whole auxiliary loss). Accumulation is
refused (ConfigError): the whole batch's routing is known only after every micro-batch.
"""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import hf_labels_loss, run_steps, train_step_for
from dsfn.transforms import accumulate, compose, data_parallel, sequence_parallel, shard_zero

pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-6)
STACKS = {
    "dp2": (lambda: (data_parallel(),), 2, {"dp": 2}),
    "zero3": (lambda: (shard_zero(3),), 2, {"dp": 2}),
    "sp2": (lambda: (sequence_parallel(),), 2, {"sp": 2}),
    "dp2xsp2+zero3": (lambda: (sequence_parallel(), shard_zero(3)), 4, {"dp": 2, "sp": 2}),
}


def batches(t=16, masked=True):
    out = []
    for b in token_batches(3, 4, t, 101, seed=1):
        if not masked:
            out.append({"input_ids": b["input_ids"], "labels": b["input_ids"]})
            continue
        mask = torch.ones_like(b["input_ids"])
        mask[1, :5] = 0                       # left padding in one row: masked rows leave the statistics
        labels = b["input_ids"].masked_fill(mask == 0, -100)
        out.append({"input_ids": b["input_ids"], "labels": labels, "attention_mask": mask})
    return out


def loss(apply_fn, params, batch):
    extra = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"], **extra).loss


def train(make_transforms, mesh=None, sabotage=False, t=16, masked=True):
    if mesh:
        init_mesh(**mesh)
    if sabotage:       # the control: HF's function on this rank's rows, as before
        import contextlib
        from dsfn.integrations.hf import router
        router.global_router_balance = lambda *a, **k: contextlib.nullcontext()
    model = make_tiny_causal_lm("mixtral")
    apply_fn, params = dsfn.functionalize(model)
    step = compose(*make_transforms())(train_step_for(apply_fn, loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    return run_steps(step, state, batches(t, masked))


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_router_balance_loss_is_the_whole_batch_loss(stack):
    make, world, mesh = STACKS[stack]
    ref_losses, ref_state = train(lambda: ())
    for losses, state in run_on_ranks(train, world, make, mesh, timeout=240):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        assert_trees_close(state, ref_state, **TOL)


def test_sp_padding_to_a_multiple_of_sp_is_no_token_of_the_router_loss():
    """15 tokens at sp 2, no attention mask: sequence parallel pads to 16, and the padding's
    rows are left out of the statistics (measured before: 5.7365 against 5.7331 at step 3)."""
    ref_losses, ref_state = train(lambda: (), t=15, masked=False)
    for losses, state in run_on_ranks(train, 2, STACKS["sp2"][0], {"sp": 2}, False, 15, False, timeout=240):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        assert_trees_close(state, ref_state, **TOL)


@pytest.mark.parametrize("stack", ["dp2", "sp2"])
def test_negative_control_this_ranks_rows_only_differ(stack):
    make, world, mesh = STACKS[stack]
    ref_losses, _ = train(lambda: ())
    losses, _ = run_on_ranks(train, world, make, mesh, True, timeout=240)[0]
    assert not torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), **TOL), (losses, ref_losses)


def test_accumulate_with_a_router_loss_is_refused():
    model = make_tiny_causal_lm("mixtral")
    apply_fn, params = dsfn.functionalize(model)
    step = compose(accumulate(2))(train_step_for(apply_fn, hf_labels_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5))
    ids = token_batches(1, 4, 16, 101, seed=1)[0]["input_ids"]
    with pytest.raises(ConfigError, match="router load-balancing loss"):
        step(state, {"input_ids": ids, "labels": ids})


def test_only_routers_whose_loss_dsfn_reproduces_are_replaced():
    """Mixtral-style functions (softmax router, top-k shares x mean probabilities) are
    replaced; Doge's product-key router and Switch's router_probs are not (a model using them
    is refused under dp / sp instead)."""
    from transformers.models.doge import modeling_doge
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.switch_transformers import modeling_switch_transformers
    from dsfn.integrations.hf.router import _switch_balance_loss
    assert _switch_balance_loss(modeling_mixtral.load_balancing_loss_func)
    assert _switch_balance_loss(modeling_qwen2_moe.load_balancing_loss_func)
    assert not _switch_balance_loss(modeling_doge.load_balancing_loss_func)
    assert not _switch_balance_loss(modeling_switch_transformers.load_balancing_loss_func)
