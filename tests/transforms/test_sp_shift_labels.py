"""`sequence_parallel(shift_labels=True)` adds `batch["shift_labels"]` at every sp size, so
the same step runs in one process (it was a KeyError at sp = 1); a Hugging Face loss given
`shift_labels=` without `labels=` is refused with what to pass (HF computes no loss then)."""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError, RankFailure
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.transforms import sequence_parallel

pytest.importorskip("transformers")


def _run(sp: int, both: bool):
    from dsfn.testing.models import make_tiny_causal_lm
    model = make_tiny_causal_lm("llama")
    apply_fn, params = dsfn.functionalize(model)

    def loss_fn(p, batch):
        kw = {"labels": batch["labels"]} if both else {}
        return apply_fn(p, input_ids=batch["input_ids"], shift_labels=batch["shift_labels"], **kw).loss

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    if sp > 1:
        init_mesh(sp=sp)
    step = dsfn.compose(sequence_parallel(shift_labels=True))(train_step)
    state = step.place(dsfn.TrainState.create(params, tx=dsfn.optim.sgd(0.1)))
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    _, metrics = step(state, {"input_ids": ids, "labels": ids})
    return float(metrics["loss"])


def test_shift_labels_at_sp_1_runs_and_equals_sp_2():
    one = run_on_ranks(_run, 1, 1, True, timeout=120)[0]
    two = run_on_ranks(_run, 2, 2, True, timeout=120)
    assert all(abs(one - x) < 1e-5 for x in two), (one, two)


def test_shift_labels_without_labels_says_to_pass_both():
    with pytest.raises(RankFailure) as e:
        run_on_ranks(_run, 2, 2, False, timeout=120)
    msg = str(e.value)
    assert "ConfigError" in msg and "without labels=" in msg and "labels=batch['labels']" in msg, msg
