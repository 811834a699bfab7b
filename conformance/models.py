"""The conformance matrix's models: `MODELS` (name -> `ModelSpec`: how to build the model, its
batches, its loss, and which transforms apply to it), trained for `STEPS` steps.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsfn.testing.models import BatchNormMLP, Routed, make_mlp, make_tiny_causal_lm, regression_batches, routed_batches, \
    token_batches

VOCAB = 101
STEPS = 3


def _lm_loss(apply_fn, params, batch):
    logits = apply_fn(params, batch["input_ids"])
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1),
                           ignore_index=-100)


def _hf_labels_loss(apply_fn, params, batch):
    """A Hugging Face user's train step: the model's own loss (`labels=`: it shifts them)."""
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch.get("hf_labels", batch["input_ids"])).loss


def _prompted_tokens():
    """`_tokens` with `hf_labels`: the input ids, each row's prompt ignored (-100), prompts
    of different lengths, so ranks, micro-batches and sequence slices hold different numbers
    of valid targets: a loss normalised over a part instead of the whole batch differs."""
    out = []
    for b in _tokens():
        labels = b["input_ids"].clone()
        for r in range(labels.shape[0]):
            labels[r, :(3 * r) % 11] = -100
        out.append({**b, "hf_labels": labels})
    return out


def _mse_loss(apply_fn, params, batch):
    return F.mse_loss(apply_fn(params, batch["x"]).float(), batch["y"])


def _gpt():
    from dsfn.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=2, n_head=4, d_model=32))


def _hf_ckpt(reentrant: bool) -> nn.Module:
    m = make_tiny_causal_lm("llama")
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return m.train()


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    make: Callable[[], nn.Module]
    batches: Callable[[], list]
    loss: Callable
    attention: bool = False          # sequence parallel applies
    tp: str | None = None            # "auto" (HF plan) | "gpt" (dsfn's plan) | None (no plan)
    batch_stats: bool = False        # normalises by batch statistics (BatchNorm): see `_reference`
    reference_make: Callable[[], nn.Module] | None = None   # the reference's model, when it differs
    rtol: float = 1e-5               # a model's own floor, where one needs it
    layers: int = 2                  # repeated blocks (pipeline stages are cut from them)
    experts: str | dict | None = None  # expert parallel's plan: "auto" (HF's ep plan) | a dict | None (no MoE)
    drawn: bool = True               # drawn by the default sample's least-used choice; False: only in the
    #                                  rows a stack names it for (`StackSpec.models`)


def _moe():
    from dsfn.testing.models import TinyMoE
    return TinyMoE(seed=1)


def _moe_batches():
    from dsfn.testing.models import moe_batches
    return moe_batches(STEPS, 8, 4, seed=3)


def _tokens():
    return token_batches(STEPS, 8, 12, VOCAB, seed=1)     # rows divisible by world 4 x accumulate 2


def _packed_tokens():
    """`_tokens` as packed rows: position_ids restart where a new document begins (after 5 or
    7 tokens, differing by row), so no token may attend across a boundary."""
    out = []
    for b in _tokens():
        rows, t = b["input_ids"].shape
        pid = torch.stack([torch.cat([torch.arange(5 + 2 * (r % 2)), torch.arange(t - 5 - 2 * (r % 2))])
                           for r in range(rows)])
        out.append({**b, "position_ids": pid})
    return out


def _packed_loss(apply_fn, params, batch):
    # use_cache=False: with a cache, Hugging Face masks packed rows only causally
    logits = apply_fn(params, input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1),
                           ignore_index=-100)


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(lambda: make_mlp([6, 10, 3], seed=1), lambda: regression_batches(STEPS, 8, 6, 3, seed=3),
                     _mse_loss),
    "routed": ModelSpec(lambda: Routed(True, seed=1), lambda: routed_batches(STEPS, 8), _mse_loss),
    # 32 rows: at world 4 with accumulate(2) each BatchNorm batch has 4 rows. With 16 (2 rows
    # per batch) normalising divides by |x1 - x2|, and zero3+accumulate's AdamW rows at w4 missed
    # by 1.8e-4 on the input bias (whose gradient is exactly zero, so all noise) even at rtol
    # 5e-5; with 4 rows all 322 BatchNorm rows pass at the common rtol 1e-5
    "batchnorm": ModelSpec(lambda: BatchNormMLP(seed=1), lambda: regression_batches(STEPS, 32, 6, 3, seed=3), _mse_loss,
                           batch_stats=True),
    "gpt": ModelSpec(_gpt, _tokens, _lm_loss, attention=True, tp="gpt"),
    # mixtures of experts: a tiny HF Mixtral (4 experts, top-2, its own loss; `plan="auto"`) and
    # dsfn's TinyMoE (a shared expert beside 4 routed ones, an explicit plan). Without the
    # router's balance loss here: it is not linear in the rows, so the stacks that split a
    # step into micro-batches (accumulate, pipelines, mixed precision's reference) refuse it;
    # tests/transforms/test_expert_parallel.py trains it under expert parallel
    # (its labels ignore prompts of uneven lengths: ranks hold different numbers of targets)
    "mixtral": ModelSpec(lambda: make_tiny_causal_lm("mixtral", output_router_logits=False), _prompted_tokens,
                         _hf_labels_loss, attention=True, tp="auto", experts="auto"),
    "moe": ModelSpec(_moe, _moe_batches, _mse_loss, experts={"experts": "experts"}),
    "llama": ModelSpec(lambda: make_tiny_causal_lm("llama"), _tokens, _lm_loss, attention=True, tp="auto"),
    "qwen2": ModelSpec(lambda: make_tiny_causal_lm("qwen2"), _tokens, _lm_loss, attention=True, tp="auto"),
    "gemma2": ModelSpec(lambda: make_tiny_causal_lm("gemma2"), _tokens, _lm_loss, attention=True, tp="auto"),
    # the mask axis (the sequence-splitting stacks name them): a sliding window of 5 (Mistral,
    # sdpa) and packed documents (position_ids restarting: a block-diagonal causal mask)
    "mistral": ModelSpec(lambda: make_tiny_causal_lm("mistral"), _tokens, _lm_loss, attention=True, tp="auto",
                         drawn=False),
    "llama+packed": ModelSpec(lambda: make_tiny_causal_lm("llama"), _packed_tokens, _packed_loss, attention=True,
                              tp="auto", drawn=False),
    # the loss axis: Hugging Face's own loss (labels=), sequence parallel shifting the labels
    # over the whole sequence; llama's labels ignore prompts of uneven lengths
    "llama+labels": ModelSpec(lambda: make_tiny_causal_lm("llama"), _prompted_tokens, _hf_labels_loss,
                              attention=True, tp="auto"),
    "qwen2+labels": ModelSpec(lambda: make_tiny_causal_lm("qwen2"), _tokens, _hf_labels_loss, attention=True,
                              tp="auto"),
    # 4 query / 1 key-value heads: tensor parallel's ranks share replicas of the one kv head
    # 4 layers: pipeline schedules with 2 stages per rank (interleaved, ZBV) at pp 2
    "qwen2+4layers": ModelSpec(lambda: make_tiny_causal_lm("qwen2", num_hidden_layers=4), _tokens, _lm_loss,
                               attention=True, tp="auto", layers=4),
    "llama+kv1": ModelSpec(lambda: make_tiny_causal_lm("llama", num_attention_heads=4, num_key_value_heads=1),
                           _tokens, _lm_loss, attention=True, tp="auto"),
    # the activation-checkpointing axis: HF's own checkpointing, compared with the model without it
    "llama+hf_ckpt": ModelSpec(lambda: _hf_ckpt(False), _tokens, _lm_loss, attention=True, tp="auto",
                               reference_make=lambda: make_tiny_causal_lm("llama")),
    "llama+hf_ckpt_reentrant": ModelSpec(lambda: _hf_ckpt(True), _tokens, _lm_loss, attention=True, tp="auto",
                                         reference_make=lambda: make_tiny_causal_lm("llama")),
}


def _lora_llama() -> nn.Module:
    """The usual LoRA fine-tune: peft's `PeftModelForCausalLM` around a tiny Llama (r=4 on
    q_proj / v_proj; B random too, so A trains from the first step); the base is frozen, and
    the inner `LlamaForCausalLM` computes the loss."""
    import peft
    lm = make_tiny_causal_lm("llama")
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
    return peft.get_peft_model(lm, cfg)


MODELS["llama+lora"] = ModelSpec(_lora_llama, _prompted_tokens, _hf_labels_loss, attention=True, tp="auto")
