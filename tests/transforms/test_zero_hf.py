"""shard_zero on a Hugging Face Llama (random init from a config): units from `_no_split_modules`,
tied embeddings, labels-in-forward loss; equals the single-process run."""
import warnings

import pytest
import torch
import transformers   # the `hf` extra, installed by ./dev

import dsfn
from dsfn.runtime import collectives as C
from dsfn.testing.models import token_batches
from dsfn.testing.reference import assert_matches_reference, run_training
from dsfn.testing import run_on_ranks
from dsfn.transforms import shard_zero



def make_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(cfg)


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
