"""shard_zero on a Hugging Face Llama (random init from a config): units from `_no_split_modules`,
tied embeddings, labels-in-forward loss; equals the single-process run."""

import pytest

import dsfn
from dsfn.runtime import collectives as C
from dsfn.testing.models import make_tiny_llama, token_batches
from dsfn.testing.reference import assert_matches_reference, run_training
from dsfn.testing import run_on_ranks
from dsfn.transforms import shard_zero



def make_llama():
    return make_tiny_llama()


def hf_loss(apply_fn, params, batch):
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_llama_under_zero_equals_reference(stage):
    assert_matches_reference(lambda: [shard_zero(stage, param_persistence_threshold=0)], make_llama,
                             lambda: dsfn.optim.sgd(lr=0.1, momentum=0.9), token_batches(2, 4, 16, 128), 2,
                             loss_fn=hf_loss, rtol=1e-5, atol=1e-6)


def _live_units():
    C.reset_gauges()
    run_training(make_llama, lambda: dsfn.optim.sgd(lr=0.1), token_batches(1, 4, 8, 128),
                 [shard_zero(3, param_persistence_threshold=0, prefetch=1)], hf_loss)
    return C.gauge_max.get("zero3.live_units")


def test_llama_units_are_decoder_layers_with_prefetch_one():
    # 3 decoder layers, prefetch 1: at most 2 gathered at once (root excluded)
    assert run_on_ranks(_live_units, 2, timeout=60) == [2, 2]
